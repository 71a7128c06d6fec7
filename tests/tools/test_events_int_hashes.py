"""``ucm-db events --int-hashes`` prints bytes block hashes as vLLM's live
events give them under its default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
(the hash read big-endian, its low 64 bits), so a router matches the
store's lines with the engines' without converting; without the flag the
lines keep the hex form, and int hashes stay ints either way."""

from __future__ import annotations

import json
from pathlib import Path

import ucm_db
from ucm_db import BlockEventFields, Namespace
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from cli_stores import invoke

NS = Namespace(model="events/int-hashes", kv_dtype="bfloat16", block_size=4)


def _make(path: Path) -> tuple[list[bytes], list[bytes | int]]:
    tokens = list(range(12))
    keys = NS.block_keys(tokens)
    hashes: list[bytes | int] = [bytes([0xA0 + i]) * 32 for i in range(2)] + [7]  # vLLM's bytes hashes, and one int
    fields, parent = {}, None
    for i, key in enumerate(keys):
        fields[key] = BlockEventFields(hashes[i], parent, tuple(tokens[4 * i:4 * i + 4]), 4, None, None, 0)
        parent = hashes[i]
    with ucm_db.open(path, codec="none", capacity_bytes=4 << 20) as store:
        store.put(NS, keys, [b"x" * 64] * len(keys), event_fields=fields)
    return list(keys), hashes


def _lines(path: Path, *flags: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in invoke("events", path, *flags).stdout.splitlines()]


def test_int_hashes_are_vllms_conversion_of_the_stored_hashes(tmp_path: Path, monkeypatch) -> None:
    _, hashes = _make(tmp_path / "s")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    expected = [maybe_convert_block_hash(h) if isinstance(h, bytes) else h for h in hashes]
    as_ints = _lines(tmp_path / "s", "--int-hashes")
    assert [e["block_hashes"] for e in as_ints] == [[h] for h in expected]
    assert [e["parent_block_hash"] for e in as_ints] == [None, *expected[:-1]]
    plain = _lines(tmp_path / "s")
    assert [e["block_hashes"] for e in plain] == [[hashes[0].hex()], [hashes[1].hex()], [7]]  # type: ignore[union-attr]
    for a, b in zip(as_ints, plain):  # nothing else changes
        assert {k: v for k, v in a.items() if k not in ("block_hashes", "parent_block_hash")} == \
               {k: v for k, v in b.items() if k not in ("block_hashes", "parent_block_hash")}
