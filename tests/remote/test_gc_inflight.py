"""``ucm-db gc`` beside an upload in flight (review finding: data loss).

The write-back uploader sends its queue in key order, so a chain's deeper
blocks often land on the remote before their parents. Chain A -> B -> C: A
uploaded a month ago, C seconds ago, B still queued. gc carried C's youth up
its parent chain only as far as the absent B, so ``--older-than 7d`` took A
for old and removed it while C stayed; ``--max-bytes`` took A for a leaf (its
only child, B, is not listed yet) and removed it first. Once B landed, the
remote held B and C under a removed ancestor: another node's lookup found 0
of 3 blocks.

An object names only its parent (the envelope), so gc cannot tell which
present object an absent parent hangs from: any object of the namespace may
be that ancestor. While an object whose parent is absent is younger than
``ORPHAN_GRACE_S``, the rules remove nothing in its namespace this run
(``held_*`` in the report); other namespaces are collected as before, and
no more than they would have been without the hold.

Each end-to-end test writes through a real LMDB store to a real ``file://``
remote, removes B's object to stand for "not uploaded yet" (and writes it
back for "B lands"), sets upload times with ``os.utime``, and runs gc
through ``maintenance.gc_remote`` or ``ucm-db gc --json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import maintenance
from ucm_db.keys import Namespace
from ucm_db.remote.gc import ORPHAN_GRACE_S, RemoteObjectInfo, choose_victims
from ucm_db.tools.cli import cli

pytestmark = pytest.mark.timeout(180)
NS = Namespace(model="test/gc-inflight", kv_dtype="bfloat16", block_size=4, layout="test")
OTHER = Namespace(model="test/gc-inflight-other", kv_dtype="bfloat16", block_size=4, layout="test")
CAP = 64 << 20
DAY_S = 86400.0
TOKENS = list(range(12))  # 3 blocks: A -> B -> C
OTHER_TOKENS = list(range(100, 116))  # 4 blocks in another namespace


def object_path(remote_dir: Path, ns: Namespace, key: bytes) -> Path:
    return remote_dir / ns.short_id / key[:1].hex() / key.hex()


def set_age(path: Path, age_s: float) -> None:
    mtime_s = time.time() - age_s
    os.utime(path, (mtime_s, mtime_s))


def written_chain(tmp_path: Path) -> tuple[str, dict[str, Path], bytes]:
    """A file:// remote holding chain A -> B -> C of :data:`NS` and a chain of
    :data:`OTHER`, all a day old but A (a month) and C (5 s); B's object is
    taken away (still in the uploader's queue). Returns the url, the objects'
    paths (A, B, C, then other0..other3) and B's bytes."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    url = f"file://{remote_dir}"
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through") as store:
        keys = NS.block_keys(TOKENS, epoch=store.epoch(NS))
        store.put(NS, keys, [name.encode() * 64 for name in "ABC"])
        other = OTHER.block_keys(OTHER_TOKENS, epoch=store.epoch(OTHER))
        store.put(OTHER, other, [bytes([i]) * 64 for i in range(len(other))])
    paths = {name: object_path(remote_dir, NS, key) for name, key in zip("ABC", keys)}
    paths.update({f"other{i}": object_path(remote_dir, OTHER, key) for i, key in enumerate(other)})
    for path in paths.values():
        set_age(path, DAY_S)
    set_age(paths["A"], 30 * DAY_S)
    set_age(paths["C"], 5)
    b_bytes = paths["B"].read_bytes()
    paths["B"].unlink()
    return url, paths, b_bytes


def present(paths: dict[str, Path]) -> dict[str, bool]:
    return {name: path.exists() for name, path in paths.items()}


def chain_found(tmp_path: Path, url: str, node: str) -> int:
    """Blocks of the chain another node finds through the remote."""
    with ucm_db.open(tmp_path / node, capacity_bytes=CAP, remote=url, remote_deadline_s=10) as other:
        return other.lookup(NS, NS.block_keys(TOKENS, epoch=other.epoch(NS)))


def run_gc(url: str, *limits: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["gc", url, *limits, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    return dict(json.loads(result.stdout))


def test_choose_victims_keeps_any_possible_ancestor_of_an_object_whose_parent_is_uploading() -> None:
    """The reviewer's first repro, on choose_victims directly: C's parent B
    is absent and C is 5 s old, so A (a month old) may be C's ancestor:
    neither rule removes it (it used to: victims ['ns/aa/'], and
    ``--max-bytes 1000`` took A for a leaf)."""
    now_s = time.time()
    a, b, c = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32
    objects = [
        RemoteObjectInfo("ns/aa/" + a.hex(), a, 1000, now_s - 30 * DAY_S, parent=None),
        RemoteObjectInfo("ns/cc/" + c.hex(), c, 1000, now_s - 5, parent=b),
    ]
    assert choose_victims(objects, older_than_s=7 * DAY_S, max_bytes=None, now_s=now_s) == (set(), set())
    assert choose_victims(objects, older_than_s=None, max_bytes=1000, now_s=now_s) == (set(), set())
    assert choose_victims(objects, older_than_s=None, max_bytes=0, now_s=now_s) == (set(), set())

    # An object of unknown age (a listing without times) may be uploading too.
    unknown = [objects[0], RemoteObjectInfo("ns/cc/" + c.hex(), c, 1000, 0.0, parent=b)]
    assert choose_victims(unknown, older_than_s=7 * DAY_S, max_bytes=0, now_s=now_s) == (set(), set())

    # Past the grace B is taken for gone: C is an orphan, and A is old.
    objects[1].mtime_s = now_s - 2 * ORPHAN_GRACE_S
    assert choose_victims(objects, older_than_s=7 * DAY_S, max_bytes=None, now_s=now_s) == ({objects[0].path}, {objects[1].path})


def test_older_than_keeps_the_ancestor_of_a_young_object_whose_parent_is_uploading(tmp_path: Path) -> None:
    """The reviewer's end-to-end repro: gc --older-than 7d removed A (a
    month old) while C (5 s) stayed; once B landed, another node found 0 of
    3 blocks. Now A waits (the report says why) and the chain is whole once
    B lands; the other namespace's old chain is collected as before."""
    url, paths, b_bytes = written_chain(tmp_path)
    for i in range(4):
        set_age(paths[f"other{i}"], 10 * DAY_S)

    report = maintenance.gc_remote(url, older_than_s=7 * DAY_S)

    assert present(paths) == {"A": True, "B": False, "C": True, **{f"other{i}": False for i in range(4)}}, report
    assert report["removed_by_rule"] == 4 and report["removed_descendants"] == 0, report
    assert report["held_by_rule"] == 1 and report["held_namespaces"] == 1, report
    assert "still uploading" in report["held_reason"], report

    paths["B"].write_bytes(b_bytes)  # B lands
    assert chain_found(tmp_path, url, "reader") == 3


def test_max_bytes_neither_takes_a_parent_of_an_uploading_block_for_a_leaf_nor_trims_others_instead(tmp_path: Path) -> None:
    """``--max-bytes`` at what the remote holds less A: A, the oldest
    object, looked like a leaf (its child B is in flight) and went. Now A
    waits, and the other namespace loses nothing for it: the rules choose as
    they would without the hold, and only what they chose in a namespace
    with an upload in flight waits. The remote stays over the limit this
    run (``held_reason`` says why); once B has landed, the next run trims."""
    url, paths, b_bytes = written_chain(tmp_path)
    total = sum(path.stat().st_size for path in paths.values() if path.exists())
    limit = total - paths["A"].stat().st_size

    dry = run_gc(url, "--max-bytes", str(limit), "--dry-run")
    report = run_gc(url, "--max-bytes", str(limit))

    assert all(present(paths)[name] for name in paths if name != "B"), report
    assert dry["removed_objects"] == report["removed_objects"] == 0 and report["bytes_after"] == total > limit, report
    assert dry["held_by_rule"] == report["held_by_rule"] == 1 and report["held_namespaces"] == 1, report
    assert "still uploading" in report["held_reason"]

    paths["B"].write_bytes(b_bytes)  # B lands: nothing is in flight
    set_age(paths["B"], 10)
    report = run_gc(url, "--max-bytes", str(limit))
    assert report["held_namespaces"] == 0 and report["held_by_rule"] == 0 and report["held_reason"] is None, report
    assert report["bytes_after"] <= limit and report["removed_descendants"] == 0, report
    assert present(paths)["A"] and present(paths)["C"], "A holds up C: a tail of the other namespace went instead"
    assert chain_found(tmp_path, url, "reader") == 3


def test_the_hold_ends_with_the_grace(tmp_path: Path) -> None:
    """An object whose parent has been absent past ``ORPHAN_GRACE_S`` is an
    orphan (its parent is taken for gone): the namespace is no longer held,
    A goes by age and C with the cascade, as before."""
    url, paths, _ = written_chain(tmp_path)
    set_age(paths["C"], 2 * ORPHAN_GRACE_S)

    report = run_gc(url, "--older-than", "7d")

    assert {k: report[k] for k in ("removed_by_rule", "removed_descendants", "held_by_rule", "held_namespaces")} == {
        "removed_by_rule": 1, "removed_descendants": 1, "held_by_rule": 0, "held_namespaces": 0}, report
    assert not present(paths)["A"] and not present(paths)["C"]
    assert all(present(paths)[f"other{i}"] for i in range(4))
