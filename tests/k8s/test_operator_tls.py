"""``kubectl apply -f deploy/`` alone gives a working webhook: the operator makes, keeps and announces its certificate.

The API server calls the webhook exactly as ``deploy/`` registers it: through
the Service, with the TLS server name ``<service>.<namespace>.svc``, trusting
only the caBundle the operator patched in. Two stand-ins, because the suite has
no kubelet to run the Deployment's pod: the operator runs as a local process
with the Deployment's environment and a token of ``deploy/``'s own
ServiceAccount (so its RBAC is the one under test), and the Service's endpoint
is this machine's address, in an EndpointSlice where the endpoints controller
would have put the pod's (the API server routes webhook calls to endpoints,
``--enable-aggregator-routing`` in control_plane.py).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import socket
import ssl
import struct
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from stowaway.operator import injection

from .cluster import Cluster
from .operator_fixtures import (
    REPO,
    create_bound_claim,
    create_policy,
    free_port,
    ready_condition,
    serves_tls,
    service_account_kubeconfig,
    start_operator,
    stop_operator,
    training_pod,
    webhook_answers,
)
from .wait import eventually

pytestmark = pytest.mark.k8s

MANIFEST = REPO / "deploy" / "10-stowaway.yaml"
RENDERED_NAMESPACE = "stowaway-system"
SIOCGIFADDR = 0x8915


def host_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (EndpointSlices refuse loopback addresses)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    return None


def deployment_env(deployment: dict[str, Any], namespace: str) -> dict[str, str]:
    """The operator container's environment as kubelet would give it (the downward API's namespace resolved)."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            assert variable["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, variable
            env[variable["name"]] = namespace
    return env


@dataclass
class Deployed:
    """deploy/'s objects in ``namespace`` and how to run the operator its Deployment describes."""

    namespace: str
    env: dict[str, str]
    port: int
    log: Path

    @property
    def secret(self) -> str:
        return self.env["STOWAWAY_WEBHOOK_TLS_SECRET"]

    @property
    def configuration(self) -> str:
        return self.env["STOWAWAY_WEBHOOK_CONFIGURATION"]

    @property
    def server_name(self) -> str:
        """The name the API server checks the certificate against when it calls the Service."""
        return f"{self.env['STOWAWAY_WEBHOOK_SERVICE']}.{self.namespace}.svc"


@pytest.fixture
def deployed(
    k8s_cluster: Cluster, k8s_api: client.ApiClient, checkpointpolicy_crd: str, tmp_path: Path
) -> Iterator[Deployed]:
    """deploy/10-stowaway.yaml applied (in a fresh namespace), with the Deployment's pod replaced as the module says."""
    if not k8s_cluster.managed:
        pytest.skip("the operator runs as a local process, which an external cluster's API server cannot call")
    address = host_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address for the webhook Service's endpoint")
    # A fresh namespace: test_operator_manifests deletes deploy/'s own without waiting for it to go.
    namespace = f"stowaway-{uuid.uuid4().hex[:6]}"
    objects = [d for d in yaml.safe_load_all(MANIFEST.read_text().replace(RENDERED_NAMESPACE, namespace)) if d]
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    (service,) = [d for d in objects if d["kind"] == "Service"]
    objects.remove(deployment)
    del service["spec"]["selector"]  # its endpoints are ours, below, not the endpoints controller's
    port = free_port()
    objects.append({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service['metadata']['name']}-local",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service["metadata"]["name"],
                       "endpointslice.kubernetes.io/managed-by": "stowaway-tests"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "webhook", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    })
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    try:
        k8s_cluster.run("kubectl", "apply", "-f", str(manifest))
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = service_account_kubeconfig(k8s_cluster, namespace, account, tmp_path / "operator.kubeconfig")
        env = {
            **deployment_env(deployment, namespace),
            "KUBECONFIG": str(kubeconfig),
            # This machine's free ports instead of the pod's own.
            "STOWAWAY_WEBHOOK_PORT": str(port),
            "STOWAWAY_HEALTH_PORT": str(free_port()),
            "STOWAWAY_METRICS_PORT": str(free_port()),
        }
        yield Deployed(namespace, env, port, tmp_path / "operator.log")
    finally:
        # The webhook (failurePolicy Fail) must not outlive this test.
        k8s_cluster.run("kubectl", "delete", "-f", str(manifest), "--wait=false", "--ignore-not-found")


