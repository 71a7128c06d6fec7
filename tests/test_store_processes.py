"""Real processes: several on one store, and SIGKILL after acknowledged puts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="mp", kv_dtype="bfloat16", block_size=4)

_WRITER = textwrap.dedent("""
    import sys, ucm_db
    from ucm_db import Namespace
    ns = Namespace(model="mp", kv_dtype="bfloat16", block_size=4)
    path, durability, tag = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = ucm_db.open(path, durability=durability, codec="zstd", capacity_bytes=1 << 30)
    i = 0
    while True:
        keys = ns.block_keys([tag, i] * 8)
        store.put(ns, keys, [bytes([tag, i % 256]) * 20000 for _ in keys])
        print(i, flush=True)  # acknowledged: put returned
        i += 1
""")


def _spawn_writer(path: Path, durability: str, tag: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), durability, str(tag)], stdout=subprocess.PIPE, text=True)


@pytest.mark.crash
@pytest.mark.parametrize("durability", ["group", "sync"])
def test_sigkill_loses_no_acknowledged_put(tmp_path: Path, durability: str) -> None:
    path = tmp_path / "s"
    ucm_db.open(path, durability=durability, codec="zstd", capacity_bytes=1 << 30).close()
    writers = [_spawn_writer(path, durability, tag) for tag in (1, 2)]
    acked: dict[int, list[int]] = {1: [], 2: []}
    # Two interpreter start-ups and 25 acked puts each (an fsync each under
    # "sync", two writers on one lock) on a loaded CI host; the loop stops at
    # 25 each, so the deadline costs nothing when the writers keep up.
    deadline = time.monotonic() + 60
    for tag, proc in zip((1, 2), writers):
        assert proc.stdout is not None
        while len(acked[tag]) < 25 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked[tag].append(int(line))
    for proc in writers:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with ucm_db.open(path) as store:
        for tag, done in acked.items():
            assert len(done) >= 25
            for i in done:
                keys = NS.block_keys([tag, i] * 8)
                got = store.get(NS, keys)
                assert [bytes(x) if x is not None else None for x in got] == [bytes([tag, i % 256]) * 20000] * 4
        assert store._tier.check() == []


_READER = textwrap.dedent("""
    import sys, ucm_db
    from ucm_db import Namespace
    ns = Namespace(model="mp", kv_dtype="bfloat16", block_size=4)
    store = ucm_db.open(sys.argv[1])
    keys = ns.block_keys(list(range(400)))
    n = store.lookup(ns, keys)
    got = store.get(ns, keys[:n])
    ok = all(bytes(x) == bytes([i % 256]) * 1000 for i, x in enumerate(got))
    store.close()
    print(n, ok)
""")


@pytest.mark.multiprocess
def test_worker_processes_read_what_another_process_committed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none") as store:
        keys = NS.block_keys(list(range(400)))
        store.put(NS, keys, [bytes([i % 256]) * 1000 for i in range(len(keys))])
        readers = [subprocess.run([sys.executable, "-c", _READER, str(path)], capture_output=True, text=True, timeout=60) for _ in range(3)]
    for proc in readers:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["100", "True"]
