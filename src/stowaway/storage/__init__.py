"""Durable storage: directory layout, crash-safe writes, manifests, the catalogue.

Rule of this package: no torch and no sockets. The sidecar writes through it;
the CLI and the restore path read through it. Specification of the on-disk
format: ``docs/storage-format.md``.
"""
