"""docs/events.md's and docs/fleet.md's promises, held on real LMDB stores,
with the documents' own words checked beside the code:

* events.md: the feed records a ``stored`` record for an evented put and a
  ``removed`` one whoever removes the block (``delete``, eviction by
  capacity, quarantine, ``compact --target-bytes``); blocks put without
  ``event_fields`` never appear; a new feed starts at a multiple of 2^32
  below 2^52; every feed has a 32-hex-digit id and another feed's id is a
  resync with no records; vLLM's ``extra_keys`` travel with a block's
  fields; the CLI has the flags the document names.
* fleet.md: ``lookup_many`` answers from the local tier and touches
  nothing; ``whole_model_units`` reads the connector's layout (None for
  whole blocks and for one KV head); pins: the default, 0, a cap above the
  capacity, one pin per chain, a refused pin pins nothing, an epoch move
  releases pins and a stale chain is a ``StaleEpochError`` (a
  ``ValueError``), a read-only store refuses; the stats fields named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import BlockEventFields, maintenance
from ucm_db.errors import StaleEpochError
from ucm_db.tools.cli import cli

ROOT = Path(__file__).resolve().parents[1]
EVENTS = (ROOT / "docs" / "events.md").read_text(encoding="utf-8")
FLEET = (ROOT / "docs" / "fleet.md").read_text(encoding="utf-8")
NS = ucm_db.Namespace(model="audit/events", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(40))
KEYS = NS.block_keys(TOKENS)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _fields(i: int, extra: tuple[object, ...] | None = None) -> BlockEventFields:
    return BlockEventFields(block_hash=1000 + i, parent_block_hash=None if i == 0 else 999 + i,
                            token_ids=tuple(TOKENS[4 * i:4 * i + 4]), block_size=4, extra_keys=extra)


def _kinds(store: ucm_db.Store, since: int) -> list[tuple[str, bytes]]:
    return [(r.kind, r.key) for r in store.changes_since(since, 10_000).records]


# -- events.md ----------------------------------------------------------------------------------------
def test_the_feed_tells_every_removal_and_nothing_of_plain_puts(tmp_path: Path) -> None:
    assert ("`BlockRemoved` when the block leaves the store, whoever removed it: eviction by any process, `delete`, quarantine "
            "of a corrupt block, `compact`, `import --allow-evict`") in _flat(EVENTS)
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 20, codec="none") as store:
        start = store.feed_position()
        assert start % (1 << 32) == 0 and start < 1 << 52  # "a random multiple of 2^32 below 2^52"
        plain = NS.block_keys(list(range(500, 540)))
        store.put(NS, plain, [b"p" * 4096] * 10)  # "API puts without `event_fields=`" are left out
        assert _kinds(store, start) == []
        store.put(NS, KEYS, [bytes([i]) * 4096 for i in range(10)],
                  event_fields={k: _fields(i, ("salt",) if i == 0 else None) for i, k in enumerate(KEYS)})
        stored = store.changes_since(start, 100).records
        assert [(r.kind, r.key) for r in stored] == [("stored", k) for k in KEYS]
        assert stored[0].fields.extra_keys == ("salt",) and stored[1].fields.extra_keys is None  # extra_keys travel
        assert "`extra_keys`" not in EVENTS.split("\nLeft out:", 1)[1]  # so "Left out" no longer lists them
        mark = store.feed_position()
        assert store.delete(NS, KEYS[9:]) == 1
        assert _kinds(store, mark) == [("removed", KEYS[9])]  # delete
        mark = store.feed_position()
        assert store.quarantine(KEYS[8], "audit", recheck=False)
        assert _kinds(store, mark) == [("removed", KEYS[8])]  # quarantine
        mark = store.feed_position()
    maintenance.compact(path, target_bytes=0)
    with ucm_db.open(path) as store:
        assert {key for kind, key in _kinds(store, mark) if kind == "removed"} == set(KEYS[:8])  # compact
    with ucm_db.open(tmp_path / "full", capacity_bytes=1 << 20, codec="none") as store:
        store.put(NS, KEYS, [bytes([i]) * 4096 for i in range(10)], event_fields={k: _fields(i) for i, k in enumerate(KEYS)})
        mark = store.feed_position()
        for prompt in range(6):  # 1.2 MiB more into 1 MiB: evicts (LRU: the evented chain's tail first)
            store.put(NS, NS.block_keys(list(range(10_000 * (prompt + 1), 10_000 * (prompt + 1) + 200))), [b"o" * 4096] * 50)
        evicted = [key for kind, key in _kinds(store, mark) if kind == "removed"]
        assert sorted(evicted) == sorted(KEYS) and store.lookup(NS, KEYS) == 0  # eviction
        store.put(NS, KEYS, [bytes([i]) * 4096 for i in range(10)], event_fields={k: _fields(i) for i, k in enumerate(KEYS)})
        mark = store.feed_position()
    with ucm_db.open(tmp_path / "src", capacity_bytes=64 << 20, codec="none") as store:
        for prompt in range(5):
            store.put(NS, NS.block_keys(list(range(10_000 * (prompt + 1), 10_000 * (prompt + 1) + 200))), [b"o" * 4096] * 50)
    runner = CliRunner()
    assert runner.invoke(cli, ["export", str(tmp_path / "src"), str(tmp_path / "a.tar")]).exit_code == 0
    assert runner.invoke(cli, ["import", str(tmp_path / "a.tar"), str(tmp_path / "full"), "--allow-evict"]).exit_code == 0
    with ucm_db.open(tmp_path / "full") as store:
        assert sorted(key for kind, key in _kinds(store, mark) if kind == "removed") == sorted(KEYS)  # `import --allow-evict`


def test_feed_ids_and_the_cli_flags_the_documents_name(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s") as store:
        store.put(NS, KEYS[:1], [b"x" * 64], event_fields={KEYS[0]: _fields(0)})
        batch = store.changes_since(store.feed_position() - 1)
        assert len(batch.feed_id) == 32 and int(batch.feed_id, 16) >= 0 and batch.records  # "32 hex digits"
        assert store.event_inventory().feed_id == batch.feed_id
        other = store.changes_since(store.feed_position() - 1, feed_id="0" * 32)
        assert other.resync and other.records == ()  # "another feed's id is `resync=True` with no records"
    with ucm_db.open(tmp_path / "t") as store:
        assert store.changes_since(0).feed_id != batch.feed_id  # drawn when the store is created
    from ucm_db.index.changefeed import RESTART_GAP

    assert RESTART_GAP == 1 << 32 and "moves the feed's sequence 2^32 past it" in _flat(EVENTS)  # after a rollback
    events = {o for p in cli.commands["events"].params for o in p.opts}
    assert {"--since", "--feed-id", "--follow"} <= events and "`ucm-db events --since SEQ --feed-id ID`" in EVENTS
    assert "--layer-partition" in {o for p in cli.commands["lookup"].params for o in p.opts}
    assert "--max-pinned-bytes" in {o for p in cli.commands["pin"].params for o in p.opts}
    assert "`ucm-db lookup --layer-partition 14,14`" in FLEET and "[--max-pinned-bytes 4GiB]" in FLEET


# -- fleet.md -----------------------------------------------------------------------------------------------
def test_lookup_many_answers_locally_and_whole_model_units_read_the_layout(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        store.put(NS, KEYS[:6], [b"x" * 4096] * 6)
        store.flush()
    def files() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(tmp_path / "s")): (p.stat().st_mtime_ns, p.stat().st_size) for p in (tmp_path / "s").rglob("*")}

    assert "read_only=True)      # a probe writes only its reader slot in lmdb/lock.mdb" in FLEET
    listed = files()
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        before = store.stats().to_dict()["namespaces"]
        assert store.lookup_many(NS, [KEYS, KEYS[:3], NS.block_keys(list(range(100, 140)))]) == [6, 3, 0]
        assert store.stats().to_dict()["namespaces"] == before  # no recency, no hit counts
    (tmp_path / "p.jsonl").write_text(json.dumps(TOKENS) + "\n")
    found = CliRunner().invoke(cli, ["lookup", str(tmp_path / "s"), "--namespace", "audit/events", "--tokens",
                                     str(tmp_path / "p.jsonl"), "--json"], catch_exceptions=False)
    assert [p["stored_blocks"] for p in json.loads(found.stdout)["prompts"]] == [6]  # "opening the store read-only"
    after = files()
    assert set(after) == set(listed) and {name for name in after if after[name] != listed[name]} <= {"lmdb/lock.mdb"}
    layout = json.dumps({"kv_heads": 8, "layers": 28})
    units = maintenance.whole_model_units(ucm_db.Namespace(model="m", kv_dtype="bf16", block_size=16, layout=layout))
    assert units is not None and (units[0].heads, units[0].layers, len(units[1])) == (8, 28, 8)
    staged = maintenance.whole_model_units(ucm_db.Namespace(model="m", kv_dtype="bf16", block_size=16, layout=layout), [14, 14])
    assert staged is not None and len(staged[1]) == 16 and {(s.layer_start, s.layer_stop) for s in staged[1]} == {(0, 14), (14, 28)}
    one_head = json.dumps({"kv_heads": 1, "layers": 28})
    assert maintenance.whole_model_units(ucm_db.Namespace(model="m", kv_dtype="bf16", block_size=16, layout=one_head)) is None
    assert maintenance.whole_model_units(NS) is None  # "None for a store of whole blocks"


def test_the_pin_promises(tmp_path: Path) -> None:
    flat = _flat(FLEET)
    assert "(default: half of `capacity_bytes`; 0 refuses every pin; above the capacity means the capacity)" in flat
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        store.put(NS, KEYS, [bytes([i]) * 4096 for i in range(10)])
        stats = store.stats()
        assert stats.max_pinned_bytes == 32 << 20 and stats.pinned_bytes == 0
        longer = list(KEYS[:4]) + [NS.block_keys(list(range(900, 904)))[0]]  # a fifth key that is not stored
        assert store.pin(NS, longer).chains == (4,)  # "what is stored of a chain *now*"
        assert store.unpin(NS, longer).chains == (0,)  # named by its last key "as given, stored or not"
        first = store.pin(NS, KEYS[:4])
        again = store.pin(NS, KEYS[:4])  # "pinning the same chain again adds no second pin"
        assert first.store_bytes == again.store_bytes > 0 and again.chains == (4,)
        store.pin(NS, KEYS[:6])
        assert store.unpin(NS, KEYS[:6]).chains == (4,)  # the shorter chain's pin still holds its 4 blocks
        assert store.unpin(NS, KEYS[:4]).chains == (0,)  # one unpin takes the chain's pin back
        assert store.stats().pinned_bytes == 0
        store.pin(NS, KEYS[:3])
        namespace = store.stats().to_dict()["namespaces"][NS.id.hex()]
        assert namespace["pinned_blocks"] == 3 and namespace["pinned_bytes"] > 0
        old = list(KEYS[:2])
        store.bump_epoch(NS)  # "releases all its pins in that same transaction"
        assert store.stats().pinned_bytes == 0
        with pytest.raises(StaleEpochError) as info:
            store.pin(NS, old)
        assert isinstance(info.value, ValueError) and "ucm_db.errors.StaleEpochError` (a `ValueError`)" in flat
        assert store.stats().pinned_bytes == 0
    with ucm_db.open(tmp_path / "s", max_pinned_bytes=0) as store:
        new = NS.block_keys(TOKENS, epoch=store.epoch(NS))
        store.put(NS, new[:2], [b"n" * 4096] * 2)
        with pytest.raises(ucm_db.StoreFullError, match="max_pinned_bytes") as full:
            store.pin(NS, new[:2])
        assert "max_pinned_bytes" in full.value.hint and store.stats().pinned_bytes == 0
    with ucm_db.open(tmp_path / "s", max_pinned_bytes=1 << 40) as store:
        assert store.stats().max_pinned_bytes == 64 << 20  # above the capacity means the capacity
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        for call in (store.pin, store.unpin):
            with pytest.raises(ucm_db.TierError, match="read-only"):
                call(NS, KEYS[:1])
