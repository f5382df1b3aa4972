"""The operator's few reads and writes against the API server, outside kopf's own machinery.

Synchronous ``kubernetes`` client calls; :mod:`main` runs them in a thread.
"""

from __future__ import annotations

import base64
import datetime
import logging
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from stowaway.operator import certificates, injection, policy
from stowaway.operator.settings import ManagedTLS

log = logging.getLogger(__name__)
# Secret keys, as in a kubernetes.io/tls Secret plus the CA (cert-manager's layout), so every mode mounts alike.
CA_KEY, CERT_KEY, PRIVATE_KEY = "ca.crt", "tls.crt", "tls.key"


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
        # The client types a custom object as `object`; it is the object's JSON.
        return cast(dict[str, Any], client.CustomObjectsApi(api).get_namespaced_custom_object(
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name
        ))
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
    return sum(1 for p in pods if _annotations(p).get(injection.MARKER_ANNOTATION) == name)


def _annotations(pod: client.V1Pod) -> dict[str, str]:
    assert pod.metadata is not None  # the client types it optional; the API server always sends it
    return pod.metadata.annotations or {}


def set_pods_injected(api: client.ApiClient, namespace: str, name: str, count: int) -> None:
    """Store the count in the policy's status; a policy deleted meanwhile has no status to keep."""
    try:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name, {"status": {"podsInjected": count}}
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


class WebhookTLSError(RuntimeError):
    """The operator cannot keep its webhook certificate; the message says which object to fix."""


def ensure_webhook_certificate(
    api: client.ApiClient, namespace: str, tls: ManagedTLS
) -> certificates.ServingCertificate:
    """Return the certificate to serve with, made and stored in the Secret if the stored one cannot be kept.

    The Secret must exist (the manifests create it empty): creating Secrets
    cannot be limited by name in RBAC, so the operator may only read and
    update this one. The update carries the read's resourceVersion, so of two
    operators starting at once one wins and the other serves what it stored.
    """
    core = client.CoreV1Api(api)
    hosts = certificates.service_hosts(tls.service, namespace)
    what = f"Secret {tls.secret!r} in namespace {namespace!r}"
    try:
        secret = core.read_namespaced_secret(tls.secret, namespace)
    except ApiException as exc:
        raise WebhookTLSError(_tls_failure("read", what, exc)) from None
    data = secret.data or {}
    found = certificates.ServingCertificate(
        *(base64.b64decode(data.get(key) or "") for key in (CA_KEY, CERT_KEY, PRIVATE_KEY))
    )
    reason = certificates.reason_to_replace(found, hosts, datetime.datetime.now(datetime.UTC))
    if reason is None:
        log.info("Serving the webhook with the certificate kept in Secret %s/%s", namespace, tls.secret)
        return found
    made = certificates.self_signed(hosts, days=certificates.VALIDITY_DAYS)
    secret.data = {
        **data,
        **{key: base64.b64encode(pem).decode() for key, pem in
           ((CA_KEY, made.ca_pem), (CERT_KEY, made.cert_pem), (PRIVATE_KEY, made.key_pem))},
    }
    try:
        core.replace_namespaced_secret(tls.secret, namespace, secret)
    except ApiException as exc:
        if exc.status == 409:  # another operator stored its certificate first: serve that one
            return ensure_webhook_certificate(api, namespace, tls)
        raise WebhookTLSError(_tls_failure("update", what, exc)) from None
    log.info("Stored a new webhook certificate for %s in Secret %s/%s (the old one: %s)",
             ", ".join(hosts), namespace, tls.secret, reason)
    return made


def set_ca_bundle(api: client.ApiClient, configuration: str, ca_pem: bytes) -> None:
    """Make every webhook of the MutatingWebhookConfiguration trust ``ca_pem``; writes nothing if they already do.

    A JSON patch that first tests the resourceVersion, so a concurrent change
    of the webhook list fails the patch instead of landing on the wrong index.
    """
    admission = client.AdmissionregistrationV1Api(api)
    bundle = base64.b64encode(ca_pem).decode()
    what = f"MutatingWebhookConfiguration {configuration!r}"
    try:
        found = admission.read_mutating_webhook_configuration(configuration)
        ops = [
            {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": bundle}
            for index, webhook in enumerate(found.webhooks or []) if webhook.client_config.ca_bundle != bundle
        ]
        if ops:
            assert found.metadata is not None  # the client types it optional; the API server always sends it
            test = {"op": "test", "path": "/metadata/resourceVersion", "value": found.metadata.resource_version}
            admission.patch_mutating_webhook_configuration(configuration, [test, *ops])
    except ApiException as exc:
        raise WebhookTLSError(_tls_failure("patch", what, exc)) from None


def _tls_failure(verb: str, what: str, exc: ApiException) -> str:
    if exc.status == 404:
        cause = "it does not exist; the manifests create it (kubectl apply -f deploy/, or the chart with " \
            "webhook.tls.mode=operator)"
    elif exc.status == 403:
        cause = "the operator's ServiceAccount may not; the chart's RBAC grants exactly this (charts/stowaway)"
    else:
        cause = f"the API server answered {exc.status} {exc.reason}"
    return f"cannot {verb} {what} for the webhook's TLS certificate: {cause} (see docs/operator.md)"
