"""The change feed (ucm_db.events, ucm_db.index.changefeed): evented puts and
removals logged in the change's own transaction, read from any process,
bounded, with a resync signal and an inventory replay."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, ChangeRecord, ConfigError, Namespace, maintenance
from ucm_db.index import changefeed

pytestmark = pytest.mark.usefixtures("feed_from_zero")  # the tests name seqs from 0

NS = Namespace(model="feed", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="feed-other", kv_dtype="bfloat16", block_size=4)


def fields_for(keys: Sequence[bytes], tokens: list[int], *, lora: str | None = None) -> dict[bytes, BlockEventFields]:
    """Event fields a connector would give: a made-up vLLM hash per block."""
    out = {}
    parent = None
    for i, key in enumerate(keys):
        block_hash = b"v" + key[:15]
        out[key] = BlockEventFields(block_hash, parent, tuple(tokens[4 * i:4 * i + 4]), 4, 7 if lora else None, lora, 0)
        parent = block_hash
    return out


class FeedView:
    """What a subscriber knows: vLLM hashes of stored blocks, built from
    the feed alone (resync: clear and replay the inventory)."""

    def __init__(self, store: ucm_db.Store, namespace: Namespace | None = None) -> None:
        self.store, self.namespace = store, namespace
        self.hashes: dict[bytes, object] = {}
        self.resyncs = 0
        self.seq = self._replay()

    def _replay(self) -> int:
        inventory = self.store.event_inventory(namespace=self.namespace)
        self.hashes = {r.key: r.fields.block_hash for r in inventory.records}
        return inventory.next_seq

    def catch_up(self) -> None:
        while True:
            batch = self.store.changes_since(self.seq, 256, namespace=self.namespace)
            if batch.resync:
                self.resyncs += 1
                self.seq = self._replay()
                continue
            for record in batch.records:
                self.apply(record)
            if batch.next_seq == self.seq:
                return
            self.seq = batch.next_seq

    def apply(self, record: ChangeRecord) -> None:
        if record.kind == "stored":
            assert record.key not in self.hashes, "stored twice without a removal"
            self.hashes[record.key] = record.fields.block_hash
        else:
            assert self.hashes.pop(record.key) == record.fields.block_hash


def stored_hashes(store: ucm_db.Store) -> dict[bytes, object]:
    """The store's content, from its block metadata: every block of these
    tests is evented, so its vLLM hash is the one the test gave."""
    return {key: b"v" + key[:15] for key in store._tier.scan_metas()}


def test_fields_round_trip_and_bad_input() -> None:
    for fields in (
        BlockEventFields(b"\x01" * 32, None, (1, 2, 3, 4), 4),
        BlockEventFields(-5, 2**63, tuple(range(16)), 16, 3, "adapter", 2),
    ):
        assert BlockEventFields.unpack(fields.pack()) == fields
    with pytest.raises(ConfigError, match="block_hash"):
        BlockEventFields("abc", None, (1,), 4).pack()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="out of range"):
        BlockEventFields(b"h", None, (-1,), 4).pack()
    with pytest.raises(ucm_db.CorruptBlockError):
        BlockEventFields.unpack(BlockEventFields(b"h", None, (1,), 4).pack()[:-1])


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_every_removal_is_logged_with_the_vllm_hash(tmp_path: Path, engine: str) -> None:
    if engine == "rocksdb":
        pytest.importorskip("rocksdict")
    with ucm_db.open(tmp_path / "s", engine=engine, capacity_bytes=1 << 20, codec="none") as store:
        view = FeedView(store)
        tokens = list(range(40))
        keys = NS.block_keys(tokens)
        store.put(NS, keys[:5], [b"a" * 100_000] * 5, event_fields=fields_for(keys[:5], tokens))
        view.catch_up()
        assert view.hashes == stored_hashes(store) and len(view.hashes) == 5
        # A plain put (no fields: warm, import) is stored but not evented.
        plain = OTHER.block_keys(tokens)
        store.put(OTHER, plain[:2], [b"p" * 100_000] * 2)
        view.catch_up()
        assert len(view.hashes) == 5
        # Deleting a block removes its descendants: each removal is logged.
        assert store.delete(NS, [keys[3]]) == 2
        view.catch_up()
        assert view.hashes == {k: h for k, h in stored_hashes(store).items() if k in set(keys)}
        # Eviction by capacity, then quarantine of a corrupt block.
        more: list[bytes] = []
        for chain in range(8):  # 8 chains of 2 blocks: older chains are evicted
            chain_tokens = [1000 + chain] * 8
            chain_keys = NS.block_keys(chain_tokens)
            store.put(NS, chain_keys, [b"b" * 100_000] * 2, event_fields=fields_for(chain_keys, chain_tokens))
            more += chain_keys
        store._tier.quarantine(more[-1], "test", lambda head, body: True)
        view.catch_up()
        evented = {k: h for k, h in stored_hashes(store).items() if k in set(keys) | set(more)}
        assert store.stats().evictions > 0
        assert view.hashes == evented
        assert {r.key for r in store.event_inventory(namespace=NS).records} == set(evented)


def test_a_reader_behind_the_bound_is_told_to_resync(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        store._tier.feed_max_records = 8
        view = FeedView(store)
        for n in range(6):
            tokens = [n] * 16
            keys = NS.block_keys(tokens)
            store.put(NS, keys, [b"x"] * 4, event_fields=fields_for(keys, tokens))
        batch = store.changes_since(view.seq)
        assert batch.resync and not batch.records
        assert store.changes_since(store.feed_position() + 5).resync  # ahead: another store at this path
        view.catch_up()
        assert view.resyncs == 1 and view.hashes == stored_hashes(store)
        assert store.feed_position() == 24
        assert len(store.changes_since(16).records) == 8  # the last 8 kept


def test_namespace_filter(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30) as store:
        for ns in (NS, OTHER):
            keys = ns.block_keys(list(range(8)))
            store.put(ns, keys, [b"x"] * 2, event_fields=fields_for(keys, list(range(8))))
        assert {r.namespace_id for r in store.changes_since(0, namespace=OTHER).records} == {OTHER.digest[:16]}
        assert len(store.changes_since(0).records) == 4
        assert len(store.event_inventory(namespace=NS).records) == 2


_WORKER = textwrap.dedent("""
    import random, sys, ucm_db
    from ucm_db import BlockEventFields, Namespace
    ns = Namespace(model="feed", kv_dtype="bfloat16", block_size=4)
    path, seed, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    store = ucm_db.open(path)
    done = 0
    while done < ops:
        tokens = [rng.randrange(6) for _ in range(4 * rng.randrange(1, 6))]
        keys = ns.block_keys(tokens)
        if rng.random() < 0.15:
            store.delete(ns, [keys[rng.randrange(len(keys))]])
        else:
            fields, parent = {}, None
            for i, key in enumerate(keys):
                h = b"v" + key[:15]
                fields[key] = BlockEventFields(h, parent, tuple(tokens[4 * i:4 * i + 4]), 4)
                parent = h
            try:
                store.put(ns, keys, [bytes([seed]) * 40_000] * len(keys), event_fields=fields)
            except ucm_db.MissingAncestorError:
                pass
        done += 1
    store.close()
