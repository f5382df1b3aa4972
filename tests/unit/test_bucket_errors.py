"""What a user is told when a bucket refuses: the reason label and the thing to check, from the server's answer."""

from __future__ import annotations

import pytest

from stowaway.storage import bucket


@pytest.mark.parametrize(("answer", "kind", "advice"), [
    # Ceph RGW and MinIO name a full bucket; SeaweedFS answers AccessDenied (see test_bucket_faults).
    ("Server returned non-2xx status code: 403 Forbidden: <Code>QuotaExceeded</Code>", "bucket_full", "quota"),
    ("<Code>XMinioStorageFull</Code><Message>Storage backend has reached its minimum free drive threshold",
     "bucket_full", "free space"),
    ("Server returned non-2xx status code: 403 Forbidden: <Code>AccessDenied</Code>", "bucket_denied",
     "not over a quota"),
    ("<Code>NoSuchBucket</Code>", "bucket_missing", "create the bucket"),
    ("error sending request for url (http://127.0.0.1:1/)", "bucket_unreachable", "endpoint"),
])
def test_a_refusal_is_named_by_what_to_do_about_it(answer: str, kind: str, advice: str) -> None:
    error = bucket.classify(RuntimeError(answer), "uploading step 3")
    assert error.kind == kind
    assert advice in str(error) and "uploading step 3 failed" in str(error)
