"""docs/tp.md's promises, on real LMDB stores: the unit key formula, the
whole grid keyed by the block key, which rank holds and writes which heads,
a unit stored once, a hit that needs every unit (one binary search and a
probe per further head, free of side effects), and a unit header's size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db.keys.units import KVGrid, UnitKeys, UnitSpan, head_range, stored_prefix, unit_key, writes_heads

ROOT = Path(__file__).resolve().parents[1]
TP = (ROOT / "docs" / "tp.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_unit_keys_are_the_documented_blake2b_and_the_whole_grid_is_the_block_key() -> None:
    assert '`unit_key = BLAKE2b-256(block_key || "h{a}:{b}/l{c}:{d}", person="ucm-db/unit")`' in TP
    grid, block = KVGrid(heads=8, layers=32), bytes(range(32))
    for a, b, c, d in [(0, 1, 0, 32), (3, 4, 0, 16), (2, 4, 16, 32)]:
        expected = hashlib.blake2b(block + f"h{a}:{b}/l{c}:{d}".encode(), digest_size=32, person=b"ucm-db/unit").digest()
        assert unit_key(block, UnitSpan(a, b, c, d), grid) == expected
    assert unit_key(block, grid.whole, grid) == block  # "A unit covering the whole grid ... is keyed by the block key itself"
    assert unit_key(block, UnitSpan(0, 1, 0, 1), KVGrid(1, 1)) == block


def test_which_rank_holds_and_writes_which_heads() -> None:
    """Invariant 1: rank r holds ``[r*H/tp, (r+1)*H/tp)``; with tp > H head h
    is on ranks ``h*tp/H ... (h+1)*tp/H - 1`` and only the first writes it."""
    for heads in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8, 16):
            writers: dict[int, list[int]] = {}
            for rank in range(tp):
                start, stop = head_range(heads, tp, rank)
                if tp <= heads:
                    assert (start, stop) == (rank * heads // tp, (rank + 1) * heads // tp)
                else:
                    assert rank in range(start * tp // heads, (start + 1) * tp // heads) and stop == start + 1
                if writes_heads(heads, tp, rank):
                    for head in range(start, stop):
                        writers.setdefault(head, []).append(rank)
            assert writers == {h: [h * tp // heads if tp > heads else h * tp // heads] for h in range(heads)}, (heads, tp)


def test_a_hit_needs_every_unit_and_units_are_stored_once(tmp_path: Path) -> None:
    """Invariants 2, 4 and 5 on a real LMDB store: a unit put twice is
    stored once; a block counts only where every head's unit is stored;
    each span's chain keeps the prefix invariant."""
    ns = ucm_db.Namespace(model="audit/tp", kv_dtype="bfloat16", block_size=4)
    grid = KVGrid(heads=4, layers=2)
    spans = grid.head_spans()
    keys = ns.block_keys(list(range(40)))
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        for span in spans:
            chain = UnitKeys(keys, grid, span, 0, 10 if span.head_start != 2 else 6)
            assert chain[1:3].parent() == chain[0] and chain.parent() is None  # unit_key(k[i], h)'s parent is unit_key(k[i-1], h)
            store.put(ns, list(chain), [bytes([span.head_start]) * 1024] * len(chain), parent=None)
        before = store.stats().to_dict()["blocks"]
        again = UnitKeys(keys, grid, spans[0], 0, 10)
        assert store.put(ns, list(again), [b"other"] * 10, parent=None).stored == 0  # "finds each unit present and skips it"
        assert store.stats().to_dict()["blocks"] == before == 36
        assert stored_prefix(store, ns, grid, spans, keys) == 6  # head 2 holds 6 blocks: the hit is 6
        assert stored_prefix(store, ns, grid, spans[:2], keys) == 10
        assert store.lookup_many(ns, [keys], grid=grid, spans=spans) == [6]  # fleet.md: the same definition of a hit


class _CountingStore:
    """Delegates to a real store, counting ``lookup`` calls and the keys each is given (tp.md's read count)."""

    def __init__(self, store: ucm_db.Store) -> None:
        self.store, self.calls = store, []  # type: ignore[var-annotated]

    def lookup(self, namespace: ucm_db.Namespace, keys: Any) -> int:
        self.calls.append(len(keys))
        return self.store.lookup(namespace, keys)


def test_a_lookup_of_every_head_is_one_search_and_a_probe_per_further_head(tmp_path: Path) -> None:
    """tp.md, invariant 5: "a binary search on head 0's chain gives n; for
    each further head, one probe of its unit of block n-1"; "Lookups stay
    free of side effects on the store"."""
    ns = ucm_db.Namespace(model="audit/tp-reads", kv_dtype="bfloat16", block_size=1)
    grid = KVGrid(heads=8, layers=1)
    keys = ns.block_keys(list(range(300)))
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20, codec="none") as store:
        for span in grid.head_spans():
            store.put(ns, list(UnitKeys(keys, grid, span, 0, 200)), [b"u" * 64] * 200, parent=None)
        store.flush()
        before = store.stats().to_dict()["namespaces"]
        counting = _CountingStore(store)
        assert stored_prefix(counting, ns, grid, grid.head_spans(), keys) == 200
        assert counting.calls == [300] + [1] * 7
        assert store.stats().to_dict()["namespaces"] == before


def test_a_unit_header_is_as_large_as_the_costs_say() -> None:
    """"H headers (68 bytes and 24 per frame: about 100 bytes with `zstd`
    ...; 836 bytes for 32 layers with codec `none`)": a Llama-3-8B unit
    (32 layers of 8 KiB) as the store encodes it."""
    import numpy as np

    from ucm_db import codec
    from ucm_db.codec.header import head_bytes

    assert "(68 bytes and 24 per frame: about 100 bytes with `zstd`" in _flat(TP) and "836 bytes for 32 layers" in _flat(TP)
    layers = np.random.default_rng(0).integers(0, 255, 32 * 8192, dtype=np.uint8).tobytes()
    sizes = {name: head_bytes(codec.encode(bytes(32), ucm_db.Framed(layers, (8192,) * 32), codec=name)) for name in ("zstd", "none")}
    assert sizes["none"] == 68 + 24 * 32 == 836 and sizes["zstd"] <= 100
    assert sizes["zstd"] / (256 << 10) < 0.001 and sizes["none"] / (256 << 10) < 0.0035  # "under 0.1% (0.3% with codec `none`)"