""")


def test_two_processes_feed_view_equals_store(tmp_path: Path) -> None:
    """Two writer processes (>= 1000 operations with evictions and deletes)
    while this process follows the feed: its view equals the store's content."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 20, codec="none") as store:
        view = FeedView(store)
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(path), str(seed), "600"]) for seed in (1, 2)]
        while any(p.poll() is None for p in procs):
            view.catch_up()
        assert [p.wait() for p in procs] == [0, 0]
        view.catch_up()
        assert store.stats().evictions > 100
        assert view.hashes == stored_hashes(store)
        assert {r.key: r.fields.block_hash for r in store.event_inventory().records} == view.hashes
        assert store._tier.check() == []


def test_json_lines_equal_the_records_json(tmp_path: Path) -> None:
    """The CLI's fast formatter prints what ChangeRecord.to_json gives."""
    import json

    from ucm_db.events import json_line

    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30) as store:
        keys = NS.block_keys(list(range(12)))
        fields = fields_for(keys, list(range(12)), lora='quote"d')
        fields[keys[2]] = BlockEventFields(-(2**70), 2**63, (0, 2**32 - 1, 5, 6), 4, -1, None, 3)
        store.put(NS, keys, [b"x"] * 3, event_fields=fields)
        store.delete(NS, keys[1:2])
        records = store.changes_since(0).records + store.event_inventory().records
        assert len(records) == 6
        for record in records:
            line = json_line(record.seq, record.kind, record.namespace_id, record.key, record.fields.pack())
            assert json.loads(line) == record.to_json()


