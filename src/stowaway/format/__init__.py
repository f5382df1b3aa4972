"""The payload format: a state dict as one ``.safetensors`` file image.

A slot's payload is byte for byte the file the sidecar writes, so persisting
is a straight copy and standard tools read the result. Tensors are stored raw;
the nested structure and non-tensor leaves travel as JSON in the header's
metadata. Specification: ``docs/storage-format.md``.
"""
