"""The API client fixture, shared by the ``k8s`` tests and the ``e2e`` tests.

Each of the two conftests imports it, so it follows the ``k8s_cluster`` of
its own folder: the control plane the suite starts, or the kind cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from k8s.cluster import Cluster


@pytest.fixture(scope="session")
def k8s_api(k8s_cluster: Cluster) -> Iterator[client.ApiClient]:
    """A ready ``kubernetes.client.ApiClient`` for the cluster under test."""
    api = k8s_cluster.api_client()
    try:
        yield api
    finally:
        api.close()
