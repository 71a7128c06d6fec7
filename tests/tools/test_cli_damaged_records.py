"""Damaged block records (issue 26, items 4, 7 and 17): a record whose sizes
no block can have, a record cut short, an altered namespace id, a lost
child link, a missing parent, a missing LRU entry. Each is named by
`ucm-db verify` (exit 1), repaired by `verify --fix` (or compact), and never
summed into totals, never wedges a write, never makes lookup over-claim.

The damage is written into the real store files below the Store (the way a
flipped bit or a torn write would leave them)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.maintenance import compact, evict_to_bytes, verify
from ucm_db.migrations.access import open_engine
from ucm_db.index.entries import BlockMeta, lru_key

from cli_stores import NS_A, NS_B, chain_keys, invoke, invoke_json, make_store, payload

BIG_BLOCK_BYTES = 64 << 10
#: Offset of a packed BlockMeta's stored size (``<16s32sIQQQQI``).
STORED_AT = 16 + 32 + 4 + 8


def edit(path: Path, fn: Callable[[Any], object]) -> None:
    engine = open_engine(path)
    try:
        engine.write(fn)
    finally:
        engine.close()


def set_meta(path: Path, key: bytes, change: Callable[[bytearray], bytes]) -> None:
    def run(txn: Any) -> None:
        txn.put("meta", key, change(bytearray(txn.get("meta", key))))
    edit(path, run)


def meta_of(path: Path, key: bytes) -> BlockMeta:
    engine = open_engine(path)
    try:
        return engine.read(lambda txn: BlockMeta.unpack(txn.get("meta", key)))
    finally:
        engine.close()


def stored_sum(store: ucm_db.Store) -> int:
    return sum(m.stored_bytes for m in store._tier.scan_metas().values())


def big_payload(tag: str, index: int) -> bytes:
    return hashlib.shake_256(f"{tag}/{index}".encode()).digest(BIG_BLOCK_BYTES)  # incompressible


def make_full_store(path: Path) -> dict[str, list[bytes]]:
    """4 chains of 3 blocks of 64 KiB in a 1 MiB store: room for 2 more blocks, not 4."""
    chains = {}
    with ucm_db.open(path, capacity_bytes=1 << 20) as store:
        for c in range(4):
            chains[f"c{c}"] = keys = chain_keys(NS_A, f"c{c}", 3)
            store.put(NS_A, keys, [big_payload(f"c{c}", i) for i in range(3)])
    return chains


def test_impossible_size_is_named_quarantined_and_never_summed(tmp_path: Path) -> None:
    """Item 4: one record's stored size set to 2**63. verify names the block,
    --fix quarantines it, the totals stay the sum of real blocks, and the
    next put evicts nothing it should not (it evicted 21 of 36 blocks)."""
    path = tmp_path / "s"
    chains = make_full_store(path)
    bad = chains["c1"][1]
    set_meta(path, bad, lambda m: bytes(m[:STORED_AT]) + struct.pack("<Q", 2**63) + bytes(m[STORED_AT + 8:]))

    r = invoke_json("verify", path, expect=1)
    assert [c["key"] for c in r["corrupt"]] == [bad.hex()]
    assert any(bad.hex()[:16] in p and "impossible sizes" in p for p in r["index_problems"]), r["index_problems"]

    r = invoke_json("verify", path, "--fix", expect=1)
    assert r["quarantined_blocks"] == 2  # the block and its one descendant
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.stats().stored_bytes == stored_sum(store) < 1 << 20
        assert bad in store._tier.quarantine_records()
        new = chain_keys(NS_A, "new", 2)
        assert store.put(NS_A, new, [big_payload("new", i) for i in range(2)]).evicted == 0
        assert [store.lookup(NS_A, chains[c]) for c in ("c0", "c1", "c2", "c3")] == [3, 1, 3, 3]


def test_an_impossible_size_is_never_summed_by_a_recount(tmp_path: Path) -> None:
    """Item 4, the mechanism: a recount (a damaged totals record) leaves the
    impossible record out, so a put does not evict to make room for 8 EiB."""
    path = tmp_path / "s"
    chains = make_full_store(path)
    bad = chains["c2"][2]
    set_meta(path, bad, lambda m: bytes(m[:STORED_AT]) + struct.pack("<Q", 2**63) + bytes(m[STORED_AT + 8:]))
    edit(path, lambda txn: txn.put("info", b"totals", b"garbage"))  # forces a recount
    with ucm_db.open(path) as store:
        r = store.put(NS_A, chain_keys(NS_A, "new", 2), [big_payload("new", i) for i in range(2)])
        assert r.evicted <= 1, r  # at most the damaged block itself goes
        assert [store.lookup(NS_A, chains[c]) for c in ("c0", "c1", "c3")] == [3, 3, 3]
        assert store.stats().stored_bytes == stored_sum(store) < 1 << 20


def test_a_short_record_is_damage_and_never_wedges_writes(tmp_path: Path) -> None:
    """Item 7: a record 10 bytes long. A get of its chain is a miss there;
    puts, the background flush and close go on (they raised struct.error);
    the block ends up quarantined; verify --fix and compact work."""
    path = tmp_path / "s"
    chains = make_store(path)
    bad = chains["a1"][2]
    set_meta(path, bad, lambda m: bytes(m[:10]))
    with ucm_db.open(path) as store:
        got = store.get(NS_A, chains["a1"])
        assert got[2] is None and got[:2] == [payload("a1", 0), payload("a1", 1)]
        assert store.lookup(NS_A, chains["a1"]) <= 2
        store.put(NS_A, chain_keys(NS_A, "more", 3), [payload("more", i) for i in range(3)])
        store.flush()
        store.put(NS_A, chain_keys(NS_A, "more2", 2), [payload("more2", i) for i in range(2)])
        assert store.lookup(NS_A, chain_keys(NS_A, "more2", 2)) == 2
    with ucm_db.open(path) as store:
        assert bad in store._tier.quarantine_records()
        assert store.lookup(NS_A, chains["a1"]) == 2
        assert store.stats().stored_bytes == stored_sum(store)
    assert invoke_json("verify", path)["corrupt"] == []


def test_a_short_record_is_repaired_by_verify_fix_and_compact_works(tmp_path: Path) -> None:
    path = tmp_path / "s"
    chains = make_store(path)
    bad = chains["a3"][1]
    set_meta(path, bad, lambda m: bytes(m[:10]))
    compact(path)  # died with struct.error in the index audit
    r = verify(path)
    assert list(r.corrupt) == [bad] and r.problems
    assert invoke("verify", path, expect=1).exit_code == 1
    r = verify(path, fix=True)
    assert r.quarantined_blocks >= 1
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.lookup(NS_A, chains["a3"]) == 1
        assert store.stats().stored_bytes == stored_sum(store)
    report = compact(path, target_bytes=0)
    assert report["blocks_after"] == 0 and report["index_problems"] == []


def test_an_altered_namespace_id_fails_verify_and_is_quarantined(tmp_path: Path) -> None:
    """Item 17: block 1 of a chain relabelled to another namespace. lookup
    claimed 5 blocks while get missed block 1; verify exited 0."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a0"]
    set_meta(path, keys[1], lambda m: bytes(16 * [0x5A]) + bytes(m[16:]))
    with ucm_db.open(path) as store:
        assert store.get(NS_A, keys)[1] is None
    r = invoke_json("verify", path, expect=1)
    assert keys[1].hex() in [c["key"] for c in r["corrupt"]]
    assert any(p.startswith("namespace counters") for p in r["index_problems"])
    invoke_json("verify", path, "--fix", expect=1)
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.lookup(NS_A, keys) == 1
        assert store.get(NS_A, keys)[1:] == [None] * 4


