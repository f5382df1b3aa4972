"""Prometheus's own tools for the metrics tests: promtool, a real server, and HTTP helpers.

The binaries come from ``hack/prometheus``, which ``tests/conftest.py`` runs
before the first test marked ``prometheus``; without them the tests fail and
say so, because a metrics test that silently skips proves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from data_path.processes import wait_for

SCRAPE_INTERVAL = "1s"


def binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``; fails the test with the fix when missing."""
    directory = os.environ.get("STOWAWAY_PROMETHEUS_DIR")
    found = str(Path(directory) / name) if directory else shutil.which(name)
    if not found or not os.access(found, os.X_OK):
        pytest.fail(f"{name} not found: mark the test @pytest.mark.prometheus, so that the suite runs "
                    "hack/prometheus (which installs it) before the first test, or run hack/prometheus yourself "
                    "and put the directory it prints on PATH (or set STOWAWAY_PROMETHEUS_DIR)", pytrace=False)
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Answer:
    status: int
    content_type: str
    body: str


def http_get(url: str, method: str = "GET") -> Answer:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return Answer(response.status, response.headers.get("Content-Type", ""), response.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers.get("Content-Type", ""), error.read().decode())


def samples(exposition: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample in a text exposition."""
    found = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            found[series] = float(value)
    return found


def sample_names(exposition: str) -> set[str]:
    return {series.split("{", 1)[0] for series in samples(exposition)}


class PrometheusServer:
    """A real Prometheus scraping every second, with its data in a short temp dir.

    It scrapes ``target`` (host:port), or what ``scrape_configs`` (Prometheus's own schema) describe, with
    the ``prometheus`` of :func:`binary` unless ``executable`` names another build.
    """

    def __init__(self, target: str | None = None, scrape_configs: list[dict[str, Any]] | None = None,
                 executable: str | None = None) -> None:
        if scrape_configs is None:
            assert target is not None, "give a target or scrape_configs"
            scrape_configs = [{"job_name": "stowaway", "static_configs": [{"targets": [target]}]}]
        self.root = Path(tempfile.mkdtemp(prefix="prom", dir="/tmp"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.root / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": scrape_configs,
        }))
        self.log_path = self.root / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [executable or binary("prometheus"), f"--config.file={config}",
                 f"--storage.tsdb.path={self.root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for(self._ready, "prometheus to be ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            return http_get(f"{self.url}/-/ready").status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (or scalar as one element); fails on a PromQL error."""
        answer = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        reply = json.loads(answer.body)
        assert reply["status"] == "success", f"query {expr!r} failed: {reply}"
        data = reply["data"]
        return [{"metric": {}, "value": data["result"]}] if data["resultType"] == "scalar" else data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of ``expr``, or None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr!r} returned {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def check_metrics(exposition: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` of a scraped exposition (lint: names, units, help, types)."""
    return subprocess.run([binary("promtool"), "check", "metrics"], input=exposition, capture_output=True, text=True,
                          timeout=60)
