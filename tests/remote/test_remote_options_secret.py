"""``remote_options`` may hold credentials (an S3 secret): README and
docs/configuration.md promise they are never persisted and shown redacted.

A real S3 endpoint (moto on 127.0.0.1) is opened with a secret no other
byte of the test holds; after blocks are uploaded, the secret is in no file
of the store directory, no object of the bucket, neither the store's stats
nor ``ucm-db inspect --json``, and no ``repr`` of the store's or the
connector's settings (what a traceback or a debug log would print).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db.tools.cli import cli

from .conftest import BUCKET, chain, s3_options

pytestmark = pytest.mark.s3


def test_an_s3_secret_is_never_written_and_always_shown_redacted(s3_endpoint: str, tmp_path: Path, namespace) -> None:
    secret = f"S3CR3T-{uuid.uuid4().hex}"
    options = {**s3_options(s3_endpoint), "secret": secret}
    url = f"s3://{BUCKET}/secret-{uuid.uuid4().hex[:8]}"
    keys, payloads = chain(namespace, 8)
    with ucm_db.open(tmp_path / "s", remote=url, remote_options=options, codec="none") as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        settings = store.stats().settings
        config_repr = repr(store.config)
    assert settings["remote_options"]["secret"] == "***"
    assert secret not in json.dumps(settings, default=str)
    assert secret not in config_repr and "'secret': '***'" in config_repr

    encoded = secret.encode()
    files = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
    assert files and not [p for p in files if encoded in p.read_bytes()]
    fs = fsspec.filesystem("s3", **s3_options(s3_endpoint), skip_instance_cache=True)
    objects = fs.find(url.removeprefix("s3://"))
    assert len(objects) >= len(keys)  # the blocks went up, with the manifest beside them
    assert not [name for name in objects if encoded in fs.cat_file(name)]

    inspected = CliRunner().invoke(cli, ["inspect", str(tmp_path / "s"), "--json"], catch_exceptions=False)
    assert inspected.exit_code == 0 and secret not in inspected.stdout

    from ucm_db.connector.settings import ConnectorSettings

    connector = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "remote": url, "remote_options": options})
    assert secret not in repr(connector) and "'secret': '***'" in repr(connector)
