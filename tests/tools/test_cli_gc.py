"""`ucm-db gc` on a real file:// remote laid out by ucm_db.remote.tier."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_db import codec
from ucm_db.remote.tier import RemoteRoot, RemoteTier

from cli_stores import NS_A, NS_B, chain_keys, invoke, invoke_json, payload

DAY_S = 86400


def own_tier(url: str, options: dict[str, str] | None = None) -> RemoteTier:
    """NS_A's tier on the remote, with the namespace manifest an uploader
    writes first (gc touches only namespaces that have ucm-db's manifest)."""
    root = RemoteRoot.from_url(url, options)
    root.ensure_manifest(NS_A.digest[:16], NS_A.to_dict())
    return root.tier(NS_A.digest[:16])


def fill_remote(url: str) -> dict[str, list[bytes]]:
    """Chains x (first 2 blocks 10 days old, rest new), y (new), z (all old)."""
    tier = own_tier(url)
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


def test_gc_by_age_removes_old_subtrees_and_keeps_old_ancestors_of_new_objects(tmp_path: Path) -> None:
    """Chain z is all old: it goes. Chain x's first 2 blocks are old but its
    tail is new: an object is as old as the youngest object under it, so x
    stays whole (it used to go, the new tail with its old ancestors: the
    audit's data loss, tests/remote/test_gc_tails.py)."""
    url = f"file://{tmp_path / 'remote'}"
    chains = fill_remote(url)
    stale = tmp_path / "remote" / NS_A.digest[:8].hex() / ".tmp-crashed-upload"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - DAY_S, time.time() - DAY_S))

    dry = invoke_json("gc", url, "--older-than", "7d", "--dry-run")
    assert dry["removed_objects"] == 5 and all(present(url, chains["z"]))

    r = invoke_json("gc", url, "--older-than", "7d")
    assert r["objects_before"] == 15 and r["removed_by_rule"] == 5 and r["removed_descendants"] == 0
    assert r["temp_files_removed"] == 1 and not stale.exists()
    assert present(url, chains["x"]) == [True] * 5  # old ancestors of a new tail stay
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
    the grace age is an orphan and goes. The victim lies in another
    namespace: in theirs it would wait, since any object there may be an
    ancestor of the uploading blocks (tests/remote/test_gc_inflight.py)."""
    from ucm_db.remote.gc import ORPHAN_GRACE_S

    url = f"file://{tmp_path / 'remote'}"
    tier = own_tier(url)
    RemoteRoot.from_url(url).ensure_manifest(NS_B.digest[:16], NS_B.to_dict())
    other = RemoteRoot.from_url(url).tier(NS_B.digest[:16])
    old_s = time.time() - 10 * DAY_S
    victim = chain_keys(NS_B, "old", 1)[0]
    other.store(victim, None, codec.encode(victim, payload("old", 0), codec="none"))
    os.utime(other.path(victim), (old_s, old_s))
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
    assert present(url, orphan[1:]) == [False] * 2 and other.exists([victim]) == [False]


def test_an_object_of_unknown_age_with_an_absent_parent_is_kept() -> None:
    """A listing without modification times (mtime 0) cannot tell an
    orphan from an upload in flight: it is kept."""
    from ucm_db.remote.gc import RemoteObjectInfo, orphaned_descendants

    keys = chain_keys(NS_A, "unknown-age", 3)
    objects = [RemoteObjectInfo("ns/ab/" + keys[2].hex(), keys[2], 100, 0.0, parent=keys[1])]
    assert orphaned_descendants(objects, {"some-victim"}, now_s=time.time()) == set()


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
    tier = own_tier(url, options)
    root = tier.remote
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


def test_gc_touches_nothing_but_ucm_db_objects(tmp_path: Path) -> None:
    """Issue 26 item 2: files named by 64 hex digits that are not ucm-db's
    objects (another application's content-addressed files at the root or
    in its own directory, files of a namespace directory that are off the
    layout or do not start like an object, and a namespace-like directory
    without ucm-db's manifest) all survive gc, however old; real old
    objects go."""
    remote_dir = tmp_path / "remote"
    url = f"file://{remote_dir}"
    chains = fill_remote(url)  # chain z: 5 objects 10 days old
    ns_dir = remote_dir / NS_A.digest[:8].hex()
    real = next(iter(ns_dir.glob("*/" + "?" * 64))).read_bytes()  # a real object's bytes
    name = "ab" * 32
    foreign = {
        remote_dir / name: b"git-lfs object at the root",
        remote_dir / "otherapp" / name: b"another app's file",
        remote_dir / "otherapp" / "ab" / name: real,  # the layout's shape, outside any namespace
        remote_dir / "0123456789abcdef" / "ab" / name: real,  # a namespace-like directory with no manifest
        ns_dir / "cd" / name: real,  # wrong fan-out directory for its name
        ns_dir / name: real,  # no fan-out directory
        ns_dir / "ab" / "x" / name: real,  # one level too deep
        ns_dir / "AB" / name.upper(): real,  # not how the uploader spells names
        ns_dir / "ab" / name: b"not an object, under an object's name" * 4,
        ns_dir / "ab" / ".tmp-not-ours" / name: b"inside a temp-named directory",
    }
    old_s = time.time() - 30 * DAY_S
    for path, data in foreign.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (old_s, old_s))
    other_temp = remote_dir / "otherapp" / ".tmp-their-upload"
    other_temp.write_bytes(b"x")
    os.utime(other_temp, (old_s, old_s))

    r = invoke_json("gc", url, "--older-than", "7d")
    assert present(url, chains["z"]) == [False] * 5 and present(url, chains["y"]) == [True] * 5
    assert r["objects_before"] == 15 and r["skipped_entries"] >= 5
    survivors = {path: path.read_bytes() for path in foreign if path.exists()}
    assert survivors == foreign and other_temp.exists()


@pytest.mark.parametrize("empty", [["--older-than", "", "--max-bytes", "1TiB"], ["--max-bytes", "", "--older-than", "7d"]])
def test_an_empty_limit_is_refused_not_dropped(tmp_path: Path, empty: list[str]) -> None:
    """Audit F15: `--older-than ""` (an unset "$AGE") was tested for truth and
    dropped: gc ran by the other limit alone."""
    url = f"file://{tmp_path / 'remote'}"
    chains = fill_remote(url)
    result = invoke("gc", url, *empty, expect=2)
    assert ("cannot read duration ''" if empty[0] == "--older-than" else "cannot read size ''") in result.stderr
    assert "write e.g." in result.stderr
    assert all(all(present(url, keys)) for keys in chains.values())
