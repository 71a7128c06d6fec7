"""KV cache events (connector/events.py): the scheduler half's take_events
with vLLM's own event classes and block hashes, saves written by a real
worker half, and removals by another process's store handle. No engine
(tests/vllm has the publisher test)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash  # noqa: E402

from ucm_db.connector.events import FeedEvents  # noqa: E402
from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402

init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


def _hashed_request(req_id: str, tokens: list[int], **kwargs: object):  # type: ignore[no-untyped-def]
    return _request(req_id, tokens, block_hasher=HASHER, **kwargs)


class Subscriber:
    """A router's view of STORAGE blocks, from vLLM events alone."""

    def __init__(self) -> None:
        self.blocks: dict[object, BlockStored] = {}

    def apply(self, events: list[object]) -> None:
        for event in events:
            # Never from ucm-db: it names no medium, so a router would drop the engine's own blocks too (issue 49).
            assert not isinstance(event, AllBlocksCleared)
            if isinstance(event, BlockStored):
                assert event.medium == MEDIUM_STORAGE
                for h in event.block_hashes:
                    self.blocks[h] = event
            elif isinstance(event, BlockRemoved):
                assert event.medium == MEDIUM_STORAGE
                for h in event.block_hashes:
                    del self.blocks[h]


def _engine(settings: ConnectorSettings) -> tuple[UcmDbScheduler, UcmDbWorker, FeedEvents]:
    sched = UcmDbScheduler(settings, _shape())
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    return sched, worker, FeedEvents(sched.store, namespace(_shape()))


def _save(sched: UcmDbScheduler, worker: UcmDbWorker, req, block_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, block_ids, req.num_tokens - req.num_computed_tokens))
    pickle.loads(pickle.dumps(meta))  # vLLM ships it to worker processes
    worker.save(meta)
    worker.drain()


@pytest.mark.parametrize("save_process", [False, True], ids=["in-worker", "save_process"])
def test_take_events_reports_saves_and_removals_by_anyone(tmp_path: Path, save_process: bool) -> None:
    """Saves committed by the worker or by its commit process (save_process) carry the same fields."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "save_process": save_process})
    sched, worker, events = _engine(settings)
    view = Subscriber()
    view.apply(list(events.take()))
    assert view.blocks == {} and events.take() == []  # nothing stored, nothing new

    tokens = list(range(1, 3 * BS + 5))  # 3 full blocks
    lora = LoRARequest("adapter", 7, "/nonexistent")
    req = _hashed_request("a", tokens, lora_request=lora)
    _save(sched, worker, req, [1, 2, 3, 4])
    stored = events.take()
    view.apply(stored)
    # vLLM's own hashes (as vLLM publishes them: ints by default), chained, with the request's tokens and LoRA.
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes[:3]]
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == hashes[0]
    assert stored[2].token_ids == tokens[2 * BS:3 * BS] and stored[2].block_size == BS
    assert (stored[0].lora_id, stored[0].lora_name, stored[0].group_idx) == (7, "adapter", 0)

    # Another process (a second engine, `ucm-db compact`...) deletes the chain's tail.
    ns = namespace(_shape())
    head0 = reader_spans(_shape())[0]  # the unit that carries the block's event fields
    unit_keys = UnitKeys(sched.keys_for(req, 3), grid(_shape()), head0)
    script = (
        "import sys, ucm_db\n"
        "with ucm_db.open(sys.argv[1]) as store:\n"
        "    assert store.delete(ucm_db.Namespace.from_dict(__import__('json').loads(sys.argv[2])), [bytes.fromhex(sys.argv[3])])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), json.dumps(ns.to_dict()), unit_keys[1].hex()],
                   check=True, timeout=120)
    removed = events.take()
    assert {type(e) for e in removed} == {BlockRemoved}
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes[1:3])
    view.apply(removed)
    assert set(view.blocks) == {hashes[0]}

    # A late subscriber (a restarted engine's first take) replays the inventory.
    late = Subscriber()
    late.apply(FeedEvents(sched.store, namespace(_shape())).take())
    assert set(late.blocks) == set(view.blocks)
    worker.shutdown()
    sched.shutdown()


def test_a_reader_behind_the_bound_resyncs(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker, events = _engine(settings)
    view = Subscriber()
    view.apply(events.take())
    _save(sched, worker, _hashed_request("first", [99] * (2 * BS + 1)), [1, 2, 3])
    view.apply(events.take())
    announced = set(view.blocks)
    assert len(announced) == 2
    sched.store._tier.feed_max_records = 2  # this process's writes trim the feed to 2 records
    for n in range(3):
        _save(sched, worker, _hashed_request(f"r{n}", [n + 100] * (2 * BS + 1)), [1, 2, 3])
    taken = events.take()
    # The resync withdraws exactly what was announced (storage tier only), then replays the inventory.
    assert isinstance(taken[0], BlockRemoved) and set(taken[0].block_hashes) == announced
    assert taken[0].medium == MEDIUM_STORAGE
    view.apply(taken)
    assert len(view.blocks) == 8 == len(sched.store.event_inventory().records)
    worker.shutdown()
    sched.shutdown()


def test_no_block_hashes_no_events(tmp_path: Path) -> None:
    """Prefix caching off (no vLLM hashes): blocks are stored, not evented."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker, events = _engine(settings)
    _save(sched, worker, _request("a", list(range(2 * BS + 1))), [1, 2, 3])
    assert sched.store.stats().blocks > 0 and events.take() == []
    worker.shutdown()
    sched.shutdown()
    assert torch is not None