def test_compact_and_engine_conversion_keep_the_feed_true(tmp_path: Path) -> None:
    """`compact`'s evictions are logged; converting the engine copies the
    evented blocks' fields and the feed with the blocks."""
    from ucm_db import maintenance
    from ucm_db.maintenance import convert_engine as convert

    pytest.importorskip("rocksdict")

    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as store:
        for chain in range(4):
            tokens = [chain] * 8
            keys = NS.block_keys(tokens)
            store.put(NS, keys, [b"c" * 50_000] * 2, event_fields=fields_for(keys, tokens))
        seq = store.feed_position()
    maintenance.compact(path, target_bytes=200_000)
    with ucm_db.open(path) as store:
        removed = store.changes_since(seq).records
        assert removed and {r.kind for r in removed} == {"removed"}
        held = {r.key for r in store.event_inventory().records}
        assert held == set(store._tier.scan_metas()) and len(held) < 8
        position = store.feed_position()
    convert(path, tmp_path / "r", "rocksdb")
    with ucm_db.open(tmp_path / "r") as converted:
        assert {r.key for r in converted.event_inventory().records} == held
        assert converted.feed_position() == position


def test_malformed_feed_and_fields_records_are_skipped_not_raised(tmp_path: Path) -> None:
    """A damaged page under the feed (a short record, a flipped kind byte, a
    short fields record) is skipped by every reader: never a raw struct.error
    or KeyError into a scheduler step or the CLI."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        tokens = list(range(12))
        keys = NS.block_keys(tokens)
        store.put(NS, keys, [b"x" * 10] * 3, event_fields=fields_for(keys, tokens))
        store._tier.info_put(b"evf/" + keys[1], b"short")
        first = bytes(store._tier.info_get(b"feed/" + (0).to_bytes(8, "big")) or b"")
        store._tier.info_put(b"feed/" + (0).to_bytes(8, "big"), b"\x07" + first[1:])
        store._tier.info_put(b"feed/" + (1).to_bytes(8, "big"), first[:30])
        assert {r.key for r in store.event_inventory().records} == {keys[0], keys[2]}
        assert [r.seq for r in store.changes_since(0).records] == [2]
    assert len(list(maintenance.iter_events(tmp_path / "s", since_seq=0))) == 1  # the CLI's reader too


# -- issue 46, finding 2: a damaged feed head ----------------------------------
_HEAD = b"feed-head"
_HEAD_SUM = b"sum:feed-head"


def _evented_put(store: ucm_db.Store, first_token: int, blocks: int) -> list[bytes]:
    tokens = list(range(first_token, first_token + 4 * blocks))
    keys = NS.block_keys(tokens)
    store.put(NS, keys, [b"e" * 64] * blocks, event_fields=fields_for(keys, tokens))
    return keys


def _damage_head(store: ucm_db.Store, *, next_seq: int | None = None, first_seq: int | None = None,
                 legacy: bool = False) -> None:
    """Rewrites the head's fields below the Store, through the engine's own
    transaction (a flipped bit: its checksum sidecar, if any, is left as it
    was); ``legacy``: without a sidecar, as code before checksums left it."""
    def run(txn) -> None:  # type: ignore[no-untyped-def]
        old_next, old_first = struct.unpack("<QQ", bytes(txn.get("info", _HEAD)))
        txn.put("info", _HEAD, struct.pack("<QQ", old_next if next_seq is None else next_seq,
                                           old_first if first_seq is None else first_seq))
        if legacy:
            txn.delete("info", _HEAD_SUM)
    store._tier.engine.write(run)


_PUT_IN_ANOTHER_PROCESS = textwrap.dedent("""
    import sys, ucm_db
    from ucm_db import BlockEventFields, Namespace
    ns = Namespace(model="feed", kv_dtype="bfloat16", block_size=4)
    tokens = [9000 + i for i in range(8)]
    keys = ns.block_keys(tokens)
    fields = {k: BlockEventFields(b"v" + k[:15], None, tuple(tokens[4 * i:4 * i + 4]), 4) for i, k in enumerate(keys)}
    with ucm_db.open(sys.argv[1]) as store:
        store.put(ns, keys, [b"o" * 64] * 2, event_fields=fields)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("legacy", [False, True], ids=["checksummed", "legacy"])
