"""The routers' presence query (issue 49 item 4): ``Store.lookup_many``
answers many chains from one read transaction of the local tier, as
``lookup`` would one by one; for a store of units, in whole-model units
(every KV head), as the connector counts a hit; it writes and touches
nothing."""

from __future__ import annotations

import json

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace
from ucm_db.keys.units import KVGrid, UnitKeys, stored_prefix
from ucm_db.store.presence import whole_model_units

NS = Namespace(model="presence", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="presence-other", kv_dtype="bfloat16", block_size=4)
#: A namespace as the vLLM connector builds it: its layout names the whole model's KV heads and layers.
UNITS_NS = Namespace(model="presence-units", kv_dtype="bfloat16", block_size=4, layout=json.dumps(
    {"platform": "cpu", "spec": "FullAttentionSpec", "layers": 2, "kv_heads": 4, "head_size": 8, "cache_dtype": "auto"},
    sort_keys=True, separators=(",", ":")))


def chain(ns: Namespace, seed: int, blocks: int) -> ucm_db.BlockKeys:
    return ns.block_keys([seed * 10_000 + t for t in range(4 * blocks)])


@pytest.fixture(params=["lmdb", "rocksdb", "memory"])
def store(tmp_path, request):
    with ucm_db.open(tmp_path / "s", codec="none", engine=request.param) as s:
        yield s


