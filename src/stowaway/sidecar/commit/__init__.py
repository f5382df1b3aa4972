"""Turning durable rank files into a committed checkpoint.

Per step, this sidecar admits the ranks' persists (``admission``), gathers
its local ranks' durable files into its node's receipt (``gathering``), and
then:
- if it hosts global rank 0, waits until receipts of this run cover every
  rank, writes the manifest (the commit) and ``latest``, and applies
  retention (``publishing``);
- otherwise waits until that node's manifest for this run appears.
Both waits end at the commit timeout, or as soon as another node's failure
notice for this run appears (``notices``): a node that fails a step of a
multi-node job writes one, since the sidecars share nothing but the storage.
``coordinator`` runs each step through these parts and tells the ranks;
every wait and timestamp goes through one ``timing.Clock``.
"""

from stowaway.sidecar.commit.coordinator import Committer

__all__ = ["Committer"]
