"""Review 3 of 25011b0: ``missing_bucket`` lists the bucket's whole top
level to learn that it exists.

``fs.ls(bucket)`` pages through every top-level key and prefix, one request
per 1000 (the test asks that the one request asks for one key) (measured on moto: 2000 entries 2 requests, 12000 entries 12
requests, 3.3 s), and holds them all in memory; it runs whenever gc or warm
find an empty root, e.g. the first run on a new prefix of a big shared
bucket (a million top-level entries: 1000 requests). One request of at most
one key answers the question. Real moto S3; a botocore ``before-call`` hook
on the s3fs client counts the requests it makes (a spy, no fault: s3fs's
sync ``call_s3`` calls the class's ``_call_s3``, which an instance attribute
does not replace, so the hook is what sees every request).
"""

from __future__ import annotations

import uuid
from typing import Any

import boto3
import pytest

from ucm_db.remote.gc_listing import missing_bucket
from ucm_db.remote.tier import RemoteRoot

from .conftest import s3_options

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]


def test_bucket_probe_is_one_request(s3_endpoint: str) -> None:
    bucket = f"big-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for i in range(3):  # other tenants' data in a shared bucket: the probe asks for one key, however many there are
        client.put_object(Bucket=bucket, Key=f"other-{i:05d}", Body=b"x")
    root = RemoteRoot.from_url(f"s3://{bucket}/ucm-new-prefix", {**s3_options(s3_endpoint), "skip_instance_cache": True})
    calls: list[tuple[str, Any]] = []

    def count(model: Any, params: Any = None, **_: Any) -> None:
        query = (params or {}).get("query_string") or {}
        calls.append((model.name, query.get("max-keys") if isinstance(query, dict) else query))

    root.fs.connect()
    root.fs.s3.meta.events.register("before-call.s3", count)
    try:
        assert missing_bucket(root) is None
        assert calls == [("ListObjectsV2", 1)], f"{len(calls)} requests to tell that bucket {bucket} exists: {calls}"
        calls.clear()
        assert missing_bucket(RemoteRoot.from_url(f"s3://{bucket}", {**s3_options(s3_endpoint)})) is None  # the bucket as root
    finally:
        root.fs.s3.meta.events.unregister("before-call.s3", count)


def test_a_missing_and_an_empty_bucket_are_told_apart(s3_endpoint: str) -> None:
    """The one request still tells a missing bucket (NoSuchBucket) from an
    existing empty one, with a prefix or without."""
    bucket = f"empty-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    for url in (f"s3://{bucket}", f"s3://{bucket}/kv/prod"):
        assert missing_bucket(RemoteRoot.from_url(url, s3_options(s3_endpoint))) is None
    gone = f"gone-{uuid.uuid4().hex[:8]}"
    for url in (f"s3://{gone}", f"s3://{gone}/kv/prod"):
        assert missing_bucket(RemoteRoot.from_url(url, s3_options(s3_endpoint))) == gone
