"""Provisional puts: what a writer that died (SIGKILL) could no longer take
back is deleted, with its descendants, by the next sweep; nothing else is.

A real writer process (``python -c``) opens the store, makes a
:class:`ucm_db.ProvisionalOwner`, puts chains under tags and is killed with
SIGKILL; the test process sweeps by reopening the store, or by the
maintenance thread of a store it held open all along. Checked: unsettled
tags' blocks go with their descendants (stored by another process since),
settled tags' stay, a block found stored already stays (first writer wins),
a live owner's stay (in another process and in this one), a forked child
of the owner keeps nothing alive, a closed owner's unsettled blocks go, a
dead writer's unsettled blocks never reach a write-back ``file://`` remote
(another node misses them before any sweep) and are retracted from a
write-through one, and a malformed tag is refused with nothing written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.store import provisional

SWEEP_INTERVAL_S = 0.3
NS = ucm_db.Namespace(model="provisional-puts", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 64 << 20, "codec": "none", "sync_interval_s": 0.2}
UNIT = 4096

# The writer: stores chain "shared" first unprovisionally, then under tags:
# "settled" (settled at once), "voidable" (never settled), "again" (a tag
# naming shared's blocks, stored already: they stay shared's). argv: store
# path, "fork" to leave a forked child sleeping, "close" to close the owner.
WRITER = r"""
import os, sys, time
import ucm_db
ns = ucm_db.Namespace(model="provisional-puts", kv_dtype="bfloat16", block_size=4)
remote = [a.split("=", 1)[1] for a in sys.argv if a.startswith("remote=")]
mode = "write_through" if "write_through" in sys.argv else "write_back"
extra = {"remote": remote[0], "remote_mode": mode} if remote else {}
extra.update(engine="rocksdb") if "rocksdb" in sys.argv else None
store = ucm_db.open(sys.argv[1], capacity_bytes=64 << 20, codec="none", sync_interval_s=0.2, **extra)
def chain(seed):
    return ns.block_keys(list(range(seed, seed + 16)))
def put(keys, tag):
    seg = [(keys, [bytes([keys[i][0]]) * 4096 for i in range(len(keys))])]
    store.put_segments(ns, seg, provisional={k: tag for k in keys} if tag else None)
owner = store.provisional_owner()
put(chain(100), None)
settled = owner.tag(); put(chain(200), settled); owner.settle([settled])
put(chain(300), owner.tag())
put(chain(100), owner.tag())
store.flush()
if "fork" in sys.argv and os.fork() == 0:
    time.sleep(60); os._exit(0)
if "close" in sys.argv:
    owner.close()
print("ready", flush=True)
time.sleep(60)
"""


def _keys(seed: int) -> ucm_db.BlockKeys:
    return NS.block_keys(list(range(seed, seed + 16)))


def _writer(path: Path, *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), *flags], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _stored(store: ucm_db.Store, seed: int) -> int:
    return store.lookup(NS, _keys(seed), remote=False)


def _descendant(store: ucm_db.Store) -> ucm_db.BlockKeys:
    """A block another process stores below the voidable chain's last one."""
    keys = NS.block_keys(list(range(300, 300 + 20)))[4:]
    store.put(NS, keys, [b"\7" * UNIT] * len(keys))
    return keys


def test_a_killed_writers_unsettled_blocks_go_at_the_next_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = _writer(path)
    with ucm_db.open(path, **OPTIONS) as store:
        below = _descendant(store)
        assert [_stored(store, seed) for seed in (100, 200, 300)] == [4, 4, 4]
    _kill(proc)
    with ucm_db.open(path, read_only=True) as read_only:  # writes nothing, so sweeps nothing
        assert _stored(read_only, 300) == 4
    with ucm_db.open(path, **OPTIONS) as store:
        assert _stored(store, 100) == 4, "blocks stored already were another writer's"
        assert _stored(store, 200) == 4, "a settled tag's blocks were deleted"
        assert _stored(store, 300) == 0, "a dead writer's unsettled blocks stayed"
        assert store.get(NS, list(below)) == [None] * len(below), "a dead writer's blocks' descendants stayed"
        assert store.stats().blocks == 8
    assert not list(path.glob(".ucm-db.owner.*")), "the dead owner's file stayed"


@pytest.fixture
def quick_sweeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provisional, "SWEEP_INTERVAL_S", SWEEP_INTERVAL_S)