def stored_certificate(api: client.ApiClient, deployed: Deployed, process: subprocess.Popen[bytes]) -> dict[str, str]:
    """The Secret's data once the operator filled it; fails at once with the log if the operator died."""
    if process.poll() is not None:
        raise RuntimeError(f"operator exited with status {process.returncode}:\n{deployed.log.read_text()[-4000:]}")
    data = client.CoreV1Api(api).read_namespaced_secret(deployed.secret, deployed.namespace).data or {}
    return data if {"ca.crt", "tls.crt", "tls.key"} <= data.keys() else {}


def ca_bundles(api: client.ApiClient, deployed: Deployed) -> list[str | None]:
    configuration = client.AdmissionregistrationV1Api(api).read_mutating_webhook_configuration(deployed.configuration)
    return [webhook.client_config.ca_bundle for webhook in configuration.webhooks]


def run_until_serving(api: client.ApiClient, deployed: Deployed) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """Start the operator; return it and the Secret's data once the API server calls it through the Service."""
    process = start_operator(deployed.env, deployed.log)
    data = eventually(lambda: stored_certificate(api, deployed, process), what="the operator to fill its Secret")
    eventually(lambda: ca_bundles(api, deployed) == [data["ca.crt"]],
               what="the operator to set the webhook's caBundle to its CA")
    presented = eventually(
        lambda: serves_tls(deployed.port, base64.b64decode(data["ca.crt"]), deployed.server_name, process,
                           deployed.log),
        what="the operator to serve TLS for the Service's name",
    )
    assert presented == ssl.PEM_cert_to_DER_cert(base64.b64decode(data["tls.crt"]).decode()), \
        "the operator serves another certificate than the one it stored"
    eventually(lambda: webhook_answers(api), what="the API server to call the webhook through the Service")
    return process, data


def assert_injected_by(api: client.ApiClient, namespace: str, deployed: Deployed) -> None:
    """A labelled pod is stored with the sidecar this operator injects (its image is deploy/'s sidecar image).

    The API server calls the webhook configurations in name order, and deploy/'s
    sorts before the one of the suite's other operator, if that one runs.
    """
    stored = client.CoreV1Api(api).create_namespaced_pod(namespace, training_pod())
    (sidecar,) = stored.spec.init_containers
    assert (sidecar.name, sidecar.image) == (injection.SIDECAR_NAME, deployed.env["STOWAWAY_SIDECAR_IMAGE"])
    assert stored.metadata.annotations == {injection.MARKER_ANNOTATION: "default"}


def test_kubectl_apply_of_deploy_alone_gives_a_webhook_the_api_server_trusts_and_a_restart_keeps_its_certificate(
    k8s_api: client.ApiClient, k8s_namespace: str, deployed: Deployed
) -> None:
    core = client.CoreV1Api(k8s_api)
    assert not core.read_namespaced_secret(deployed.secret, deployed.namespace).data, "deploy/ commits no key"
    assert ca_bundles(k8s_api, deployed) == [None], "deploy/ commits no caBundle"

    process, first = run_until_serving(k8s_api, deployed)
    try:
        create_bound_claim(k8s_api, k8s_namespace)
        create_policy(k8s_api, k8s_namespace)
        eventually(lambda: (ready_condition(k8s_api, k8s_namespace) or {}).get("status") == "True",
                   what="CheckpointPolicy default to be Ready")
        assert_injected_by(k8s_api, k8s_namespace, deployed)
        written = core.read_namespaced_secret(deployed.secret, deployed.namespace).metadata.resource_version
    finally:
        stop_operator(process)

    process, again = run_until_serving(k8s_api, deployed)
    try:
        assert again == first, "the restarted operator replaced a certificate it could have kept"
        kept = core.read_namespaced_secret(deployed.secret, deployed.namespace).metadata.resource_version
        assert kept == written, "the restarted operator rewrote its Secret"
        assert_injected_by(k8s_api, k8s_namespace, deployed)
    finally:
        stop_operator(process)


def test_an_operator_whose_secret_is_missing_says_which_and_that_the_manifests_create_it(
    k8s_api: client.ApiClient, deployed: Deployed
) -> None:
    client.CoreV1Api(k8s_api).delete_namespaced_secret(deployed.secret, deployed.namespace)
    process = start_operator(deployed.env, deployed.log)
    try:
        eventually(lambda: f"cannot read Secret {deployed.secret!r} in namespace {deployed.namespace!r} for the "
                           "webhook's TLS certificate: it does not exist; the manifests create it" in
                           deployed.log.read_text(),
                   what="the operator to log why it cannot serve its webhook")
        assert process.poll() is None, "the operator gave up instead of waiting for the Secret"
        assert ca_bundles(k8s_api, deployed) == [None]
    finally:
        stop_operator(process)
