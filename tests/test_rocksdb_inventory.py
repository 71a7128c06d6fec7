"""The change feed's inventory beside writers: on RocksDB a read transaction
held the gate that every commit takes, so ``Store.event_inventory`` (a walk
of every evented block) stalled every put for its whole length (about 0.45 s
at 50k blocks). Reads now read snapshots taken at one commit and hold no
lock (ucm_db.engines.rocksdb); the inventory still pairs with the feed
position of its own snapshot, so inventory + feed is the store, exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, Namespace
from ucm_db.engines.rocksdb import RocksDbEngine

NS = Namespace(model="inventory/rocks", kv_dtype="bfloat16", block_size=4)
CHAIN_BLOCKS = 500


def _block_hash(key: bytes) -> bytes:
    return b"v" + key[:15]


def _put_chain(store: ucm_db.Store, first_token: int, blocks: int) -> list[bytes]:
    """An evented chain of ``blocks`` blocks, the way a connector saves one."""
    tokens = [first_token] + list(range(4 * blocks - 1))
    keys = NS.block_keys(tokens)
    fields, parent = {}, None
    for i, key in enumerate(keys):
        fields[key] = BlockEventFields(_block_hash(key), parent, tuple(tokens[4 * i:4 * i + 4]), 4, None, None, 0)
        parent = _block_hash(key)
    store.put(NS, keys, [b"x" * 64] * len(keys), event_fields=fields)
    return list(keys)


def test_a_commit_does_not_wait_for_a_read_in_flight(tmp_path: Path) -> None:
    engine = RocksDbEngine(tmp_path / "db", sync=False)
    try:
        engine.write(lambda txn: (txn.put("info", b"a", b"1"), txn.put("meta", b"a", b"1")))
        inside, release = threading.Event(), threading.Event()

        def long_read(txn: object) -> tuple[object, object]:  # a reader parked in the middle of its transaction
            first = (txn.get("info", b"a"), txn.get("meta", b"b"))  # type: ignore[attr-defined]
            inside.set()
            assert release.wait(60)
            return first, (txn.get("info", b"a"), txn.get("meta", b"b"), [k for k, _ in txn.scan("meta")])  # type: ignore[attr-defined]

        seen: list[object] = []
        reader = threading.Thread(target=lambda: seen.append(engine.read(long_read)))
        reader.start()
        assert inside.wait(30)
        writer = threading.Thread(target=lambda: engine.write(
            lambda txn: (txn.put("info", b"a", b"2"), txn.put("meta", b"b", b"2"))))
        writer.start()
        writer.join(timeout=10)
        committed_meanwhile = not writer.is_alive()
        release.set()
        reader.join(30)
        writer.join(30)
        assert committed_meanwhile, "the commit waited for the read to end"
        # The read saw one commit throughout: neither half of the batch committed beside it.
        assert seen == [((b"1", None), (b"1", None, [b"a"]))]
        assert engine.read(lambda txn: (txn.get("info", b"a"), txn.get("meta", b"b"))) == (b"2", b"2")
    finally:
        engine.close()


def test_a_read_sees_one_commit_in_scans_begun_before_and_after_commits(tmp_path: Path) -> None:
    """Scans begun before a commit, after it, and two scans of one table
    interleaved (they share the iterator the commit froze) all read the
    tables as of the read's start."""
    engine = RocksDbEngine(tmp_path / "db", sync=False)
    keys = [bytes([i]) * 4 for i in range(1, 9)]
    try:
        engine.write(lambda txn: [txn.put(t, k, k) for t in ("meta", "lru") for k in keys])

        def commit(i: int) -> None:  # from another thread, as a put would; never waits for the read
            done = threading.Thread(target=lambda: engine.write(lambda txn: (
                txn.delete("meta", keys[i]), txn.put("meta", b"\x00" + keys[i], b"new"),
                txn.delete("lru", keys[i]), txn.put("lru", b"\xff" + keys[i], b"new"))))
            done.start()
            done.join(10)
            assert not done.is_alive(), "a commit waited for the read"

        def read(txn: object) -> dict[str, list[bytes]]:
            seen: dict[str, list[bytes]] = {"before": [], "after": [], "inner": []}
            spanning = txn.scan("meta")  # type: ignore[attr-defined]
            seen["before"].append(next(spanning)[0])
            commit(1)
            seen["before"] += [k for k, _ in spanning]
            commit(2)
            outer = txn.scan("lru")  # type: ignore[attr-defined]
            for key, _ in outer:  # an inner scan of the same table at every step
                seen["after"].append(key)
                seen["inner"] += [k for k, _ in txn.scan("lru", key[:1])]  # type: ignore[attr-defined]
            seen["gets"] = [txn.get("meta", k) for k in keys[:3]]  # type: ignore[attr-defined]
            return seen

        seen = engine.read(read)
        assert seen["before"] == keys and seen["after"] == keys and seen["inner"] == keys
        assert seen["gets"] == keys[:3]
        after = engine.read(lambda txn: [k for k, _ in txn.scan("meta")])
        assert after == [b"\x00" + keys[1], b"\x00" + keys[2]] + [k for k in keys if k not in keys[1:3]]
    finally:
        engine.close()


