"""The operator's fixtures, registered here once for every k8s test module.

A session-scoped fixture imported into two test modules is two fixtures, one
per module: two operator processes with two webhooks, each called for every pod.
"""

from __future__ import annotations

from .operator_fixtures import checkpointpolicy_crd, operator_kubeconfig, ready_policy, stowaway_operator

__all__ = ["checkpointpolicy_crd", "operator_kubeconfig", "ready_policy", "stowaway_operator"]