def test_reset_cache_clears_and_reports_only_the_new_epoch(tmp_path: Path) -> None:
    """After reset_cache the old blocks are never served: they are removed
    (storage tier only), then only blocks saved at the new epoch appear."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker, _ = _engine(settings)
    events = FeedEvents(sched.store, namespace(_shape()), lambda: sched.epoch)
    view = Subscriber()
    tokens = list(range(1, 2 * BS + 2))
    req = _hashed_request("a", tokens)
    _save(sched, worker, req, [1, 2, 3])
    view.apply(events.take())
    assert len(view.blocks) == 2
    assert sched.reset_cache()
    taken = events.take()
    assert [type(e) for e in taken] == [BlockRemoved] and taken[0].medium == MEDIUM_STORAGE
    view.apply(taken)
    assert view.blocks == {}
    again = _hashed_request("b", tokens)  # the same prompt, saved again at the new epoch
    _save(sched, worker, again, [4, 5, 6])
    view.apply(events.take())
    assert set(view.blocks) == {maybe_convert_block_hash(h) for h in again.block_hashes[:2]}
    assert len(sched.store.event_inventory().records) == 4  # old-epoch blocks still stored, not reported
    worker.shutdown()
    sched.shutdown()


def test_a_large_inventory_replay_never_holds_a_step(tmp_path: Path) -> None:
    """The replay of 30k evented blocks (about 0.3 s of reading) is read in a
    thread: the first step gets none of it (it waits at most 50 ms), a later
    step gets all of it, once, and then the feed."""
    import time

    import ucm_db
    from ucm_db import BlockEventFields

    ns = ucm_db.Namespace(model="replay", kv_dtype="bfloat16", block_size=4)
    total, per_put = 30_000, 1000
    with ucm_db.open(tmp_path / "store", codec="none", capacity_bytes=1 << 30) as store:
        keys = ns.block_keys(list(range(4 * total)))
        for start in range(0, total, per_put):
            chunk = keys[start:start + per_put]
            fields = {k: BlockEventFields(k, keys[start + i - 1] if start + i else None, (1, 2, 3, 4), 4)
                      for i, k in enumerate(chunk)}
            store.put(ns, chunk, [b"kv"] * len(chunk), parent=keys[start - 1] if start else None, event_fields=fields)
        events = FeedEvents(store, ns)
        view = Subscriber()
        first = events.take()
        assert not any(isinstance(e, BlockStored) for e in first)  # the step did not wait for the whole replay
        deadline = time.monotonic() + 60
        while len(view.blocks) < total and time.monotonic() < deadline:
            view.apply(events.take())
            time.sleep(0.01)
        assert len(view.blocks) == total
        store.put(ns, ns.block_keys([7] * 4), [b"kv"], event_fields={ns.block_keys([7] * 4)[0]: BlockEventFields(b"h" * 32, None, (7,) * 4, 4)})
        later = events.take()
        assert [type(e) for e in later] == [BlockStored]  # then the feed, and no replayed block twice


def test_two_writer_processes_over_1000_operations_no_divergence(tmp_path: Path) -> None:
    """The issue's target, through this module's translation to vLLM events:
    two other processes make 1200 evented puts and deletes (evictions
    included) while take_events runs; the subscriber's view of STORAGE
    blocks equals the store's content."""
    import time

    import ucm_db
    from vllm.v1.core.kv_cache_utils import BlockHash

    from test_changefeed import _WORKER, NS, stored_hashes  # tests/ is on sys.path (its conftest)

    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 20, codec="none") as store:
        events, view = FeedEvents(store, NS), Subscriber()
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(path), str(seed), "600"]) for seed in (1, 2)]
        while any(p.poll() is None for p in procs):
            view.apply(events.take())
            time.sleep(0.01)
        assert [p.wait() for p in procs] == [0, 0]
        # The last records, and a replay (a resync's) still being read: taken
        # until a step brings nothing with no replay in flight, which is the
        # feed caught up now that nothing writes.
        deadline = time.monotonic() + 30
        while (taken := events.take()) or events._replaying is not None:
            view.apply(taken)
            assert time.monotonic() < deadline, "the feed never caught up with the stopped writers"
            time.sleep(0.01)
        assert store.stats().evictions > 100
        held = {maybe_convert_block_hash(BlockHash(h)) for h in stored_hashes(store).values()}
    assert len(held) > 10 and set(view.blocks) == held


