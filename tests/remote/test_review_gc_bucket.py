"""Review of c19c877 (remote gc and bucket checks): reproductions, fixed.

* gc stops (TierError) on any failed head read, so one object that can
  never be read stops every run: an S3 lifecycle rule moving old objects to
  GLACIER (GetObject: InvalidObjectState) makes gc useless exactly where it
  should collect. Before c19c877 that object was skipped as foreign and the
  rest collected. Now it is kept (present, parent unknown), reported, and
  the rest collected. Real moto S3, no mock.
* ``require_bucket`` takes any failed bucket probe for "does not exist":
  credentials scoped to a prefix (ListBucket only with ``Prefix=kv/``, no
  GetBucketLocation, a common shared-bucket policy) make gc and warm of an
  empty prefix a ConfigError "bucket ... does not exist" (exit 2). Moto
  enforces no IAM, so the two bucket-level calls are refused on the client
  (a botocore ``before-call`` hook), as AWS refuses them for such a policy.
  Now a bucket is missing only when listing it says so (NoSuchBucket).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace
from ucm_db.remote.tier import RemoteRoot
from ucm_db.remote.warming import remote_namespaces

from .conftest import BUCKET, s3_options

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]
NS = Namespace(model="test/review-gc-bucket", kv_dtype="bfloat16", block_size=4, layout="test")


def test_a_glacier_object_does_not_stop_gc(tmp_path: Path, s3_endpoint: str) -> None:
    options = s3_options(s3_endpoint)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    live, old = NS.block_keys(list(range(16))), NS.block_keys(list(range(500, 508)))
    with ucm_db.open(tmp_path / "w", capacity_bytes=64 << 20, remote=url, remote_options=options, remote_mode="write_through") as store:
        store.put(NS, live, [bytes([i]) * 400 for i in range(len(live))])
        store.put(NS, old, [b"o" * 400, b"p" * 400])
    bucket, key = RemoteRoot.from_url(url, options).tier(NS.id).path(old[1]).split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
    report = maintenance.gc_remote(url, options, max_bytes=0)  # before: TierError (InvalidObjectState), run after run
    assert report["removed_objects"] == len(live) + 1  # the rest, its parent too: the size rule took its whole chain
    assert report["unreadable"] == 1 and key in report["unreadable_examples"][0] and report["unreadable_hint"]
    assert s3.head_object(Bucket=bucket, Key=key)["StorageClass"] == "GLACIER"  # kept: gc cannot know what it is


def test_the_size_rule_steps_over_the_oldest_object_archived(tmp_path: Path, s3_endpoint: str) -> None:
    """Review 3: a lifecycle rule archives the *oldest* objects, which the
    size rule reaches first; it counted their bytes as freed, so a trim of
    one object removed nothing. Now it takes the next oldest tail, and a
    target only archived objects stand over is reported as unmet."""
    options = s3_options(s3_endpoint)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    archived, live = NS.block_keys(list(range(700, 704))), NS.block_keys(list(range(16)))
    with ucm_db.open(tmp_path / "w", capacity_bytes=64 << 20, remote=url, remote_options=options, remote_mode="write_through") as store:
        store.put(NS, archived, [b"a" * 400])
        bucket, key = RemoteRoot.from_url(url, options).tier(NS.id).path(archived[0]).split("/", 1)
        s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
        s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key}, StorageClass="GLACIER")
        time.sleep(1.1)  # S3 times are whole seconds: the archived object is the oldest
        store.put(NS, live, [bytes([i]) * 400 for i in range(len(live))])
    total = maintenance.gc_remote(url, options, max_bytes=1 << 40, dry_run=True)["bytes_before"]
    report = maintenance.gc_remote(url, options, max_bytes=total - 1)  # one object too many
    assert report["removed_objects"] == 1 and report["unreadable"] == 1, report  # before: 0 removed
    assert report["max_bytes_shortfall_bytes"] == 0 and report["max_bytes_shortfall_reason"] is None
    report = maintenance.gc_remote(url, options, max_bytes=0)
    assert report["removed_objects"] == len(live) - 1 and report["bytes_after"] == report["max_bytes_shortfall_bytes"] > 0
    assert "1 unreadable objects" in report["max_bytes_shortfall_reason"], report
    assert s3.head_object(Bucket=bucket, Key=key)["StorageClass"] == "GLACIER"


def _deny(model: Any, **_: Any) -> None:
    raise botocore.exceptions.ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, model.name)


@pytest.mark.parametrize("door", ["gc", "warm"])
def test_prefix_scoped_credentials_on_an_empty_prefix_are_not_a_missing_bucket(s3_endpoint: str, door: str) -> None:
    options = s3_options(s3_endpoint)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    fs = RemoteRoot.from_url(url, options).fs  # the cached instance gc and warm open again
    fs.connect()
    fs.s3.meta.events.register("before-call.s3.HeadBucket", _deny)
    fs.s3.meta.events.register("before-call.s3.GetBucketLocation", _deny)
    try:
        if door == "gc":
            assert maintenance.gc_remote(url, options, max_bytes=0)["objects_before"] == 0
        else:
            assert remote_namespaces(url, options).namespaces == {}  # before: ConfigError "bucket ... does not exist"
    finally:
        fs.s3.meta.events.unregister("before-call.s3.HeadBucket", _deny)
        fs.s3.meta.events.unregister("before-call.s3.GetBucketLocation", _deny)


@pytest.mark.parametrize("door", ["gc", "warm"])
def test_a_listing_scoped_to_the_prefix_is_not_a_missing_bucket(s3_endpoint: str, door: str) -> None:
    """The stricter policy: ListBucket only under the prefix too, so listing
    the bucket's top level is refused (AccessDenied): no answer, not
    "missing" (only NoSuchBucket is)."""
    options = s3_options(s3_endpoint)
    prefix = uuid.uuid4().hex[:12]
    url = f"s3://{BUCKET}/{prefix}"

    def deny_outside(model: Any, params: dict[str, Any], **_: Any) -> None:
        if not str(params.get("query_string", {}).get("prefix", "")).startswith(prefix):  # the request as serialised
            _deny(model)

    fs = RemoteRoot.from_url(url, options).fs
    fs.connect()
    hooks = [("before-call.s3.HeadBucket", _deny), ("before-call.s3.GetBucketLocation", _deny),
             ("before-call.s3.ListObjectsV2", deny_outside)]
    for event, hook in hooks:
        fs.s3.meta.events.register(event, hook)
    try:
        if door == "gc":
            assert maintenance.gc_remote(url, options, max_bytes=0)["objects_before"] == 0
        else:
            assert remote_namespaces(url, options).namespaces == {}
    finally:
        for event, hook in hooks:
            fs.s3.meta.events.unregister(event, hook)


def test_a_missing_bucket_is_named_with_its_scheme(s3_endpoint: str) -> None:
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigError, match=f"remote s3://{missing}/kv: bucket '{missing}' does not exist"):
        maintenance.gc_remote(f"s3://{missing}/kv", s3_options(s3_endpoint), max_bytes=0)  # before: "remote no-such-.../kv"
