"""A live process's sync record file is never removed, whatever PID
namespace it runs in (review of f65b138, finding 2).

A process holds a shared flock on its own record file for its lifetime, and
a remover unlinks only under an exclusive non-blocking flock. A writer in
another PID namespace (a container sharing the store directory) is what
``kill(pid, 0)`` cannot see; ``unshare --pid`` needs root here, so the test
makes ``records._alive`` blind to the child (a mock, the one in this file)
while the child is a real, live process writing through its file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ucm_db.engines.lmdb import records

ROOT = Path(__file__).resolve().parents[2]
CHILD = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
OPTS = dict(codec="none", durability="group", encode_threads=0, capacity_bytes=1 << 30, sync_interval_s=3600.0)
with ucm_db.open(Path(sys.argv[1]), **OPTS) as st:
    for line in sys.stdin:  # one chain put and flushed per line
        k = NS.block_keys(chain_tokens(line.strip(), 2)); st.put(NS, k, [payload_for(x, 4096) for x in k])
        st.flush()
        print("flushed", flush=True)
"""


@pytest.fixture
def writer(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdin is not None and child.stdout is not None

    def flush(name: str) -> None:
        child.stdin.write(name + "\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.stdout.readline().strip() == "flushed"  # type: ignore[union-attr]

    yield store / "lmdb", child, flush
    child.stdin.close()
    assert child.wait(timeout=120) == 0


def _own_files(env_dir: Path, pid: int) -> list[Path]:
    return list(env_dir.glob(f"{records.RECORD_FILE}.{pid}.*"))


def test_live_writer_in_another_pid_namespace_keeps_its_file(writer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env_dir, child, flush = writer
    flush("a")
    assert len(_own_files(env_dir, child.pid)) == 1
    monkeypatch.setattr(records, "_alive", lambda pid: False)  # the mock: the child's pid is not visible from here
    records.remove_stale(env_dir, 1 << 60)  # every file a candidate: only the flock can save the child's
    assert len(_own_files(env_dir, child.pid)) == 1, "a live writer's record file was removed"


def test_writer_makes_a_removed_file_again(writer) -> None:  # type: ignore[no-untyped-def]
    """An older version (or an operator) removed the file under the writer:
    its next record is written to a file with a name, made durable."""
    env_dir, child, flush = writer
    flush("a")
    (path,) = _own_files(env_dir, child.pid)
    path.unlink()
    flush("b")
    (again,) = _own_files(env_dir, child.pid)
    newest = records.newest(env_dir)
    raw = again.read_bytes()
    slots = [records.decode(raw[i * records.SLOT_BYTES:(i + 1) * records.SLOT_BYTES]) for i in (0, 1)]
    assert newest is not None and any(r is not None and r.txnid == newest.txnid for r in slots)


def test_a_closed_store_keeps_no_record_file_open(tmp_path: Path) -> None:
    """A process that opens and closes many group stores (a server's tests,
    a tool) holds no descriptor of those it closed: the record file's flock
    lives as long as its store, not as long as the process."""
    import os

    import ucm_db
    from tests.reliability.harness import NS, chain_tokens, payload_for

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    for i in range(20):
        with ucm_db.open(tmp_path / f"s{i}", codec="none", durability="group", encode_threads=0) as store:
            keys = NS.block_keys(chain_tokens(f"c{i}", 4))
            store.put(NS, keys, [payload_for(key, 256) for key in keys])
            store.flush()
        assert list((tmp_path / f"s{i}" / "lmdb").glob("synced-snapshot*")), "the store recorded nothing"
    assert open_fds() - before < 5