def test_a_high_bit_in_next_seq_never_wedges_a_writer(tmp_path: Path, legacy: bool) -> None:
    """next_seq with its high bit set made the trim loop run 2**63 times
    inside the put's write transaction: the put never returned and held
    the write lock (another process's put timed out too). Now a damaged
    head is rebuilt from the records the feed holds, in the put itself."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as store:
        _evented_put(store, 0, 3)
        view = FeedView(store)
        assert view.seq == 3
        _damage_head(store, next_seq=3 | (1 << 63), legacy=legacy)
    # Another process's put returns within seconds (the lock is not held).
    subprocess.run([sys.executable, "-c", _PUT_IN_ANOTHER_PROCESS, str(path)], check=True, timeout=60)
    with ucm_db.open(path, capacity_bytes=1 << 30, codec="none") as store:
        started = time.monotonic()
        _evented_put(store, 500, 2)
        assert time.monotonic() - started < 5
        # The head continues after the last record the feed held: nothing handed out is reused.
        assert store.feed_position() == 7
        view.store = store
        view.catch_up()  # the reader was caught up: it reads on without a resync
        assert view.resyncs == 0 and view.hashes == stored_hashes(store)
    assert not maintenance.verify(path).problems


@pytest.mark.timeout(60)
@pytest.mark.parametrize("legacy", [False, True], ids=["checksummed", "legacy"])
def test_first_seq_above_next_seq_resyncs_a_reader_once(tmp_path: Path, legacy: bool) -> None:
    """first_seq > next_seq made every read a resync, and the inventory's
    own seq another: FeedEvents.take() (each scheduler step) looped for
    ever. Now a reader behind resyncs once; one at the end reads on."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        _evented_put(store, 0, 3)
        behind, caught_up = FeedView(store), FeedView(store)
        behind.seq = 1
        _damage_head(store, first_seq=3 + 5, legacy=legacy)
        behind.catch_up()
        caught_up.catch_up()
        assert (behind.resyncs, caught_up.resyncs) == (1, 0)
        assert behind.hashes == caught_up.hashes == stored_hashes(store)
    assert len(list(maintenance.iter_events(tmp_path / "s", since_seq=0))) == 4  # cleared + 3 blocks, then it ends
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        behind.store = caught_up.store = store
        _evented_put(store, 100, 2)  # the next evented write re-establishes a sound head
        assert store._tier.engine.read(lambda txn: changefeed.head_problem(txn)) is None
        for view in (behind, caught_up):
            view.catch_up()
            assert view.hashes == stored_hashes(store) and len(view.hashes) == 5
        assert (behind.resyncs, caught_up.resyncs) == (1, 0)


def test_a_legacy_head_is_used_as_it_is_and_sealed_by_the_next_write(tmp_path: Path) -> None:
    """Stores of older code have a head without checksum: it is trusted
    while it is sound, and the next evented write seals it."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        _evented_put(store, 0, 3)
        view = FeedView(store)
        _damage_head(store, legacy=True)  # the same head, no sidecar
        assert store._tier.info_get(_HEAD_SUM) is None
        _evented_put(store, 100, 1)
        view.catch_up()
        assert view.resyncs == 0 and len(view.hashes) == 4 and store.feed_position() == 4
        assert store._tier.info_get(_HEAD_SUM) is not None
        assert store._tier.engine.read(lambda txn: changefeed.head_problem(txn)) is None
    assert not maintenance.verify(tmp_path / "s").problems


def test_the_inventory_never_announces_a_block_that_is_not_stored(tmp_path: Path) -> None:
    """Finding 8: an event fields record left for a block that is not
    stored (a damaged page, a torn removal) made the inventory announce a
    phantom BlockStored."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, codec="none") as store:
        keys = _evented_put(store, 0, 2)
        phantom = bytes(32 - len(b"ghost")) + b"ghost"
        store._tier.info_put(b"evf/" + phantom, store._tier.info_get(b"evf/" + keys[1]) or b"")
        assert {r.key for r in store.event_inventory().records} == set(keys)
    assert {e["key"] for e in maintenance.iter_events(tmp_path / "s")} == {k.hex() for k in keys}