def test_a_lost_child_link_fails_verify_and_is_restored(tmp_path: Path) -> None:
    """Item 17: a lost children entry (a delete of the parent would leave the
    child, and lookup would over-claim); verify exited 0."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a2"]
    edit(path, lambda txn: txn.delete("children", keys[1] + keys[2]))
    r = invoke_json("verify", path, expect=1)
    assert any(keys[2].hex()[:16] in p and "child link" in p for p in r["index_problems"]), r["index_problems"]
    invoke_json("verify", path, "--fix", expect=1)
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.delete(NS_A, keys[1:2]) == 4
        assert store.lookup(NS_A, keys) == 1


def test_parent_missing_and_no_lru_entry_are_repaired(tmp_path: Path) -> None:
    """Item 17: "parent missing" and "no LRU entry" were reported, but neither
    --fix nor compact repaired them. A block whose parent is missing goes to
    quarantine with its descendants; a missing LRU entry is re-added (by
    --fix, and by compact)."""
    path = tmp_path / "s"
    chains = make_store(path)
    orphaned, unlisted = chains["a1"], chains["a3"][4]
    meta = meta_of(path, unlisted)
    edit(path, lambda txn: (txn.delete("meta", orphaned[2]), txn.delete("blocks", orphaned[2]), txn.delete("heads", orphaned[2]),
                            txn.delete("lru", lru_key(meta.access_ns, meta.depth, unlisted))))
    r = invoke_json("verify", path, expect=1)
    assert orphaned[3].hex() in [c["key"] for c in r["corrupt"]]
    assert any("no LRU entry" in p for p in r["index_problems"])
    invoke_json("verify", path, "--fix", expect=1)
    assert invoke_json("verify", path)["index_problems"] == []
    with ucm_db.open(path) as store:
        assert store.lookup(NS_A, orphaned) == 2
        assert orphaned[3] in store._tier.quarantine_records()
        assert store.stats().stored_bytes == stored_sum(store)
    # compact re-adds a missing LRU entry too (the block can then be evicted).
    meta = meta_of(path, chains["a0"][4])
    edit(path, lambda txn: txn.delete("lru", lru_key(meta.access_ns, meta.depth, chains["a0"][4])))
    assert compact(path)["index_problems"] == []
    assert not verify(path).problems


def test_compact_quarantines_a_parentless_block(tmp_path: Path) -> None:
    """Item 17, compact's half: a block whose parent record is gone was
    listed as "parent missing" in compact's report and left in place
    (lookup stopped before it, verify kept failing). compact now quarantines
    it with its descendants, as `verify --fix` does, and recounts the
    counters the lost record leaves disagreeing."""
    path = tmp_path / "s"
    chains = make_store(path)
    orphaned = chains["a1"]
    edit(path, lambda txn: (txn.delete("meta", orphaned[2]), txn.delete("blocks", orphaned[2]), txn.delete("heads", orphaned[2])))
    assert orphaned[3].hex() in [c["key"] for c in invoke_json("verify", path, expect=1)["corrupt"]]
    report = compact(path)
    assert report["parentless_quarantined"] == 2, report  # orphaned[3] and its descendant orphaned[4]
    assert report["index_problems"] == [], report["index_problems"]
    assert not verify(path).problems
    with ucm_db.open(path) as store:
        assert store.lookup(NS_A, orphaned) == 2
        assert orphaned[3] in store._tier.quarantine_records()
        assert store.stats().stored_bytes == stored_sum(store)


def test_a_delete_over_a_damaged_descendant_removes_the_tree(tmp_path: Path) -> None:
    """A descendant whose record is cut short is damage, not another
    namespace's block: a namespaced delete of its chain goes through (it was
    refused as crossing into a namespace named by the record's first bytes)."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a2"]
    set_meta(path, keys[3], lambda m: bytes(m[:10]))
    with ucm_db.open(path) as store:
        assert store.delete(NS_A, keys[1:2]) >= 1
        assert store.lookup(NS_A, keys) == 1 and store.get(NS_A, keys)[1:] == [None] * 4
        assert store.stats().stored_bytes == stored_sum(store)
    assert not verify(path).problems


