"""`ucm-db gc` on a real file:// remote laid out by ucm_db.tiers.remote."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_db import codec
from ucm_db.tiers.remote import RemoteRoot

from cli_stores import NS_A, chain_keys, invoke, invoke_json, payload

DAY_S = 86400


def fill_remote(url: str) -> dict[str, list[bytes]]:
    """Chains x (first 2 blocks 10 days old, rest new), y (new), z (all old)."""
    root = RemoteRoot.from_url(url)
    tier = root.tier(NS_A.digest[:16])
    chains = {tag: chain_keys(NS_A, tag, 5) for tag in ("x", "y", "z")}
    old = time.time() - 10 * DAY_S
    for tag, keys in chains.items():
        for i, key in enumerate(keys):
            tier.store(key, keys[i - 1] if i else None, codec.encode(key, payload(tag, i), codec="none"))
            if tag == "z" or (tag == "x" and i < 2):
                os.utime(tier.path(key), (old, old))
    return chains


def present(url: str, keys: list[bytes]) -> list[bool]:
    return RemoteRoot.from_url(url).tier(NS_A.digest[:16]).exists(keys)


def test_gc_by_age_removes_old_objects_and_their_descendants(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    chains = fill_remote(url)
    stale = tmp_path / "remote" / NS_A.digest[:8].hex() / ".tmp-crashed-upload"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - DAY_S, time.time() - DAY_S))

    dry = invoke_json("gc", url, "--older-than", "7d", "--dry-run")
    assert dry["removed_objects"] == 10 and all(present(url, chains["z"]))

    r = invoke_json("gc", url, "--older-than", "7d")
    assert r["objects_before"] == 15 and r["removed_by_rule"] == 7 and r["removed_descendants"] == 3
    assert r["temp_files_removed"] == 1 and not stale.exists()
    assert present(url, chains["x"]) == [False] * 5  # new tail went with its old ancestors
    assert present(url, chains["z"]) == [False] * 5
    assert present(url, chains["y"]) == [True] * 5


def test_gc_to_a_size_removes_oldest_first(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    chains = fill_remote(url)
    size = os.path.getsize(RemoteRoot.from_url(url).tier(NS_A.digest[:16]).path(chains["y"][0]))
    r = invoke_json("gc", url, "--max-bytes", str(size * 6))
    assert r["bytes_after"] <= size * 6
    assert present(url, chains["y"]) == [True] * 5
    assert not any(present(url, chains["z"]))


def test_gc_keeps_new_objects_whose_ancestors_are_still_uploading(tmp_path: Path) -> None:
    """The write-back uploader sends its queue in key order, so a chain's
    deeper blocks may land before their ancestors: their parent is absent,
    not removed. gc (here with one unrelated old victim, which starts the
    cascade) must leave them; an object whose parent has been missing past
    the grace age is an orphan and goes."""
    from ucm_db.remote_gc import ORPHAN_GRACE_S

    url = f"file://{tmp_path / 'remote'}"
    tier = RemoteRoot.from_url(url).tier(NS_A.digest[:16])
    old_s = time.time() - 10 * DAY_S
    victim = chain_keys(NS_A, "old", 1)[0]
    tier.store(victim, None, codec.encode(victim, payload("old", 0), codec="none"))
    os.utime(tier.path(victim), (old_s, old_s))
    uploading = chain_keys(NS_A, "up", 6)  # blocks 3-5 arrived, 0-2 still queued
    for i in range(3, 6):
        tier.store(uploading[i], uploading[i - 1], codec.encode(uploading[i], payload("up", i), codec="none"))
    orphan = chain_keys(NS_A, "orphan", 3)  # block 0 long gone, 1-2 left behind
    stale_s = time.time() - 2 * ORPHAN_GRACE_S
    for i in (1, 2):
        tier.store(orphan[i], orphan[i - 1], codec.encode(orphan[i], payload("orphan", i), codec="none"))
        os.utime(tier.path(orphan[i]), (stale_s, stale_s))

    r = invoke_json("gc", url, "--older-than", "7d")
    assert r["removed_by_rule"] == 1 and r["removed_descendants"] == 2
    assert present(url, uploading[3:]) == [True] * 3
    assert present(url, [victim, *orphan[1:]]) == [False] * 3


def test_an_object_of_unknown_age_with_an_absent_parent_is_kept() -> None:
    """A listing without modification times (mtime 0) cannot tell an
    orphan from an upload in flight: it is kept."""
    from ucm_db.remote_gc import RemoteObjectInfo, orphaned_descendants

    class Listing:  # read_range of each object's envelope, from a real remote laid out below
        def __init__(self, root: RemoteRoot) -> None:
            self.root = root

        def read_range(self, path: str, start: int, end: int) -> bytes | None:
            return self.root.read_range(path, start, end)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = RemoteRoot.from_url(f"file://{tmp}/remote")
        tier = root.tier(NS_A.digest[:16])
        keys = chain_keys(NS_A, "unknown-age", 3)
        tier.store(keys[2], keys[1], codec.encode(keys[2], payload("u", 2), codec="none"))
        objects = [RemoteObjectInfo(tier.path(keys[2]), keys[2], 100, 0.0)]
        assert orphaned_descendants(Listing(root), objects, {"some-victim"}, now_s=time.time()) == set()  # type: ignore[arg-type]


def test_gc_needs_a_rule(tmp_path: Path) -> None:
    result = invoke("gc", f"file://{tmp_path}", expect=2)
    assert "--older-than" in result.stderr
    assert "cannot read duration" in invoke("gc", f"file://{tmp_path}", "--older-than", "soon", expect=2).stderr


@pytest.fixture(scope="module")
def s3_url() -> Iterator[tuple[str, list[str]]]:
    """A bucket on a real S3 API server (moto) on 127.0.0.1, with the
    --option flags that reach it."""
    import logging
    import socket

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir("gc-test")
    yield "s3://gc-test/kv", [f"{k}={v}" for k, v in options.items()]
    server.stop()


@pytest.mark.s3
def test_gc_on_s3_keeps_whole_prefixes(s3_url: tuple[str, list[str]]) -> None:
    url, flags = s3_url
    options = dict(flag.split("=", 1) for flag in flags)
    root = RemoteRoot.from_url(url, options)
    tier = root.tier(NS_A.digest[:16])
    chains = {tag: chain_keys(NS_A, tag, 5) for tag in ("p", "q", "r")}
    for tag, keys in chains.items():
        for i, key in enumerate(keys):
            tier.store(key, keys[i - 1] if i else None, codec.encode(key, payload(tag, i), codec="none"))
    size = len(root.fs.cat_file(tier.path(chains["p"][0])))
    option_args = [a for flag in flags for a in ("--option", flag)]

    r = invoke_json("gc", url, "--max-bytes", str(size * 7), *option_args)
    assert r["objects_before"] == 15 and r["bytes_after"] <= size * 7 and r["removed_objects"] >= 8
    root.fs.invalidate_cache()
    for keys in chains.values():
        have = tier.exists(keys)
        assert have == sorted(have, reverse=True), have  # present blocks form a prefix
