"""What a policy's bucket tier adds to the injected sidecar: flags, credentials, a CA bundle. Pure, like
``injection``.

``spec.storage.bucket`` (docs/object-storage.md) names the bucket URL and how
to reach it. Credentials never appear in the policy or on the command line:
either the policy names a Secret, whose ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN`` where present) the
kubelet puts in the sidecar's environment, or it names none and the pod's
workload identity (a service account the cloud trusts) provides them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stowaway import sidecar_settings

CA_VOLUME = "stowaway-bucket-ca"
CA_DIR = "/etc/stowaway/bucket-ca"
CA_FILE = "ca.pem"
SECRET_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False), ("AWS_SESSION_TOKEN", True))


def bucket_of(spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    found: Mapping[str, Any] | None = spec["storage"].get("bucket")
    return found


def command_line(spec: Mapping[str, Any]) -> list[str]:
    """The sidecar's bucket flags; none without a bucket."""
    found = bucket_of(spec)
    if found is None:
        return []
    s = sidecar_settings
    retention = found.get("retention") or {}
    command = [s.BUCKET.flag, found["url"]]
    if found.get("endpoint"):
        command += [s.BUCKET_ENDPOINT.flag, found["endpoint"]]
    if found.get("region"):
        command += [s.BUCKET_REGION.flag, found["region"]]
    command += s.BUCKET_VIRTUAL_HOSTED.command_line(bool(found.get("virtualHostedStyle")))
    if found.get("caBundle"):
        command += [s.BUCKET_CA_BUNDLE.flag, f"{CA_DIR}/{CA_FILE}"]
    command += s.BUCKET_KEEP_LAST.command_line(retention.get("keepLast", s.BUCKET_KEEP_LAST.default))
    command += s.BUCKET_KEEP_EVERY.command_line(retention.get("keepEvery", s.BUCKET_KEEP_EVERY.default))
    return command


def env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The credentials, by reference to the policy's Secret; none without one (workload identity)."""
    found = bucket_of(spec)
    secret = (found or {}).get("credentialsSecret")
    if not secret:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}
            for key, optional in SECRET_KEYS]


def volumes(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ConfigMap holding the endpoint's CA certificate, when the policy names one."""
    ca = (bucket_of(spec) or {}).get("caBundle")
    if not ca:
        return []
    return [{"name": CA_VOLUME, "configMap": {"name": ca["configMapName"],
                                              "items": [{"key": ca["key"], "path": CA_FILE}]}}]


def mounts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True}] if volumes(spec) else []