def _eventually_gone(store: ucm_db.Store, seed: int) -> int:
    deadline = time.monotonic() + 20 * SWEEP_INTERVAL_S
    while _stored(store, seed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _stored(store, seed)


@pytest.mark.usefixtures("quick_sweeps")
def test_an_open_store_sweeps_in_its_maintenance_thread(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = _writer(path)
    with ucm_db.open(path, **OPTIONS) as store:
        _descendant(store)
        time.sleep(4 * SWEEP_INTERVAL_S)
        assert _stored(store, 300) == 4, "a live owner's blocks were swept"
        _kill(proc)
        assert _eventually_gone(store, 300) == 0
        assert (_stored(store, 100), _stored(store, 200)) == (4, 4)


@pytest.mark.usefixtures("quick_sweeps")
def test_a_live_owner_in_this_process_is_never_swept(tmp_path: Path) -> None:
    """This process's own owners look unlocked to it (record locks never
    conflict within a process): its sweeps pass them over until closed."""
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        owner = store.provisional_owner()
        keys = _keys(500)
        tag = owner.tag()
        store.put_segments(NS, [(keys, [b"\1" * UNIT] * len(keys))], provisional={k: tag for k in keys})
        time.sleep(4 * SWEEP_INTERVAL_S)
        assert _stored(store, 500) == 4
        owner.close()
        assert _eventually_gone(store, 500) == 0, "a closed owner's unsettled blocks stayed"
        with pytest.raises(ucm_db.TierError, match="closed"):
            owner.tag()


def test_a_killed_writers_blocks_go_on_rocksdb_too(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _kill(_writer(path, "rocksdb"))
    with ucm_db.open(path, **OPTIONS) as store:
        assert store.config.engine == "rocksdb"
        assert [_stored(store, seed) for seed in (100, 200, 300)] == [4, 4, 0]


def test_a_forked_child_keeps_no_dead_owner_alive(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = _writer(path, "fork")
    _kill(proc)  # its forked child sleeps on, holding the store's files open
    with ucm_db.open(path, **OPTIONS) as store:
        assert _stored(store, 300) == 0
        assert _stored(store, 200) == 4


def _uploaded(shared: Path, seed: int) -> list[bool]:
    return [(shared / NS.short_id / key[:1].hex() / key.hex()).exists() for key in _keys(seed)]


def test_swept_blocks_are_retracted_from_a_write_through_remote(tmp_path: Path) -> None:
    shared = tmp_path / "remote"
    remote = {"remote": f"file://{shared}", "remote_mode": "write_through"}
    path = tmp_path / "s"
    proc = _writer(path, f"remote=file://{shared}", "write_through")
    assert _uploaded(shared, 300) == [True] * 4, "the writer did not upload"
    _kill(proc)
    with ucm_db.open(path, **OPTIONS, **remote) as store:
        assert _stored(store, 300) == 0
        store.flush(upload_timeout_s=30)
    assert _uploaded(shared, 300) == [False] * 4, "swept blocks stayed on the remote"
    with ucm_db.open(tmp_path / "other", **OPTIONS, **remote) as other:
        assert other.lookup(NS, _keys(300)) == 0


def test_a_killed_writers_unsettled_blocks_never_reach_a_write_back_remote(tmp_path: Path) -> None:
    shared = tmp_path / "remote"
    remote = {"remote": f"file://{shared}", "remote_mode": "write_back"}
    path = tmp_path / "s"
    proc = _writer(path, f"remote=file://{shared}")
    assert _uploaded(shared, 200) == [True] * 4, "the writer did not upload its settled blocks"
    assert _uploaded(shared, 300) == [False] * 4, "unsettled provisional blocks were uploaded"
    _kill(proc)
    with ucm_db.open(tmp_path / "other", **OPTIONS, **remote) as other:  # before anyone sweeps
        assert other.lookup(NS, _keys(300)) == 0, "another node was served a dead writer's blocks"
        assert other.lookup(NS, _keys(200)) == 4
    with ucm_db.open(path, **OPTIONS, **remote) as store:
        assert _stored(store, 300) == 0
        store.flush(upload_timeout_s=30)
    assert _uploaded(shared, 300) == [False] * 4


def test_a_malformed_tag_is_refused_and_nothing_written(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        keys = _keys(600)
        with pytest.raises(ucm_db.ConfigError, match="tag"):
            store.put_segments(NS, [(keys, [b"\1" * UNIT] * len(keys))], provisional={keys[0]: b"short"})
        assert _stored(store, 600) == 0
        with ucm_db.open(tmp_path / "ro", **OPTIONS):
            pass
    with ucm_db.open(tmp_path / "ro", read_only=True) as read_only, pytest.raises(ucm_db.TierError, match="read-only"):
        read_only.provisional_owner()
