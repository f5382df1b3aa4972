"""Shared-memory slots: the buffers a rank writes and the sidecar persists.

Rule of this package: no torch. The sidecar maps the same files to move bytes,
and its image does not ship torch. Specification of the header:
``docs/slot-format.md``.
"""
