"""The harness: the test cluster serves CustomResourceDefinitions and enforces their schemas.

A CRD of the tests' own, not Stowaway's (tests/k8s/test_operator_policy.py checks that one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .wait import eventually

pytestmark = pytest.mark.k8s

GROUP = "test.stowaway.dev"


@pytest.fixture
def widget_crd(k8s_api: client.ApiClient) -> Iterator[str]:
    """A namespaced CRD with a strict schema; yields its plural name."""
    suffix = uuid.uuid4().hex[:8]  # CRDs are cluster-scoped: keep runs apart
    plural = f"widgets{suffix}"
    name = f"{plural}.{GROUP}"
    ext = client.ApiextensionsV1Api(k8s_api)
    ext.create_custom_resource_definition(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": GROUP,
                "scope": "Namespaced",
                "names": {
                    "plural": plural,
                    "singular": f"widget{suffix}",
                    "kind": _kind(plural),
                },
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "properties": {
                                    "spec": {
                                        "type": "object",
                                        "required": ["replicas"],
                                        "properties": {
                                            "replicas": {"type": "integer", "minimum": 1},
                                        },
                                    }
                                },
                            }
                        },
                    }
                ],
            },
        }
    )

    def established() -> bool:
        crd = ext.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    eventually(established, what=f"CRD {name} to be Established")
    try:
        yield plural
    finally:
        ext.delete_custom_resource_definition(name)


def _kind(plural: str) -> str:
    return "Widget" + plural.removeprefix("widgets")


def _widget(plural: str, replicas: object) -> dict[str, object]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": _kind(plural),
        "metadata": {"name": "w"},
        "spec": {"replicas": replicas},
    }


def test_the_harness_api_server_accepts_a_custom_object_that_matches_the_schema(
    k8s_api: client.ApiClient, k8s_namespace: str, widget_crd: str
) -> None:
    objects = client.CustomObjectsApi(k8s_api)
    # Discovery of a brand-new CRD can lag a moment behind Established.
    created = eventually(
        lambda: objects.create_namespaced_custom_object(GROUP, "v1", k8s_namespace, widget_crd, _widget(widget_crd, 3)),
        what="the custom object to be created",
    )
    assert created["spec"]["replicas"] == 3


def test_the_harness_api_server_rejects_a_custom_object_that_violates_the_schema(
    k8s_api: client.ApiClient, k8s_namespace: str, widget_crd: str
) -> None:
    objects = client.CustomObjectsApi(k8s_api)

    def rejection() -> ApiException:
        try:
            objects.create_namespaced_custom_object(GROUP, "v1", k8s_namespace, widget_crd, _widget(widget_crd, 0))
        except ApiException as exc:
            if exc.status == 404:  # CRD not yet routable; retry
                raise
            return exc
        pytest.fail("the server accepted replicas=0 despite minimum: 1")

    exc = eventually(rejection, what="the server to answer the create")
    status = json.loads(exc.body)
    assert (exc.status, status["reason"]) == (422, "Invalid"), exc.body
    # The API server's own OpenAPI-schema validation message, verbatim.
    assert "spec.replicas in body should be greater than or equal to 1" in status["message"]
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.replicas"]
