"""Namespaces made for one test and deleted after it, with everything in them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kubernetes import client


@contextmanager
def fresh_namespace(api: client.ApiClient, prefix: str) -> Iterator[str]:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"stowaway.test": "true"})))
    try:
        yield name
    finally:
        core.delete_namespace(name)
