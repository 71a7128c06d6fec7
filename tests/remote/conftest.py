"""Fixtures of the remote-tier tests: a real S3 endpoint (moto's
ThreadedMotoServer on 127.0.0.1), a shared directory and ``memory://``.

``remote`` is parametrized over the three: each test gets a fresh root and
the ``remote_options`` that reach it. Importing this conftest registers the
tests' fault-injecting ``ucmfault://`` protocol (:mod:`faultfs`).
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import faultfs
from ucm_db.keys import Namespace

from .node_proc import chain  # noqa: F401 - re-exported for the tests

BUCKET = "ucm-db-test"
faultfs.register()


@dataclass(frozen=True)
class Remote:
    """A remote root for one test: URL plus fsspec options."""

    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def store_options(self, **extra: Any) -> dict[str, Any]:
        return {"remote": self.url, "remote_options": dict(self.options), **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 API server on 127.0.0.1 (moto), with one bucket."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options(endpoint), skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield endpoint
    server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the moto endpoint (dummy credentials, not anonymous)."""
    return {
        "endpoint_url": endpoint, "key": "testing", "secret": "testing", "anon": False,
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
    }


@pytest.fixture(params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    return make_remote(request.param, tmp_path, request)


def make_remote(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Remote:
    unique = uuid.uuid4().hex[:12]
    if kind == "memory":
        return Remote(kind, f"memory://ucm-{unique}")
    if kind == "file":
        return Remote(kind, f"file://{tmp_path}/shared-{unique}")
    endpoint = request.getfixturevalue("s3_endpoint")
    return Remote(kind, f"s3://{BUCKET}/{unique}", s3_options(endpoint))


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="test/remote", kv_dtype="bfloat16", block_size=4, layout="test")