def test_reads_beside_a_stream_of_commits_never_see_half_of_one(tmp_path: Path) -> None:
    """Each commit moves a counter in two tables and adds a row to each;
    reader threads, whose reads span many commits, always find the tables
    agreeing with each other and with the counter."""
    engine = RocksDbEngine(tmp_path / "db", sync=False)
    stop = threading.Event()
    failures: list[str] = []

    def commit(n: int) -> None:
        engine.write(lambda txn: (txn.put("info", b"n", b"%d" % n), txn.put("meta", b"n", b"%d" % n),
                                  txn.put("info", b"row%06d" % n, b""), txn.put("meta", b"row%06d" % n, b"")))

    def read_spanning(txn: object) -> None:
        n = txn.get("info", b"n")  # type: ignore[attr-defined]
        time.sleep(0.002)  # commits land meanwhile
        rows = [k for k, _ in txn.scan("info", b"row")]  # type: ignore[attr-defined]
        time.sleep(0.002)
        meta_rows = [k for k, _ in txn.scan("meta", b"row")]  # type: ignore[attr-defined]
        m = txn.get("meta", b"n")  # type: ignore[attr-defined]
        if not (n == m and rows == meta_rows and len(rows) == (int(n) if n else 0)):
            failures.append(f"counter {n!r}/{m!r}, rows {len(rows)}/{len(meta_rows)}")

    def reader() -> None:
        while not stop.is_set():
            engine.read(read_spanning)

    readers = [threading.Thread(target=reader) for _ in range(4)]
    try:
        for thread in readers:
            thread.start()
        for n in range(1, 301):
            commit(n)
            time.sleep(0.001)
    finally:
        stop.set()
        for thread in readers:
            thread.join(30)
        engine.close()
    assert not failures, failures[:5]


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
def test_an_inventory_beside_a_writer_and_the_feed_after_it_are_the_store_exactly(tmp_path: Path, engine: str) -> None:
    """Whether a put waits for the walk is the deterministic test above (a commit beside a parked read) and
    `ucm-db bench inventory-stall`'s figure: a bound on put latency here failed on a loaded host (an LMDB
    put's group sync took 1 s). This test holds the walk's consistency with the feed under a writer."""
    with ucm_db.open(tmp_path / "s", engine=engine, capacity_bytes=4 << 30, durability="group") as store:
        # 1. A store of 30k evented blocks: an inventory walk of a few hundred ms.
        expected = {key for c in range(60) for key in _put_chain(store, c, CHAIN_BLOCKS)}

        # 2. A writer puts one-block chains and deletes every third of them, on and on.
        stop = threading.Event()
        puts: list[tuple[float, float]] = []
        changed: list[tuple[str, bytes]] = []
        errors: list[BaseException] = []

        def write() -> None:
            try:
                i = 0
                while not stop.is_set():
                    began = time.perf_counter()
                    (key,) = _put_chain(store, 10**6 + i, 1)
                    puts.append((began, time.perf_counter()))
                    changed.append(("stored", key))
                    if i % 3 == 2:
                        assert store.delete(NS, [key]) == 1
                        changed.append(("removed", key))
                    i += 1
                    time.sleep(0.001)
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
                errors.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            while len(puts) < 5 and writer.is_alive():
                time.sleep(0.01)
            # 3. The inventory, while the writer goes on.
            began = time.perf_counter()
            inventory = store.event_inventory(namespace=NS)
            ended = time.perf_counter()
        finally:
            stop.set()
            writer.join(60)
        assert not errors, errors
        walk_s = ended - began

        # 4. The writer went on across the walk (its changes are what the feed must add to the inventory).
        assert any(a <= ended for a, _ in puts) and any(b >= began for _, b in puts), f"no put beside the {walk_s:.3f} s walk"

        # 5. Inventory + the feed from its next_seq is the store: nothing missed, nothing twice.
        view = {record.key: record.fields.block_hash for record in inventory.records}
        assert len(view) == len(inventory.records) and set(view) >= expected
        seq = inventory.next_seq
        while True:
            batch = store.changes_since(seq, 4096, namespace=NS)
            assert not batch.resync
            for record in batch.records:
                if record.kind == "stored":
                    assert record.key not in view, "stored twice without a removal"
                    view[record.key] = record.fields.block_hash
                else:
                    assert view.pop(record.key) == record.fields.block_hash, "removed without being stored"
            if batch.next_seq == seq:
                break
            seq = batch.next_seq
        for kind, key in changed:
            (expected.add if kind == "stored" else expected.discard)(key)
        assert view == {key: _block_hash(key) for key in expected}
        assert store.lookup(NS, NS.block_keys([0] + list(range(4 * CHAIN_BLOCKS - 1)))) == CHAIN_BLOCKS
