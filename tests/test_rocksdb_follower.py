"""Read-only opens of a RocksDB store beside a live writer in another process
(ucm_db.engines.rocksdb_shadow): the writer flushes, compacts and switches
its write-ahead log all the time, deleting files; a read-only open (the
``events --follow`` poll, ``inspect``, ``verify``, a router's read-only
Store) neither fails nor serves a wrong byte, and a read-only Store keeps
reading values whose files the writer deleted after it opened.

Before the shadow pinned the store's files, 29 of 100 opens beside such a
writer failed ("No such file or directory ... /tmp/ucm-db-rocksdb-ro-.../
000265.log"), ``events --follow`` exited with status 1, and a value whose
blob file the writer had since deleted raised a bare IO error.

The writer is a real process with real puts; only its memtable is made
tiny (the engine's own constants, set before it opens) so that it flushes
every couple of puts and compacts often, as a busy store does over minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance

NS = ucm_db.Namespace(model="ro/live-writer", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 32 << 10

#: Puts chain ``i`` (4 blocks, every byte ``i % 251``) for i = 0, 1, 2 ... until killed, with event fields
#: (vLLM hash = the key's first 16 bytes) so the change feed has lines; prints "ready" after the first puts,
#: then the count of chains put every 100.
WRITER = textwrap.dedent("""
    import sys
    import ucm_db.engines.rocksdb as rocksdb
    rocksdb.WRITE_BUFFER_BYTES = 256 << 10  # a flush every two puts
    rocksdb.MAX_WAL_BYTES = 512 << 10
    import ucm_db
    from ucm_db import BlockEventFields
    ns = ucm_db.Namespace(model="ro/live-writer", kv_dtype="bfloat16", block_size=4)
    store = ucm_db.open(sys.argv[1], engine="rocksdb", capacity_bytes=4 << 20, codec="none")
    i = 0
    while True:
        tokens = [i * 100 + j for j in range(16)]
        keys = ns.block_keys(tokens)
        fields, parent = {}, None
        for n, key in enumerate(keys):
            fields[key] = BlockEventFields(key[:16], parent, tuple(tokens[4 * n:4 * n + 4]), 4)
            parent = key[:16]
        store.put(ns, keys, [bytes([i % 251]) * BLOCK_BYTES] * 4, event_fields=fields)
        i += 1
        if i == 20:
            print("ready", flush=True)
        elif i % 100 == 0:
            print(i, flush=True)
