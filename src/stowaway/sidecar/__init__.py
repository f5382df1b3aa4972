"""The saver sidecar: persists slots to storage and commits checkpoints.

Rule of this package: it moves bytes and never imports torch or kopf, so its
image stays slim and it starts in well under a second. Read it in data-path
order: ``server`` (lifecycle) → ``session`` (one rank's connection) →
``ranks`` (slot ownership) → ``persister`` (slot to file) → ``commit``
(receipts and manifest) → ``retention``; ``restore`` serves ``load()``.
"""
