"""kopf handlers: thin wrappers that fetch what the pure builders need and apply their result.

Run with ``python -m stowaway.operator`` (see :mod:`stowaway.operator.__main__`).
"""

from __future__ import annotations

import asyncio
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client

from stowaway.operator import certificates, cluster, injection, policy
from stowaway.operator.settings import OperatorSettings

NEVER_INJECTED = frozenset({"kube-system"})


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorSettings = memo.config
    settings.peering.standalone = True
    settings.posting.enabled = False
    memo.api = cluster.connect()
    settings.admission.server = await _webhook_server(config, memo.api)
    if config.dev_host:
        settings.admission.managed = "stowaway-dev.stowaway.dev"
    # Set on the memo kopf copies (shallowly) to every object's handlers, so pod events share the locks.
    memo.count_locks = {}


async def _webhook_server(config: OperatorSettings, api: client.ApiClient) -> kopf.WebhookServer:
    if config.cert_dir is not None:
        return kopf.WebhookServer(
            addr="0.0.0.0", port=config.webhook_port,
            certfile=str(config.cert_dir / "tls.crt"), pkeyfile=str(config.cert_dir / "tls.key"),
            host=config.dev_host,
        )
    if config.managed_tls is not None:
        # Both before the server answers, so the API server's first call already trusts what it is shown.
        made = await asyncio.to_thread(cluster.ensure_webhook_certificate, api, config.namespace, config.managed_tls)
        await asyncio.to_thread(cluster.set_ca_bundle, api, config.managed_tls.configuration, made.ca_pem)
        folder = _write_certificate(made)
        return kopf.WebhookServer(
            addr="0.0.0.0", port=config.webhook_port,
            certfile=str(folder / "tls.crt"), pkeyfile=str(folder / "tls.key"),
        )
    # Development only: a throw-away certificate for the host kopf registers itself under.
    assert config.dev_host is not None
    folder = _write_certificate(certificates.self_signed([config.dev_host]))
    return kopf.WebhookServer(
        addr="0.0.0.0", port=config.webhook_port, host=config.dev_host,
        certfile=str(folder / "tls.crt"), pkeyfile=str(folder / "tls.key"), cafile=str(folder / "ca.crt"),
    )


def _write_certificate(made: certificates.ServingCertificate) -> Path:
    """kopf's server reads files: a private folder under /tmp (the Deployment's only writable path)."""
    folder = Path(tempfile.mkdtemp(prefix="stowaway-webhook-"))
    for name, pem in (("ca.crt", made.ca_pem), ("tls.crt", made.cert_pem), ("tls.key", made.key_pem)):
        (folder / name).write_bytes(pem)
    return folder


