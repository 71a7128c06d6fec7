"""A RocksDB store across processes, as LMDB's promises read (docs/api.md,
docs/storage.md): a writer SIGKILLed at random moments under ``group``
durability loses nothing a put acknowledged (a process crash loses nothing
committed), and a read-only reader opening the store beside the live
writer, again and again, never reads a wrong byte and never fails to open;
``ucm-db inspect --json`` beside it always answers.

The writer is a real process (real puts, evictions under a small capacity,
deletes); it prints each chain once its put returned."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ucm_db

NS = ucm_db.Namespace(model="audit-rocksdb-processes", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 24 << 10

#: Puts chain i (3 blocks, bytes i % 251) for i from argv[2] on, pausing argv[3] seconds after each; a delete of
#: every 7th chain's tail; prints i after each put returned. 3 MiB hold the last ~40 chains.
WRITER = textwrap.dedent("""
    import sys
    import time
    import ucm_db
    ns = ucm_db.Namespace(model="audit-rocksdb-processes", kv_dtype="bfloat16", block_size=4)
    store = ucm_db.open(sys.argv[1], engine="rocksdb", capacity_bytes=3 << 20, codec="none", durability="group",
                        sync_interval_s=3600)
    i = int(sys.argv[2])
    while True:
        keys = ns.block_keys([i * 100 + j for j in range(12)])
        store.put(ns, keys, [bytes([i % 251]) * BLOCK_BYTES] * 3)
        if i % 7 == 0:
            store.delete(ns, keys[2:])
        print(i, flush=True)
        i += 1
        time.sleep(float(sys.argv[3]))
""").replace("BLOCK_BYTES", str(BLOCK_BYTES))


INSPECT = "import sys; from ucm_db.tools.cli import main; sys.argv[0] = 'ucm-db'; sys.argv[1:1] = ['inspect', '--json']; main()"


def chain(i: int) -> ucm_db.BlockKeys:
    return NS.block_keys([i * 100 + j for j in range(12)])


def expected_blocks(i: int) -> int:
    return 2 if i % 7 == 0 else 3


def test_sigkilled_group_writer_loses_no_acknowledged_put(tmp_path: Path) -> None:
    path, rng, start = tmp_path / "s", random.Random(5), 0
    for _round in range(4):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(start), "0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert writer.stdout is not None
        acked = [int(writer.stdout.readline())]
        deadline = time.monotonic() + rng.uniform(0.2, 1.0)
        while time.monotonic() < deadline:
            acked.append(int(writer.stdout.readline()))
        writer.send_signal(signal.SIGKILL)
        rest, errors = writer.communicate(timeout=30)
        assert writer.returncode == -signal.SIGKILL, errors
        acked += [int(line) for line in rest.split()]  # printed before the kill: acknowledged too
        with ucm_db.open(path) as store:
            # the newest chains fit in the capacity: none may be missing or short
            for i in acked[-8:]:
                got = store.get(NS, chain(i))
                assert got[:expected_blocks(i)] == [bytes([i % 251]) * BLOCK_BYTES] * expected_blocks(i), f"chain {i}"
            assert store._tier.check() == []
        start = acked[-1] + 1


def test_read_only_reader_and_inspect_beside_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "s"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "0", "0.005"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    latest = [-1]

    def follow() -> None:  # the newest chain acknowledged (an unread pipe would also stop the writer)
        assert writer.stdout is not None
        for line in writer.stdout:
            latest[0] = int(line)
    threading.Thread(target=follow, daemon=True).start()
    try:
        while latest[0] < 20:
            assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
            time.sleep(0.01)
        checked = 0
        for attempt in range(15):
            last = latest[0]
            with ucm_db.open(path, read_only=True) as store:  # sees at least every chain acknowledged before
                # ... whole, or evicted as the oldest (the writer runs ahead of `latest` where this thread is slow
                # to read its pipe, and 3 MiB hold about 40 chains): then every older chain is gone too.
                found = store.lookup(NS, chain(last))
                older = [i for i in range(max(0, last - 45), last) if store.lookup(NS, chain(i))]
                assert found == expected_blocks(last) or not older, (last, found, older)
                for i in range(max(0, last - 20), last + 60):
                    for got in store.get(NS, chain(i)):
                        if got is not None:
                            assert bytes(got) == bytes([i % 251]) * BLOCK_BYTES, f"chain {i}"
                            checked += 1
                assert store._tier.check() == []
            if attempt % 5 == 0:
                done = subprocess.run([sys.executable, "-c", INSPECT, str(path)], capture_output=True, text=True,
                                      timeout=120)
                assert done.returncode == 0, done.stderr
                assert json.loads(done.stdout)["blocks"] > 0
        assert checked > 0 and writer.poll() is None
    finally:
        writer.kill()
        writer.wait(timeout=30)
