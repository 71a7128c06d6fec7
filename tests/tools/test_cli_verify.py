"""`ucm-db verify` finds exactly the blocks a test corrupted; --fix
quarantines them (with descendants); without --fix nothing is written."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import BlockEventFields
from ucm_db.migrations.access import open_engine

from cli_stores import NS_A, invoke, invoke_json, make_store


def corrupt(path: Path, keys: list[bytes], *, offset: int = -5) -> None:
    """Flips one byte of each stored blob (length unchanged)."""
    engine = open_engine(path)
    try:
        def run(txn: object) -> None:
            for key in keys:
                blob = bytearray(txn.get("blocks", key))  # type: ignore[attr-defined]
                blob[offset] ^= 0x40
                txn.put("blocks", key, bytes(blob))  # type: ignore[attr-defined]
        engine.write(run)
    finally:
        engine.close()


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_verify_finds_exactly_the_corrupted_blocks(tmp_path: Path, engine: str) -> None:
    chains = make_store(tmp_path / "s", engine=engine)
    bad = [chains["a1"][4], chains["a2"][1], chains["b0"][0]]
    assert invoke_json("verify", tmp_path / "s")["corrupt"] == []
    corrupt(tmp_path / "s", bad[:2])
    corrupt(tmp_path / "s", bad[2:], offset=40)  # inside the header: the owning key

    r = invoke_json("verify", tmp_path / "s", expect=1)
    assert r["checked"] == 23
    assert sorted(c["key"] for c in r["corrupt"]) == sorted(k.hex() for k in bad)
    assert r["index_problems"] == [] and r["quarantined_blocks"] == 0
    text = invoke("verify", tmp_path / "s", expect=1).stdout
    assert "3 corrupt" in text and "--fix" in text

    with ucm_db.open(tmp_path / "s") as store:  # verify wrote nothing: still there
        assert store.stats().blocks == 23 and store.stats().quarantined == 0


def test_verify_fix_quarantines_corrupt_blocks_and_descendants(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "s")
    corrupt(tmp_path / "s", [chains["a1"][3]])
    r = invoke_json("verify", tmp_path / "s", "--fix", expect=1)
    assert [c["key"] for c in r["corrupt"]] == [chains["a1"][3].hex()]
    assert r["quarantined_blocks"] == 2  # the block and its one descendant
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS_A, chains["a1"]) == 3
        assert chains["a1"][3] in store._tier.quarantine_records()
    assert invoke_json("verify", tmp_path / "s")["checked"] == 21


def test_verify_sample_checks_that_many(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    r = invoke_json("verify", tmp_path / "s", "--sample", 5)
    assert r["checked"] == 5 and r["corrupt"] == []


# -- issue 46, findings 2 and 8: the change feed ---------------------------------
def put_evented(path: Path, blocks: int = 3) -> list[bytes]:
    tokens = list(range(blocks * NS_A.block_size))
    keys = NS_A.block_keys(tokens)
    fields, parent = {}, None
    for i, key in enumerate(keys):
        fields[key] = BlockEventFields(key[:8], parent, tuple(tokens[i * 16:(i + 1) * 16]), 16)
        parent = key[:8]
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS_A, keys, [b"x" * 64] * blocks, event_fields=fields)
    return keys


def edit_info(path: Path, change: Callable[[Any], None]) -> None:
    """Writes damage through the engine's own transaction, below the Store."""
    engine = open_engine(path)
    try:
        engine.write(change)
    finally:
        engine.close()


def feed_name(seq: int) -> bytes:
    return b"feed/" + seq.to_bytes(8, "big")


def feed_problems(report: dict[str, Any]) -> list[str]:
    return [p for p in report["index_problems"] if p.startswith("change feed")]


def events_since_0(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in invoke("events", path, "--since", 0).stdout.splitlines()]


