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


#: Local tier capacity of the stores the keyed-remote tests open.
KEYED_CAP_BYTES = 64 << 20


def key_file(tmp_path: Path, *keys: bytes, name: str = "auth.key") -> str:
    """A key file (mode 600) holding ``keys``, the first one signing or sealing."""
    path = tmp_path / name
    path.write_text("# ucm-db keys: the first signs or seals\n" + "".join(k.hex() + "\n" for k in keys))
    path.chmod(0o600)
    return str(path)


def write_through(tmp_path: Path, name: str, remote: "Remote", namespace: Any, keys: list[bytes], payloads: list[bytes],
                  **options: Any) -> None:
    """Puts a chain through a store named ``name`` writing through to ``remote``."""
    import ucm_db

    with ucm_db.open(tmp_path / name, capacity_bytes=KEYED_CAP_BYTES, remote_mode="write_through",
                     **remote.store_options(**options)) as store:
        store.put(namespace, keys, payloads)


def read_through(tmp_path: Path, name: str, remote: "Remote", namespace: Any, keys: list[bytes],
                 **options: Any) -> tuple[list[Any], dict[str, Any]]:
    """The chain as a store named ``name`` reads it through from ``remote``, and its remote stats."""
    import ucm_db

    with ucm_db.open(tmp_path / name, capacity_bytes=KEYED_CAP_BYTES, **remote.store_options(remote_deadline_s=10, **options)) as store:
        got = store.get(namespace, keys)
        return [None if g is None else bytes(g) for g in got], store.stats().remote