""").replace("BLOCK_BYTES", str(BLOCK_BYTES))


@contextmanager
def live_writer(path: Path) -> Iterator[subprocess.Popen[str]]:
    """The writer running on ``path`` (its stdout: "ready", then counts)."""
    with tempfile.TemporaryFile("w+") as errors:  # a file: an unread pipe could fill and stop the writer
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, stderr=errors,
                                  text=True)

        def failure() -> str:
            errors.seek(0)
            return errors.read()[-2000:]
        try:
            assert writer.stdout is not None
            if writer.stdout.readline().strip() != "ready":
                writer.wait(timeout=30)
                pytest.fail(f"the writer did not start: {failure()}")
            yield writer
            assert writer.poll() is None, f"the writer died: {failure()}"
        finally:
            writer.kill()
            writer.communicate(timeout=30)  # reaped, its pipe closed


def _chain(i: int) -> Sequence[bytes]:
    return NS.block_keys([i * 100 + j for j in range(16)])


def test_read_only_opens_beside_a_live_writer_all_succeed_and_read_right_bytes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    checked = 0
    with live_writer(path):
        for attempt in range(30):
            with ucm_db.open(path, read_only=True) as store:  # raised on about one open in three before
                assert store.config.engine == "rocksdb"
                blocks = store.stats().blocks
                assert blocks > 0
                for i in range(20 * attempt, 20 * attempt + 200):  # chains the writer may have put by now
                    for key, got in zip(_chain(i), store.get(NS, _chain(i))):
                        if got is not None:
                            assert bytes(got) == bytes([i % 251]) * BLOCK_BYTES, f"chain {i}, block {key.hex()[:8]}"
                            checked += 1
            if attempt % 10 == 9:
                report = maintenance.verify(path)  # every table at one moment: nothing dangles
                assert not report.problems, report
                assert maintenance.inspect(path)["blocks"] > 0
    assert checked > 0, "some chain was read back"


def test_ucm_db_events_follow_beside_a_live_writer_keeps_following(tmp_path: Path) -> None:
    """The real ``ucm-db events --follow`` (an open per feed read) while the
    writer puts 400 chains: before, three failed opens in a row ended it
    with status 1."""
    path, output, errors = tmp_path / "store", tmp_path / "follower.out", tmp_path / "follower.err"
    with live_writer(path) as writer, open(output, "w") as stdout, open(errors, "w") as stderr:
        follower = subprocess.Popen(  # to files: a full pipe would stop it, and its opens with it
            [sys.executable, "-c", "import sys; from ucm_db.tools.cli import main; sys.argv[0] = 'ucm-db'; sys.exit(main())",
             "events", str(path), "--follow", "--poll-interval", "0.01"], stdout=stdout, stderr=stderr)
        assert writer.stdout is not None
        try:
            while output.stat().st_size == 0:  # the follower is reading
                assert follower.poll() is None, f"the follower exited: {errors.read_text()[-2000:]}"
                time.sleep(0.01)
            start = int(writer.stdout.readline())
            while int(writer.stdout.readline()) < start + 400:
                assert follower.poll() is None, f"the follower exited: {errors.read_text()[-2000:]}"
            assert follower.poll() is None, f"the follower exited: {errors.read_text()[-2000:]}"
        finally:
            follower.terminate()
            follower.wait(timeout=30)
    assert errors.read_text() == ""
    lines = [json.loads(line) for line in output.read_text().split("\n")[:-1]]  # the last: torn by the stop, or empty
    assert any(line["type"] == "BlockStored" for line in lines)
    seqs = [line["seq"] for line in lines if "seq" in line]
    assert seqs == sorted(seqs), "the feed is read in order"


def test_a_read_only_store_keeps_reading_values_whose_files_the_writer_deleted(tmp_path: Path) -> None:
    path = tmp_path / "store"
    keys = NS.block_keys(list(range(10_000, 10_024)))
    payloads = [bytes([i + 1]) * 8192 for i in range(len(keys))]  # large enough for blob files
    with ucm_db.open(path, engine="rocksdb", capacity_bytes=4 << 20, codec="none") as store:
        store.put(NS, keys, payloads)
    blob_files = {name for name in os.listdir(path / "rocksdb") if name.endswith(".blob")}
    assert blob_files
    with ucm_db.open(path, read_only=True) as reader:
        with live_writer(path):  # its compactions move the chain's values and delete those files
            for _ in range(600):
                if not blob_files & set(os.listdir(path / "rocksdb")):
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the writer never deleted the blob files: the test proves nothing")
        # Raised "IO error: No such file or directory ... 000010.blob" before.
        assert [bytes(got) for got in reader.get(NS, keys)] == payloads  # type: ignore[arg-type]
    with ucm_db.open(path, read_only=True) as later:  # the store as the writer left it: moved or evicted, never wrong
        assert all(got is None or bytes(got) == payload for got, payload in zip(later.get(NS, keys), payloads))


def _descriptors_into(directory: Path) -> list[str]:
    """This process's open descriptors of files under ``directory``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(directory)):
            out.append(target)
    return out


def test_a_read_only_open_holds_no_descriptor_after_close(tmp_path: Path) -> None:
    """The pins go with the close (a follower polling for days opens the
    store many times)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    path = tmp_path / "store"
    with ucm_db.open(path, engine="rocksdb", capacity_bytes=1 << 24, codec="none") as store:
        store.put(NS, _chain(0), [os.urandom(8192) for _ in range(4)])  # into a blob file
    for _ in range(3):
        with ucm_db.open(path, read_only=True) as store:
            assert store.lookup(NS, _chain(0)) == 4
            assert any(name.endswith(".blob") for name in _descriptors_into(path / "rocksdb")), "the blob file is pinned"
        assert _descriptors_into(path / "rocksdb") == []
