"""CheckpointPolicy: the checks the CRD schema cannot express, and the status they produce.

Pure: the handler in :mod:`main` looks up what these functions need (does the
claim exist?) and writes back the status they return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GROUP = "stowaway.dev"
VERSION = "v1alpha1"
PLURAL = "checkpointpolicies"
KIND = "CheckpointPolicy"


@dataclass(frozen=True)
class Verdict:
    """The ``Ready`` condition of a policy: ``reason`` is CamelCase, ``message`` is for people."""

    ready: bool
    reason: str
    message: str


def judge(spec: Mapping[str, Any], claim_exists: bool) -> Verdict:
    """Decide whether pods may be injected with this policy.

    The schema already bounds every field (``persistence.checksum`` to the one
    the sidecar implements, a claim or a bucket or both); what remains needs
    the cluster: the claim, where the policy names one.
    """
    storage = spec["storage"]
    claim = (storage.get("persistentVolumeClaim") or {}).get("claimName")
    url = (storage.get("bucket") or {}).get("url")
    if claim is not None and not claim_exists:
        return Verdict(
            False, "ClaimNotFound",
            f"PersistentVolumeClaim {claim!r} does not exist in this namespace; create it or fix "
            "spec.storage.persistentVolumeClaim.claimName",
        )
    if claim is None:
        where = f"bucket {url!r} (no claim: each rank's slot is held until its upload ends)"
    else:
        where = f"claim {claim!r}" + (f", then bucket {url!r}" if url else "")
    return Verdict(True, "Valid", f"pods labelled stowaway.dev/inject=enabled get a sidecar storing to {where}")


def status(verdict: Verdict, generation: int, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """The status to store; ``lastTransitionTime`` moves only when ``Ready`` flips."""
    value = "True" if verdict.ready else "False"
    before = next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    transition = before["lastTransitionTime"] if before and before.get("status") == value else now
    return {
        "observedGeneration": generation,
        "conditions": [
            {
                "type": "Ready",
                "status": value,
                "reason": verdict.reason,
                "message": verdict.message,
                "observedGeneration": generation,
                "lastTransitionTime": transition,
            }
        ],
    }


def is_ready(policy: Mapping[str, Any]) -> bool:
    """True if the stored policy's Ready condition is True for its current generation."""
    state = policy.get("status") or {}
    generation = (policy.get("metadata") or {}).get("generation")
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" and c.get("observedGeneration") == generation
        for c in state.get("conditions") or []
    )


def not_ready_reason(policy: Mapping[str, Any]) -> str:
    """The Ready condition's message, or a note that the operator has not judged this generation yet."""
    for condition in (policy.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            return condition.get("message") or condition.get("reason") or "not Ready"
    return "the operator has not validated its current generation yet"
