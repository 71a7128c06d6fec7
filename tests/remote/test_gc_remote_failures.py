"""``ucm-db gc`` on a remote it cannot reach or may not read (audit finding:
a traceback ending in botocore's NoCredentialsError / EndpointConnectionError).

A remote that fails is reported as ``warm`` reports it: a ``TierError``
naming the remote and the failure (exit 1, one line on stderr, the error
document under ``--json``), the botocore error kept as its cause. Real S3
clients: s3fs against a moto server on 127.0.0.1 without credentials, and
against a local port nothing listens on.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ucm_db import maintenance
from ucm_db.errors import TierError
from ucm_db.tools.cli import cli

from .conftest import BUCKET

pytestmark = pytest.mark.timeout(120)


def closed_port() -> int:
    """A local port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_gc(*args: str) -> Result:
    return CliRunner().invoke(cli, ["gc", *args], catch_exceptions=False)


def assert_remote_error(result: Result, url: str, failure: str) -> None:
    """Exit 1 (as ``warm`` on the same remote), one error line naming the
    remote and the failure, the JSON error document; no traceback."""
    assert result.exit_code == 1, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"ucm-db: error: remote {url} failed: {failure}"), result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "TierError" and error["exit_code"] == 1 and "endpoint" in error["hint"]


def without_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere botocore looks (environment, files, instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.s3
def test_gc_on_s3_without_credentials_is_a_remote_error(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    without_aws_credentials(monkeypatch, tmp_path)
    url = f"s3://{BUCKET}/gc-no-credentials"
    result = run_gc(url, "--older-than", "1d", "--option", f"endpoint_url={s3_endpoint}", "--json")
    assert_remote_error(result, url, "NoCredentialsError")


def test_gc_on_an_unreachable_s3_endpoint_is_a_remote_error() -> None:
    url = "s3://kv-cache/gc-unreachable"
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = run_gc(url, "--max-bytes", "1GiB", "--option", f"endpoint_url={endpoint}",
                    "--option", "key=testing", "--option", "secret=testing", "--json")
    assert_remote_error(result, url, "EndpointConnectionError")

    # The Python API raises the same TierError, the botocore error its cause.
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(TierError, match="EndpointConnectionError") as caught:
        maintenance.gc_remote(url, options, older_than_s=86400.0, dry_run=True)
    assert type(caught.value.__cause__).__name__ == "EndpointConnectionError"
