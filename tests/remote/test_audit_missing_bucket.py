"""A remote URL naming a bucket that does not exist is an error naming the
bucket (audit: the listing of a missing bucket is empty, so ``ucm-db gc
s3://typo/kv`` reported "0 objects ... removed 0" and exited 0, run after
run, while the real bucket filled up; ``ucm-db warm`` said "0 namespaces
match", pointing at --namespace). An existing bucket with nothing under the
prefix is still an empty remote (exit 0). Real S3 API: moto's server on
127.0.0.1 (tests/remote/conftest.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from ucm_db.tools.cli import cli

from .conftest import BUCKET

pytestmark = [pytest.mark.timeout(120), pytest.mark.s3]


def s3_flags(endpoint: str) -> list[str]:
    return ["--option", f"endpoint_url={endpoint}", "--option", "key=testing", "--option", "secret=testing"]


def test_gc_of_a_missing_bucket_exits_2_naming_it(s3_endpoint: str) -> None:
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    result = CliRunner().invoke(cli, ["gc", f"s3://{missing}/kv", "--older-than", "7d", "--json", *s3_flags(s3_endpoint)])
    assert result.exit_code == 2, result.output  # before: 0, "0 objects"
    error = json.loads(result.stdout)["error"]
    assert missing in error["message"] and "does not exist" in error["message"] and "bucket" in error["hint"]


def test_gc_of_an_empty_prefix_of_a_real_bucket_is_an_empty_remote(s3_endpoint: str) -> None:
    result = CliRunner().invoke(cli, ["gc", f"s3://{BUCKET}/empty-{uuid.uuid4().hex[:8]}", "--older-than", "7d", "--json",
                                      *s3_flags(s3_endpoint)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["objects_before"] == 0


def test_warm_from_a_missing_bucket_exits_2_naming_it(s3_endpoint: str, tmp_path: Path) -> None:
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    (tmp_path / "prompts.jsonl").write_text("[1, 2, 3, 4, 5, 6, 7, 8]\n")
    result = CliRunner().invoke(cli, ["warm", str(tmp_path / "store"), "--remote", f"s3://{missing}/kv", "--namespace", "m",
                                      "--tokens", str(tmp_path / "prompts.jsonl"), "--json", *s3_flags(s3_endpoint)])
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert missing in error["message"] and "does not exist" in error["message"]  # before: "0 namespaces ... match 'm'"
