"""The training-side client: ``Checkpointer`` and ``SaveHandle``.

Data path of a save: ``checkpointer.save`` → ``rank_slots`` (take a slot the
``ledger`` has idle) → ``stowaway.format.codec`` (copy tensors into it) →
``link`` (send ``persist`` on this rank's own socket, ``connection``) → the
sidecar answers ``released`` on the same socket, and ``answers`` gives the
slot back to the rank through the ledger.
"""