def test_a_put_over_a_record_with_impossible_sizes_and_another_namespace_quarantines_it(tmp_path: Path) -> None:
    """A record whose sizes no block can have is damage whatever its namespace
    bytes say: a put of that key quarantines it and stores the block, never a
    ConfigError naming a foreign namespace."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a1"]
    set_meta(path, keys[4], lambda m: bytes(16 * [0x5A]) + bytes(m[16:STORED_AT]) + struct.pack("<Q", 2**63)
             + bytes(m[STORED_AT + 8:]))
    with ucm_db.open(path) as store:
        store.put(NS_A, keys, [payload("a1", i) for i in range(5)])
        assert store.get(NS_A, keys) == [payload("a1", i) for i in range(5)]
        assert keys[4] in store._tier.quarantine_records()


def test_a_put_over_a_chain_tail_with_a_short_record_stores_it_again(tmp_path: Path) -> None:
    """A chain's last block whose record is cut short: a put of the chain
    stores that block again (it was seen as present and skipped, so the put
    reported success while the block stayed unreadable)."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a3"]
    set_meta(path, keys[4], lambda m: bytes(m[:10]))
    with ucm_db.open(path) as store:
        assert store.put(NS_A, keys, [payload("a3", i) for i in range(5)]).stored == 1
        assert store.get(NS_A, keys) == [payload("a3", i) for i in range(5)]
        assert store.stats().stored_bytes == stored_sum(store)


def test_a_put_over_a_chain_with_a_short_record_in_the_middle_stores_the_whole_chain(tmp_path: Path) -> None:
    """The put quarantines the damaged block with its descendants: the
    descendants it was given are stored again too, not reported present
    and lost."""
    path = tmp_path / "s"
    chains = make_store(path)
    keys = chains["a0"]
    set_meta(path, keys[2], lambda m: bytes(m[:10]))
    with ucm_db.open(path) as store:
        store.put(NS_A, keys, [payload("a0", i) for i in range(5)])
        assert store.get(NS_A, keys) == [payload("a0", i) for i in range(5)]
        assert store.stats().stored_bytes == stored_sum(store)