@pytest.mark.usefixtures("feed_from_zero")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", [(1 << 63 | 3, None), (None, 7)], ids=["high-bit-next", "first-above-next"])
def test_verify_names_a_damaged_feed_head_and_fix_rebuilds_it(tmp_path: Path, damage: tuple[int | None, int | None]) -> None:
    path = tmp_path / "s"
    put_evented(path)

    def run(txn: Any) -> None:
        next_seq, first_seq = struct.unpack("<QQ", bytes(txn.get("info", b"feed-head")))
        txn.put("info", b"feed-head", struct.pack("<QQ", damage[0] if damage[0] is not None else next_seq,
                                                  damage[1] if damage[1] is not None else first_seq))
    edit_info(path, run)

    r = invoke_json("verify", path, expect=1)
    assert [p for p in feed_problems(r) if "head" in p], r["index_problems"]
    assert "change feed" in invoke("verify", path, expect=1).stdout
    fixed = invoke_json("verify", path, "--fix", expect=1)
    assert fixed["feed_repaired"]
    assert invoke_json("verify", path)["index_problems"] == []
    # The rebuilt head goes on after the records the feed holds.
    assert [e["seq"] for e in events_since_0(path)] == [0, 1, 2]


@pytest.mark.usefixtures("feed_from_zero")
def test_verify_names_malformed_feed_records_and_fix_drops_them(tmp_path: Path) -> None:
    """A truncated record, an unknown kind, undecodable fields: skipped
    by the readers (logged), named by verify, dropped by --fix."""
    path = tmp_path / "s"
    keys = put_evented(path)

    def run(txn: Any) -> None:
        records = [bytes(txn.get("info", feed_name(seq))) for seq in range(3)]
        txn.put("info", feed_name(0), records[0][:-1])  # the fields cut short
        txn.put("info", feed_name(1), records[1][:30])  # cut inside the key
        txn.put("info", feed_name(2), b"\x07" + records[2][1:])  # no such kind
    edit_info(path, run)

    r = invoke_json("verify", path, expect=1)
    named = feed_problems(r)
    assert len(named) == 3 and all(f"record {seq}" in p for seq, p in zip(range(3), named)), named
    assert invoke_json("verify", path, "--fix", expect=1)["feed_repaired"]
    assert invoke_json("verify", path)["index_problems"] == []
    with ucm_db.open(path) as store:
        # Followers start over from the inventory: every seq they held is before the new sequence.
        assert store.changes_since(3).resync
        assert {r.key for r in store.event_inventory().records} == set(keys)


@pytest.mark.usefixtures("feed_from_zero")
def test_verify_names_event_records_of_blocks_not_stored_and_fix_drops_them(tmp_path: Path) -> None:
    """An event fields record of a block not stored (the inventory would
    announce a phantom BlockStored) and a feed record whose block is not
    stored and never logged as removed."""
    path = tmp_path / "s"
    keys = put_evented(path)
    ghost, altered = b"\x01" * 32, b"\x02" * 32

    def run(txn: Any) -> None:
        txn.put("info", b"evf/" + ghost, bytes(txn.get("info", b"evf/" + keys[0])))
        record = bytes(txn.get("info", feed_name(2)))
        txn.put("info", feed_name(2), record[:17] + altered + record[49:])  # a flipped key
    edit_info(path, run)

    r = invoke_json("verify", path, expect=1)
    named = feed_problems(r)
    assert len(named) == 2 and ghost.hex()[:16] in named[0] + named[1] and altered.hex()[:16] in named[0] + named[1]
    assert {json.loads(line)["key"] for line in invoke("events", path).stdout.splitlines()} == {k.hex() for k in keys}
    assert invoke_json("verify", path, "--fix", expect=1)["feed_repaired"]
    assert invoke_json("verify", path)["index_problems"] == []
    with ucm_db.open(path) as store:
        assert {r.key for r in store.event_inventory().records} == set(keys)
        assert store.stats().blocks == 3
