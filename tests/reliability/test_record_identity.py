"""Sync records belong to one data file: ``compact`` drops them, and a
record of a replaced file never matches the new one, even where ext4 hands
the new file the old inode number (review of f65b138, finding 1).

The inode reuse itself cannot be forced on demand (ext4 reuses a freed
number on about every second compact), so the test produces the state it
leaves: the old file's records, restored after the compact with their inode
number rewritten to the new file's. Everything else is real: LMDB files,
processes killed with SIGKILL, boot ids moved with ``UCM_DB_BOOT_ID``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from ucm_db.engines.lmdb import records
from ucm_db.maintenance.compaction import compact

ROOT = Path(__file__).resolve().parents[2]
HEADER = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
S = Path(sys.argv[1])
OPTS = dict(codec="none", durability="group", encode_threads=0, capacity_bytes=1 << 30, sync_interval_s=3600.0,
            sync_bytes=1 << 40)
def put(st, name):
    k = NS.block_keys(chain_tokens(name, 2)); st.put(NS, k, [payload_for(x, 32 << 10) for x in k])
def last(st):
    return st._tier.engine._environment().info()["last_txnid"]
"""
FIRST = """
with ucm_db.open(S, **OPTS) as st:
    for i in range(50):
        put(st, f"c{i}")
        st.flush()
"""
SECOND = """
st = ucm_db.open(S, **OPTS)
i = 0
while last(st) < 60:
    put(st, f"n{i}"); i += 1
    st.flush()
while last(st) < 100:
    put(st, f"n{i}"); i += 1
print(i, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # commits past the last flush never synced: an OS crash may tear them
"""
THIRD = """
n = int(sys.argv[2])
with ucm_db.open(S, **OPTS) as st:
    print("rollback", st._tier.engine.rollback, flush=True)
    found = sum(st.get(NS, NS.block_keys(chain_tokens(f"n{i}", 2)))[0] is not None for i in range(n))
    print("found", found, "check", st._tier.check()[:3], flush=True)
"""


def _child(store: Path, boot: str, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, UCM_DB_BOOT_ID=boot)
    return subprocess.run([sys.executable, "-c", HEADER + body, str(store), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _record_files(env_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in env_dir.glob(f"{records.RECORD_FILE}*")}


def test_compact_drops_sync_records(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert _child(store, "boot-1", FIRST).returncode == 0
    assert _record_files(store / "lmdb"), "a group process records its syncs"
    compact(store, require_exclusive=True)
    assert _record_files(store / "lmdb") == {}, "records of the replaced data file survived compact"


def test_old_file_record_with_reused_inode_number_is_not_applied(tmp_path: Path) -> None:
    """The reviewer's scenario: a pre-compact record (txnid ~ 100 of the
    old file), the new file given the old inode number, commits past that
    txnid under a new boot, an OS crash, a reboot: the rollback must land
    on the new file's own last record, not on the old file's meta page."""
    store = tmp_path / "store"
    env_dir = store / "lmdb"
    assert _child(store, "boot-1", FIRST).returncode == 0
    old = _record_files(env_dir)
    compact(store, require_exclusive=True)
    new_inode = os.stat(env_dir / "data.mdb").st_ino
    for name, raw in old.items():  # what ext4's inode reuse leaves: the old records name the new file's inode
        slots = [records.decode(raw[i * records.SLOT_BYTES:(i + 1) * records.SLOT_BYTES]) for i in (0, 1)]
        reused = [records.encode(dataclasses.replace(r, data_inode=new_inode)) if r else bytes(records.SLOT_BYTES)
                  for r in slots]
        (env_dir / name).write_bytes(b"".join(reused))
    second = _child(store, "boot-2", SECOND)
    assert second.returncode == -9, second.stderr[-2000:]
    n = second.stdout.strip()
    third = _child(store, "boot-3", THIRD, n)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "to_txnid=6" in third.stdout, third.stdout  # the new file's record at ~60, not the old file's ~100
    assert "check []" in third.stdout, third.stdout
