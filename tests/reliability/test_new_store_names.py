"""A new store survives a power cut on a file system that makes a name
durable only when its directory is fsynced (POSIX's promise; ext4's journal
gives more, the power-cut simulator's default models that).

The store is created by a writer process at a path whose parents do not exist
yet, on the FUSE power-cut file system with ``names strict``; the writer
acknowledges a put (``sync``), a flushed put (``group``) or a RocksDB put, and
is killed with SIGKILL; the power is cut (every unsynced page dropped); a
fresh process opens the store and reads the acknowledged blocks. Before the
store fsynced the directories it created, the cut took the whole store with
it: the data file's bytes were durable, its name was not.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import tail
from .powercut import PowerCutMount

pytestmark = [pytest.mark.multiprocess, pytest.mark.crash]

CASES = [("lmdb", "sync"), ("lmdb", "group"), ("rocksdb", "sync")]
REPO = Path(__file__).resolve().parents[2]


#: The writer and the checker, each in a fresh interpreter (a forked child of
#: a test process that ran RocksDB's threads may hang on a lock held at the fork).
_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import ucm_db
    from tests.reliability.harness import NS, chain_tokens, payload_for
    role, store_path, engine, durability, out = sys.argv[1:6]
    os.environ[sys.argv[6]] = role  # a new boot id: what a reboot looks like
    keys = NS.block_keys(chain_tokens("new-store", 6))
    if role == "opener":  # opens a new store and is killed: nothing put, nothing flushed
        store = ucm_db.open(store_path, engine=engine, durability=durability, capacity_bytes=1 << 30)
        Path(out).write_text("acked")
        signal.pause()
    if role == "reader":  # after the cut: the new store opens read-only, empty
        with ucm_db.open(store_path, read_only=True) as store:
            assert store.lookup(NS, keys) == 0
        Path(out).write_text("ok")
        sys.exit(0)
    if role == "writer":
        store = ucm_db.open(store_path, engine=engine, durability=durability, capacity_bytes=1 << 30)
        store.put(NS, keys, [payload_for(k, 4096) for k in keys])
        if durability == "group":
            store.flush()
        Path(out).write_text("acked")
        signal.pause()  # killed here, the store open
    assert Path(store_path).is_dir(), f"the store directory {store_path} is gone after the cut"
    with ucm_db.open(store_path, engine=engine, durability=durability) as store:
        got = store.get(NS, keys)
        lost = [i for i, (k, v) in enumerate(zip(keys, got)) if v != payload_for(k, 4096)]
        assert not lost, f"acknowledged blocks {lost} lost or wrong after the cut"
    Path(out).write_text("ok")
""")


def _child(role: str, store_path: str, engine: str, durability: str, out: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as log_file:
        return subprocess.Popen([sys.executable, "-c", _CHILD, role, store_path, engine, durability, str(out), BOOT_ID_ENV],
                                cwd=REPO, stdout=log_file, stderr=log_file)


@pytest.mark.parametrize(("engine", "durability"), CASES)
def test_a_new_store_keeps_its_acknowledged_blocks_when_names_need_directory_syncs(
        tmp_path: Path, engine: str, durability: str) -> None:
    mount_dir = tmp_path / "mnt"
    with PowerCutMount(mount_dir, tmp_path) as mount:
        mount.strict_names(True)
        store_path = str(mount_dir / "serving" / "kv" / "store")
        acked, writer_log = tmp_path / "acked", tmp_path / "writer.log"
        _kill_once_acked(_child("writer", store_path, engine, durability, acked, writer_log), acked, writer_log)
        _cut_and_check(mount, "checker", store_path, engine, durability, tmp_path)


def _kill_once_acked(child: subprocess.Popen[bytes], acked: Path, log: Path) -> None:
    """Waits for ``child`` to write ``acked``, then SIGKILLs it."""
    try:
        deadline = time.monotonic() + 120
        while not acked.exists():
            assert time.monotonic() < deadline and child.poll() is None, f"the child did not get there:\n{tail(log)}"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()


def _cut_and_check(mount: PowerCutMount, role: str, store_path: str, engine: str, durability: str, tmp_path: Path) -> None:
    """The power cut (every unsynced page dropped), then ``role`` run on the store in a new boot."""
    mount.cut("drop", 0)
    result, check_log = tmp_path / "result", tmp_path / "check.log"
    checker = _child(role, store_path, engine, durability, result, check_log)
    assert checker.wait(timeout=120) == 0 and result.read_text() == "ok", tail(check_log)


@pytest.mark.parametrize(("engine", "durability"), [("lmdb", "group"), ("rocksdb", "group")])
def test_a_new_store_is_a_store_after_a_power_cut_right_after_its_open(
        tmp_path: Path, engine: str, durability: str) -> None:
    """Found by the RocksDB power-cut test (a cut soon after a writer opened
    a new store): a group store's creation records waited for the first
    sync, so a cut before it left a directory of engine files without a
    format record, which a read-only open refuses ("never initialised").
    A new store is synced once when its open creates it."""
    mount_dir = tmp_path / "mnt"
    with PowerCutMount(mount_dir, tmp_path) as mount:
        store_path = str(mount_dir / "store")
        opened, opener_log = tmp_path / "opened", tmp_path / "opener.log"
        _kill_once_acked(_child("opener", store_path, engine, durability, opened, opener_log), opened, opener_log)
        _cut_and_check(mount, "reader", store_path, engine, durability, tmp_path)
