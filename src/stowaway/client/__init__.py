"""The training-side client: ``Checkpointer`` and ``SaveHandle``.

Data path of a save: ``checkpointer.save`` → ``pool`` (take a slot this rank
owns) → ``stowaway.format.codec`` (copy tensors into it) → ``connection``
(send ``persist`` on this rank's own socket) → the sidecar answers
``released`` on the same socket, and the slot is this rank's again.
"""
