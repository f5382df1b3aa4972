"""A real Prometheus on the host that finds the sidecars the way the chart's PodMonitor does.

It discovers pods through the cluster's API server (``kubernetes_sd_configs``), keeps the sidecar's metrics
port, labels the series as the Prometheus Operator labels a PodMonitor's (``namespace``, ``pod``,
``container``) plus the relabelings the chart's PodMonitor declares, read from the rendered chart. Pod IPs
live inside the kind node, so each target is scraped through the API server's pod proxy.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import yaml
from k8s.cluster import Cluster
from k8s.operator_fixtures import CHART
from metrics.promtools import PrometheusServer

from stowaway.operator.injection import METRICS_PORT_NAME

# The Prometheus Operator's field names and Prometheus's, for the relabeling fields the chart uses.
_RELABEL_FIELDS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
                   "replacement": "replacement", "action": "action", "separator": "separator"}


def podmonitor_relabelings(cluster: Cluster) -> list[dict[str, Any]]:
    """The relabelings of the chart's PodMonitor, in Prometheus's own schema."""
    rendered = cluster.run("helm", "template", "stowaway", str(CHART), "--kube-version", "1.36.0",
                           "--api-versions", "monitoring.coreos.com/v1/PodMonitor").stdout
    monitors = [doc for doc in yaml.safe_load_all(rendered) if doc and doc.get("kind") == "PodMonitor"]
    assert len(monitors) == 1, f"the chart renders {len(monitors)} PodMonitors"
    (endpoint,) = monitors[0]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == METRICS_PORT_NAME and endpoint["path"] == "/metrics", endpoint
    return [{_RELABEL_FIELDS[key]: value for key, value in rule.items()} for rule in endpoint.get("relabelings", [])]


def _credentials(cluster: Cluster, directory: Path) -> tuple[str, dict[str, str]]:
    """The API server's address and a tls_config with the kubeconfig's certificates written to files."""
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
    server = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
    tls = {}
    for field, data in (("ca_file", server.get("certificate-authority-data")),
                        ("cert_file", user.get("client-certificate-data")),
                        ("key_file", user.get("client-key-data"))):
        assert data, f"the kubeconfig has no embedded {field}: Prometheus needs certificates to reach the API"
        path = directory / field
        path.write_bytes(base64.b64decode(data))
        tls[field] = str(path)
    address = re.fullmatch(r"https://([^/]+)/?", server["server"])
    assert address, f"unexpected API server address {server['server']}"
    return address.group(1), tls


def prometheus_of_sidecars(executable: Path, cluster: Cluster, namespace: str, directory: Path) -> PrometheusServer:
    """Prometheus (``executable``, built with Kubernetes discovery) scraping every injected sidecar of
    ``namespace`` every second."""
    api_address, tls = _credentials(cluster, directory)
    return PrometheusServer(executable=str(executable), scrape_configs=[{
        "job_name": "stowaway-sidecars",
        "scheme": "https",
        "tls_config": tls,
        "kubernetes_sd_configs": [{
            "role": "pod", "kubeconfig_file": str(cluster.kubeconfig), "namespaces": {"names": [namespace]},
            "selectors": [{"role": "pod", "label": "stowaway.dev/inject=enabled"}],
        }],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": METRICS_PORT_NAME,
             "action": "keep"},
            # What the Prometheus Operator adds to every PodMonitor target.
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            *podmonitor_relabelings(cluster),
            {"source_labels": ["__meta_kubernetes_namespace", "__meta_kubernetes_pod_name",
                               "__meta_kubernetes_pod_container_port_number"],
             "regex": "(.+);(.+);(.+)", "target_label": "__metrics_path__",
             "replacement": "/api/v1/namespaces/${1}/pods/${2}:${3}/proxy/metrics"},
            {"target_label": "__address__", "replacement": api_address},
        ],
    }])