def test_a_damaged_format_version_is_named_by_inspect_and_repaired_by_verify_fix(tmp_path: Path) -> None:
    """Issue 46 finding 7: inspect exited 0 on a damaged format-version
    record, verify --fix said "run migrate" and migrate "run verify". Now
    inspect exits 1, verify --fix rewrites the record where the creation
    record tells the format, and the store opens with its blocks."""
    import json

    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    path = tmp_path / "s"
    ns = ucm_db.Namespace(model="fmt", kv_dtype="bfloat16", block_size=4)
    with ucm_db.open(path) as store:
        store.put(ns, ns.block_keys(list(range(8))), [b"a" * 64, b"b" * 64])
        store._tier.engine.write(lambda txn: txn.put("info", b"format_version", b"zz"))
    runner = CliRunner()
    assert runner.invoke(cli, ["inspect", str(path)]).exit_code == 1
    assert runner.invoke(cli, ["compact", str(path)]).exit_code != 0  # never rewritten while damaged
    fixed = runner.invoke(cli, ["verify", "--fix", str(path), "--json"])
    assert "format" in " ".join(json.loads(fixed.stdout)["index_problems"]), fixed.output
    again = runner.invoke(cli, ["verify", str(path)])
    assert again.exit_code == 0, again.output
    with ucm_db.open(path) as store:
        assert store.get(ns, ns.block_keys(list(range(8)))) == [bytearray(b"a" * 64), bytearray(b"b" * 64)]


def test_a_damaged_settings_record_is_never_compacted(tmp_path: Path) -> None:
    """Issue 46 finding 7: compact rewrote a store whose sealed settings held
    capacity_bytes=-5 (which open refuses) and evicted by them."""
    import json

    from ucm_db.index import records

    path = tmp_path / "s"
    ns = ucm_db.Namespace(model="fmt", kv_dtype="bfloat16", block_size=4)
    with ucm_db.open(path) as store:
        store.put(ns, ns.block_keys(list(range(8))), [b"a" * 64, b"b" * 64])
        settings = json.loads(bytes(store._tier.engine.read(lambda txn: txn.get("info", b"settings"))))
        settings["capacity_bytes"] = -5
        store._tier.engine.write(lambda txn: records.put_checked(txn, b"settings", json.dumps(settings).encode()))
    try:
        compact(path, target_bytes=64)
    except ucm_db.DamagedRecordError as exc:
        assert "verify --fix" in (exc.hint or "")
    else:
        raise AssertionError("compact rewrote a store open refuses")
    engine = open_engine(path)
    try:
        assert engine.read(lambda txn: txn.get("meta", ns.block_keys(list(range(8)))[1])) is not None  # nothing evicted
    finally:
        engine.close()


def test_events_of_a_store_with_a_damaged_format_version_is_an_error(tmp_path: Path) -> None:
    """Issue 46 finding 7: `ucm-db events` printed nothing and exited 0."""
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    path = tmp_path / "s"
    ucm_db.open(path).close()
    edit(path, lambda txn: txn.put("info", b"format_version", b"zz"))
    result = CliRunner().invoke(cli, ["events", str(path)])
    assert result.exit_code == 1 and "verify --fix" in result.output + (result.stderr or "")


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_evict_to_bytes_of_a_store_with_a_damaged_format_version_is_a_damaged_record_error(tmp_path: Path, engine: str) -> None:
    """Audit F4: evict_to_bytes said "format -1, run `ucm-db migrate`" (a FormatVersionError), and migrate
    refuses a damaged record. It raises what open raises for it, and evicts nothing."""
    path = tmp_path / "s"
    ns = ucm_db.Namespace(model="fmt", kv_dtype="bfloat16", block_size=4)
    keys = ns.block_keys(list(range(8)))
    ucm_db.open(path, engine=engine).close()
    with ucm_db.open(path) as store:
        store.put(ns, keys, [b"a" * 64, b"b" * 64])
    edit(path, lambda txn: txn.put("info", b"format_version", b"zz"))
    with pytest.raises(ucm_db.DamagedRecordError) as opened:
        ucm_db.open(path)
    with pytest.raises(ucm_db.DamagedRecordError) as evicting:
        evict_to_bytes(path, 64)
    assert str(evicting.value) == str(opened.value) and "migrate" not in evicting.value.hint
    engine_of = open_engine(path)
    try:
        assert engine_of.read(lambda txn: txn.get("meta", keys[1])) is not None  # nothing evicted
    finally:
        engine_of.close()