@kopf.on.mutate(
    "v1", "pods", id="inject", operations=["CREATE"],
    labels={injection.INJECT_LABEL: injection.INJECT_ENABLED}, side_effects=False, ignore_failures=False,
)
async def inject(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    started = time.monotonic()
    result = "error"
    try:
        result = await _inject(body, patch, memo)
    except kopf.AdmissionError:
        result = "denied"
        raise
    finally:
        memo.metrics.admitted(result, time.monotonic() - started)


async def _inject(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> str:
    """Fill ``patch`` and say what was done, as one of :data:`metrics.RESULTS`."""
    namespace = _namespace(body)
    if namespace in NEVER_INJECTED or namespace == memo.config.namespace:
        return "skipped"
    pod = dict(body)
    try:
        injection.refuse_forgeries(pod)
    except injection.InjectionError as exc:
        raise kopf.AdmissionError(f"cannot inject the Stowaway sidecar: {exc}", code=400) from None
    injected_with = injection.injected_with(pod)
    if injected_with is not None:
        # The marker comes with the sidecar (refuse_forgeries): a reinvocation, or a copy of an injected pod, which
        # is checked against the policy that injected it (that need not be Ready now; a deleted one protects nothing).
        found = await asyncio.to_thread(cluster.read_policy, memo.api, namespace, injected_with)
        if found is not None:
            _build(pod, injected_with, found, memo)
        return "already_injected"
    name = injection.policy_name(pod)
    found = await asyncio.to_thread(cluster.read_policy, memo.api, namespace, name)
    if found is None:
        raise kopf.AdmissionError(
            f"CheckpointPolicy {name!r} not found in namespace {namespace!r}: create it, or name an existing one "
            f"with the annotation {injection.POLICY_ANNOTATION} (see docs/operator.md)",
            code=400,
        )
    if not policy.is_ready(found):
        raise kopf.AdmissionError(
            f"CheckpointPolicy {name!r} in namespace {namespace!r} is not Ready: {policy.not_ready_reason(found)}",
            code=400,
        )
    patch.update(_build(pod, name, found, memo))
    return "injected"


def _build(pod: dict[str, Any], name: str, found: dict[str, Any], memo: kopf.Memo) -> dict[str, Any]:
    try:
        return injection.build_patch(pod, name, found["spec"], memo.config.sidecar_image)
    except injection.InjectionError as exc:
        raise kopf.AdmissionError(f"cannot inject the Stowaway sidecar: {exc}", code=400) from None


@kopf.on.event(policy.GROUP, policy.VERSION, policy.PLURAL)
async def policy_changed(event: kopf.RawEvent, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                         **_: Any) -> None:
    if event.get("type") not in (None, "ADDED", "MODIFIED"):
        return
    try:
        await _refresh_status(body, patch, memo)
    except Exception:
        memo.metrics.reconcile_errors.inc()
        raise


@kopf.on.event(
    "v1", "pods", labels={injection.INJECT_LABEL: injection.INJECT_ENABLED},
    annotations={injection.MARKER_ANNOTATION: kopf.PRESENT},
)
async def injected_pod_came_or_went(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Keep the policy's ``podsInjected`` true as its pods are created and deleted.

    Only ADDED and DELETED change the count (the startup listing, type None, is
    already counted by each policy's own first event). Counting and writing
    happen under one lock per policy, so the last write carries the newest count.
    """
    if event.get("type") not in ("ADDED", "DELETED"):
        return
    namespace, name = _namespace(body), body.metadata.annotations[injection.MARKER_ANNOTATION]
    lock = memo.count_locks.setdefault((namespace, name), asyncio.Lock())
    try:
        async with lock:
            count = await asyncio.to_thread(cluster.count_injected, memo.api, namespace, name)
            await asyncio.to_thread(cluster.set_pods_injected, memo.api, namespace, name, count)
    except Exception:
        memo.metrics.reconcile_errors.inc()
        raise


async def _refresh_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> None:
    """Write the policy's status if it changed (an unchanged status writes nothing, so no event loop).

    Event handlers, not timers or daemons: those make kopf put a finalizer on every
    policy, which would block deleting a namespace while the operator is down.
    """
    namespace, name, spec = _namespace(body), body.metadata.name, body.spec
    claim = injection.claim_of(spec)
    exists = claim is None or await asyncio.to_thread(cluster.claim_exists, memo.api, namespace, claim)
    injected = await asyncio.to_thread(cluster.count_injected, memo.api, namespace, name)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    current = dict(body.status)
    wanted = policy.status(policy.judge(spec, exists), body.metadata["generation"], current, now)
    wanted["podsInjected"] = injected
    if {k: current.get(k) for k in wanted} != wanted:
        patch.status.update(wanted)


def _namespace(body: kopf.Body) -> str:
    """The namespace of a pod or a policy.

    kopf types it optional, for cluster-scoped kinds; both of these are
    namespaced, and the API server sets it before any handler sees them.
    """
    namespace = body.metadata.namespace
    assert namespace is not None, f"{body.get('kind')} {body.metadata.name} has no namespace"
    return namespace
