"""Stowaway's benchmark harness: one run measures Stowaway, the physical references and the peers.

``python -m bench --help`` (or ``make bench``) runs it; ``docs/benchmarks.md`` holds the latest results.
"""
