"""The socket protocol between a rank and its sidecar.

Rule of this package: no I/O. It turns bytes into messages and messages into
bytes, and validates them, so the same code serves the blocking client, the
asyncio sidecar and the fuzz tests. Specification: ``docs/protocol.md``.
"""