def test_lookup_many_answers_as_lookup_does_chain_by_chain(store) -> None:
    chains = [chain(NS, i, 1 + i % 9) for i in range(40)]
    for i, keys in enumerate(chains):
        stored = [len(keys), 0, len(keys) // 2, 1][i % 4]
        if stored:
            store.put(NS, keys[:stored], [b"x" * 64] * stored)
    foreign = chain(OTHER, 99, 5)
    store.put(OTHER, foreign, [b"y" * 64] * 5)
    asked = [*chains, [], foreign, chain(NS, 500, 64)]
    expected = [store.lookup(NS, keys, remote=False) for keys in asked]
    assert store.lookup_many(NS, asked) == expected
    assert expected[-3:] == [0, 0, 0]  # empty, another namespace's keys, nothing stored
    assert sum(expected) == sum([len(k), 0, len(k) // 2, 1][i % 4] for i, k in enumerate(chains))


def test_lookup_many_takes_one_read_transaction_whatever_the_chains(store) -> None:
    for i in range(20):
        store.put(NS, chain(NS, i, 8), [b"x"] * 8)
    reads = []
    engine = store._engine
    real = engine.read

    def counted(fn):
        reads.append(fn)
        return real(fn)

    engine.read = counted
    try:
        store.lookup_many(NS, [chain(NS, i, 8)[: 1 + i % 8] for i in range(20)])
        few = len(reads)
        reads.clear()
        store.lookup_many(NS, [chain(NS, i % 20, 8) for i in range(500)])
    finally:
        del engine.read
    # The chains' one read, and the epoch check's where the gate has not seen the namespace within a second.
    assert len(reads) <= 2 and few <= 2


def test_lookup_many_writes_and_touches_nothing(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 20) as store:
        old, new = chain(NS, 1, 2), chain(NS, 2, 2)
        store.put(NS, old, [bytes(200_000)] * 2)
        store.put(NS, new, [bytes(200_000)] * 2)
        before = store.stats()
        for _ in range(3):
            assert store.lookup_many(NS, [old, new]) == [2, 2]
        store.flush()
        after = store.stats()
        assert (after.hits, after.misses) == (before.hits, before.misses)
        store.put(NS, chain(NS, 3, 2), [bytes(200_000)] * 2)  # needs room: the least recently used goes
        assert store.lookup_many(NS, [old, new]) == [1, 2]  # old's tail went: probing it did not make it recent


def test_units_count_a_block_only_when_every_head_is_stored(store) -> None:
    grid, spans = whole_model_units(UNITS_NS)
    assert grid == KVGrid(4, 2) and len(spans) == 4
    prompts = [chain(UNITS_NS, i, 12) for i in range(6)]
    for i, keys in enumerate(prompts):
        for h, span in enumerate(spans):
            stored = [12, 12, 7, 0, 12, 3][i] if h != 2 else [12, 5, 7, 0, 0, 3][i]  # head 2 lags on some
            units = UnitKeys(keys, grid, span, 0, stored)
            if stored:
                store.put(UNITS_NS, ucm_db.BlockKeys(list(units), parent=None), [b"u" * 32] * stored)
    counts = store.lookup_many(UNITS_NS, prompts, grid=grid, spans=spans)
    assert counts == [12, 5, 7, 0, 0, 3]
    assert counts == [stored_prefix(store, UNITS_NS, grid, spans, keys) for keys in prompts]
    assert store.lookup_many(UNITS_NS, prompts) == [0] * 6  # block keys themselves: none stored


def test_units_whose_first_head_lags_are_searched_too(store) -> None:
    """lookup_many probes the first head's last unit first: a chain whose
    first head holds less than the others, none, or a chain with no blocks
    still gets stored_prefix's answer."""
    grid, spans = whole_model_units(UNITS_NS)
    prompts = [chain(UNITS_NS, 100 + i, 9) for i in range(4)]
    for i, keys in enumerate(prompts):
        for h, span in enumerate(spans):
            stored = [4, 0, 9, 1][i] if h == 0 else [9, 9, 9, 0][i]
            if stored:
                units = UnitKeys(keys, grid, span, 0, stored)
                store.put(UNITS_NS, ucm_db.BlockKeys(list(units), parent=None), [b"u" * 32] * stored)
    asked = [*prompts, ucm_db.BlockKeys([], parent=None)]
    counts = store.lookup_many(UNITS_NS, asked, grid=grid, spans=spans)
    assert counts == [4, 0, 9, 0, 0]
    assert counts[:4] == [stored_prefix(store, UNITS_NS, grid, spans, keys) for keys in prompts]


def test_whole_model_units_reads_the_connector_layout() -> None:
    grid, spans = whole_model_units(UNITS_NS, [1, 1])
    assert len(spans) == 8 and {(s.layer_start, s.layer_stop) for s in spans} == {(0, 1), (1, 2)}
    assert whole_model_units(NS) is None  # no layout descriptor: whole blocks
    mla = Namespace(model="m", kv_dtype="bfloat16", block_size=4, layout=json.dumps({"kv_heads": 1, "layers": 3}))
    assert whole_model_units(mla) is None  # one head, one stage: the unit is the block
    assert whole_model_units(mla, [1, 2]) is not None
    per_rank = Namespace(model="m", kv_dtype="bfloat16", block_size=4, tp_rank=1, tp_size=2, layout=UNITS_NS.layout)
    assert whole_model_units(per_rank) is None  # a per-rank namespace from before units
    with pytest.raises(ConfigError, match="does not split"):
        whole_model_units(UNITS_NS, [1, 2])


def test_bad_input_is_a_config_error(store) -> None:
    keys = chain(NS, 1, 3)
    store.put(NS, keys, [b"x"] * 3)
    with pytest.raises(ConfigError, match="list of key chains"):
        store.lookup_many(NS, keys)  # a flat chain: wrap it
    with pytest.raises(ConfigError, match="32-byte"):
        store.lookup_many(NS, [[keys[0], b"short"]])
    with pytest.raises(ConfigError, match="together"):
        store.lookup_many(NS, [keys], grid=KVGrid(2, 1))
    with pytest.raises(ConfigError, match="Namespace"):
        store.lookup_many("ns", [keys])  # type: ignore[arg-type]


def test_a_namespace_whose_epoch_is_unknown_reads_as_zeros(tmp_path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        keys = chain(NS, 1, 3)
        store.put(NS, keys, [b"x"] * 3)
        store._engine.write(lambda txn: txn.put("info", b"epoch:" + NS.digest[:16], b"garbage!"))  # checksum fails
        assert store.lookup_many(NS, [keys, keys[:1]]) == [0, 0]


def test_pin_takes_units_as_lookup_many_does(store) -> None:
    grid, spans = whole_model_units(UNITS_NS)
    keys = chain(UNITS_NS, 7, 10)
    for h, span in enumerate(spans):
        stored = 10 if h else 6
        store.put(UNITS_NS, ucm_db.BlockKeys(list(UnitKeys(keys, grid, span, 0, stored)), parent=None), [b"u" * 32] * stored)
    report = store.pin(UNITS_NS, keys, grid=grid, spans=spans)
    assert report.chains == (6,) and report.changed_blocks == 36  # 6 + 3 x 10 units
    released = store.unpin(UNITS_NS, [keys], grid=grid, spans=spans)
    assert released.chains == (0,) and released.namespace_blocks == 0
    with pytest.raises(ConfigError, match="together"):
        store.pin(UNITS_NS, keys, spans=spans)