@pytest.mark.timeout(120)
def test_a_damaged_feed_head_resyncs_take_once(tmp_path: Path) -> None:
    """Issue 46 finding 2: with first_seq > next_seq in the feed's head every
    read said resync and take() (each scheduler step) looped resync ->
    inventory -> resync, growing its list. Now a reader behind resyncs once,
    the next step has nothing new, and the next save re-establishes the head."""
    import struct

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker, events = _engine(settings)
    view = Subscriber()
    _save(sched, worker, _hashed_request("a", list(range(1, 2 * BS + 2))), [1, 2, 3])
    late = FeedEvents(sched.store, namespace(_shape()))
    view.apply(events.take())
    late._seq = 0  # a reader that fell behind: its next read starts at the first record
    late._epoch = 0

    def damage(txn) -> None:  # type: ignore[no-untyped-def]
        next_seq, _ = struct.unpack("<QQ", bytes(txn.get("info", b"feed-head")))
        txn.put("info", b"feed-head", struct.pack("<QQ", next_seq, next_seq + 5))
    sched.store._tier.engine.write(damage)

    assert events.take() == []  # caught up: nothing new, no resync
    taken = late.take()
    for _ in range(100):  # the inventory is read in a thread: a step waits for it 50 ms at most
        if len(taken) >= 2:
            break
        taken += late.take()
    assert [type(e) for e in taken] == [BlockStored] * 2  # it had announced nothing: nothing to withdraw
    assert late.take() == []
    _save(sched, worker, _hashed_request("b", [7] * (BS + 1)), [4, 5])
    for reader in (events, late):
        new = reader.take()
        assert [type(e) for e in new] == [BlockStored]
    view.apply(new)
    worker.shutdown()
    sched.shutdown()


def test_block_stored_carries_vllms_extra_keys(tmp_path: Path) -> None:
    """Issue 48: a router re-hashing a salted or LoRA request needs each
    block's extra keys, as vLLM's own BlockStored publishes them (LoRA name
    on every block, the cache salt on the first); the feed keeps them
    (record version 2), so the inventory replay carries them too."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker, events = _engine(settings)
    events.take()
    req = _hashed_request("s", list(range(1, 2 * BS + 5)), lora_request=LoRARequest("adapter", 7, "/nonexistent"),
                          cache_salt="tenant-a")
    _save(sched, worker, req, [1, 2, 3])
    stored = events.take()
    assert [e.extra_keys for e in stored] == [[("adapter", "tenant-a")], [("adapter",)]]
    replayed = [e for e in FeedEvents(sched.store, namespace(_shape())).take() if isinstance(e, BlockStored)]
    assert [e.extra_keys for e in replayed] == [[("adapter", "tenant-a")], [("adapter",)]]
    plain = _hashed_request("p", list(range(500, 500 + BS + 1)))
    _save(sched, worker, plain, [4, 5])
    assert [e.extra_keys for e in events.take()] == [None]  # nothing to key: version 1, as before
    worker.shutdown()
    sched.shutdown()
