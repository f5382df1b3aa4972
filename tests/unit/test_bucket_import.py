"""The S3 client is loaded only where a bucket is used."""

from __future__ import annotations

import subprocess
import sys


def test_a_sidecar_without_a_bucket_never_imports_obstore() -> None:
    probe = ("import sys, stowaway.cli, stowaway.sidecar.server, stowaway.storage.bucket, stowaway.sidecar.bucket_tier;"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'obstore'))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
