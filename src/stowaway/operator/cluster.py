"""The operator's few reads and writes against the API server, outside kopf's own machinery.

Synchronous ``kubernetes`` client calls; :mod:`main` runs them in a thread.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from stowaway.operator import injection, policy


def connect() -> client.ApiClient:
    """In a pod, the ServiceAccount; elsewhere (development, tests), the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def read_policy(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The CheckpointPolicy object, or None if it does not exist."""
    try:
        return client.CustomObjectsApi(api).get_namespaced_custom_object(
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def claim_exists(api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        client.CoreV1Api(api).read_namespaced_persistent_volume_claim(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def count_injected(api: client.ApiClient, namespace: str, name: str) -> int:
    """Pods in the namespace that currently exist and were injected with this policy."""
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{injection.INJECT_LABEL}={injection.INJECT_ENABLED}"
    ).items
    return sum(1 for p in pods if (p.metadata.annotations or {}).get(injection.MARKER_ANNOTATION) == name)


def set_pods_injected(api: client.ApiClient, namespace: str, name: str, count: int) -> None:
    """Store the count in the policy's status; a policy deleted meanwhile has no status to keep."""
    try:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name, {"status": {"podsInjected": count}}
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
