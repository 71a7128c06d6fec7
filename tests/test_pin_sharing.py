"""Pins shared between chains (audit r4): unpinning a chain takes back its own
pin and never one another chain made on blocks they share (a system prompt
pinned on its own, a conversation continuing it); a chain pinned twice holds
one pin; a store whose pins an older ucm-db wrote (``pin/`` records only, no
``pinby/``) keeps them and unpins them as that version did; the chains' pin
records survive compact and are checked and rebuilt by verify. Real LMDB and
RocksDB stores, the CLI through CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.index import records
from ucm_db.index.accounting import PIN_COUNTS, PIN_COUNTS_PREFIX
from ucm_db.index.entries import PIN_PREFIX, PinRecord
from ucm_db.tools.cli import cli

NS = Namespace(model="pin-sharing", kv_dtype="bfloat16", block_size=16)
CAPACITY = 2 << 20
BLOCK_BYTES = 4096
SYSTEM = list(range(5000, 5000 + 16 * 16))  # 16 blocks
CONVERSATION = SYSTEM + list(range(9000, 9000 + 64))  # 20 blocks: the system prompt and 4 more


def payload(seed: int) -> bytes:
    return bytes([seed % 251]) * BLOCK_BYTES


def put_tokens(store: ucm_db.Store, tokens: list[int]) -> ucm_db.BlockKeys:
    keys = NS.block_keys(tokens, epoch=store.epoch(NS))
    have = store.lookup(NS, keys)
    if have < len(keys):
        store.put(NS, keys[have:], [payload(i) for i in range(have, len(keys))])
    return keys


def traffic(store: ucm_db.Store, total_bytes: int, base: int) -> None:
    """Unrelated prompts of 8 blocks until ``total_bytes`` were put."""
    for i in range(total_bytes // (8 * BLOCK_BYTES)):
        put_tokens(store, list(range(base + i * 1000, base + i * 1000 + 128)))


def pinned_blocks(store: ucm_db.Store) -> int:
    row = store.stats().namespaces.get(NS.digest[:16].hex())
    return 0 if row is None else row.pinned_blocks


@pytest.fixture(params=["lmdb", "rocksdb"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    return str(request.param)


@pytest.mark.parametrize("conversation_first", [False, True])
def test_unpinning_a_conversation_keeps_the_system_prompt_s_own_pin(tmp_path: Path, engine: str, conversation_first: bool) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        system = put_tokens(store, SYSTEM)
        conversation = put_tokens(store, CONVERSATION)
        for chain in ([conversation, system] if conversation_first else [system, conversation]):
            store.pin(NS, chain)
        released = store.unpin(NS, conversation)
        assert released.chains == (16,)  # the system prompt's own pin holds its blocks
        assert released.changed_blocks == 4 and released.namespace_blocks == 16
        assert store._tier.check() == []
        traffic(store, 6 * CAPACITY, 10**6)
        assert store.stats().evictions > 1000
        assert store.lookup(NS, system) == 16  # never evicted
        assert store.lookup(NS, conversation) == 16  # its own 4 blocks aged out
        assert store.unpin(NS, system).namespace_blocks == 0
        assert store._tier.check() == []


def test_unpinning_a_chain_that_made_no_pin_takes_nothing(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, SYSTEM)
        conversation = put_tokens(store, CONVERSATION)
        store.pin(NS, system)
        report = store.unpin(NS, conversation)  # passes through the system prompt's pin, never made one
        assert report.changed_blocks == 0 and report.chains == (16,)
        assert pinned_blocks(store) == 16


def test_two_chains_pinned_at_the_same_block_each_hold_it(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, SYSTEM)
        conversation = NS.block_keys(CONVERSATION, epoch=store.epoch(NS))  # only its first 16 blocks stored
        assert store.pin(NS, conversation).chains == (16,)  # its pin is made at the system prompt's last block
        assert store.pin(NS, system).changed_blocks == 0
        assert store.unpin(NS, conversation).chains == (16,)  # the system prompt's pin, at the same block, holds
        assert pinned_blocks(store) == 16 and store._tier.check() == []
        assert store.unpin(NS, system).chains == (0,)
        assert pinned_blocks(store) == 0 and store._tier.check() == []


def test_a_chain_pinned_twice_holds_one_pin_covering_what_is_stored_now(tmp_path: Path) -> None:
    from ucm_db.index.pins import PIN_BY_PREFIX

    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        keys = NS.block_keys(CONVERSATION, epoch=store.epoch(NS))
        store.put(NS, keys[:6], [payload(i) for i in range(6)])
        assert store.pin(NS, keys).chains == (6,)
        assert store.pin(NS, keys).changed_blocks == 0  # the same chain again: the same pin
        store.put(NS, keys[6:], [payload(i) for i in range(6, 20)])
        again = store.pin(NS, keys)  # its pin moves on to what is stored now
        assert again.chains == (20,) and again.changed_blocks == 14 and again.namespace_blocks == 20
        assert store._engine.read(lambda txn: len(list(txn.scan("info", PIN_BY_PREFIX)))) == 1
        assert store._tier.check() == []
        assert store.unpin(NS, keys).namespace_blocks == 0  # one unpin takes the one pin
        assert store._tier.check() == []


def test_chain_pins_survive_compact_and_verify_fix_drops_a_stray_one(tmp_path: Path) -> None:
    from ucm_db.index.pins import PIN_BY_PREFIX

    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, SYSTEM)
        conversation = put_tokens(store, CONVERSATION)
        store.pin(NS, [system, conversation])
        stray = PIN_BY_PREFIX + conversation[17] + bytes(range(32))  # names a block with no pin made at it
        store._engine.write(lambda txn: txn.put("info", stray, NS.digest[:16]))
        assert any(p.startswith("info record 'pinby/") for p in store._tier.check())
    assert maintenance.verify(path, fix=True).totals_recomputed
    assert maintenance.verify(path).index_problems == []
    maintenance.compact(path, target_bytes=0)
    with ucm_db.open(path) as store:
        assert store._engine.read(lambda txn: txn.get("info", stray)) is None
        assert store.unpin(NS, conversation).chains == (16,)
        assert store.unpin(NS, system).namespace_blocks == 0
        assert store._tier.check() == []


def test_chain_pins_survive_engine_conversion(tmp_path: Path) -> None:
    pytest.importorskip("rocksdict")
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY) as store:
        system = put_tokens(store, SYSTEM)
        conversation = put_tokens(store, CONVERSATION)
        store.pin(NS, [system, conversation])
    maintenance.convert_engine(tmp_path / "s", tmp_path / "r", "rocksdb")
    with ucm_db.open(tmp_path / "r", engine="rocksdb") as store:
        assert store.unpin(NS, conversation).chains == (16,)
        assert store._tier.check() == []


def _write_legacy_pins(store: ucm_db.Store, tips: list[ucm_db.BlockKeys]) -> None:
    """The pin records ucm-db wrote before pins were named by chain: a
    ``pin/`` record per pinned block (``below`` counting the pins at or
    under it, ``own`` at each pin's block), the ``pincount:`` counter, and
    no ``pinby/`` record. Each chain in ``tips`` was pinned at its last key."""
    metas = {}
    below: dict[bytes, int] = {}
    for chain in tips:
        for key, meta in zip(chain, store._tier.metas(chain)):
            assert meta is not None
            metas[key] = meta
            below[key] = below.get(key, 0) + 1
    own = {chain[-1] for chain in tips}

    def write(txn: object) -> None:
        for key, count in below.items():
            txn.put("info", PIN_PREFIX + key, PinRecord(NS.digest[:16], metas[key].stored_bytes, count, key in own).pack())  # type: ignore[attr-defined]
        total = sum(m.stored_bytes for m in metas.values())
        records.put_checked(txn, PIN_COUNTS_PREFIX + NS.digest[:16], PIN_COUNTS.pack(len(metas), total))  # type: ignore[arg-type]

    store._engine.write(write)


def test_a_store_pinned_by_the_previous_version_keeps_its_pins_and_unpins_them(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        system = put_tokens(store, SYSTEM)
        conversation = put_tokens(store, CONVERSATION)
        other = put_tokens(store, list(range(700, 700 + 16 * 5)))
        _write_legacy_pins(store, [system, conversation, other])
    with ucm_db.open(path, engine=engine) as store:
        assert store._tier.check() == []  # the old layout is a sound one
        assert pinned_blocks(store) == 25
        traffic(store, 6 * CAPACITY, 2 * 10**6)
        assert [store.lookup(NS, c) for c in (system, conversation, other)] == [16, 20, 5]  # still pinned
        assert store.unpin(NS, conversation).chains == (16,)  # its legacy pin only: the system prompt's stays
        assert store.pin(NS, other).changed_blocks == 0  # pinned again at the same block: that pin becomes the chain's
        assert store.unpin(NS, other).chains == (0,)  # one unpin takes it
        assert pinned_blocks(store) == 16 and store._tier.check() == []
        assert store.unpin(NS, system).namespace_blocks == 0
        assert store._tier.check() == []


def test_the_cli_unpin_of_a_conversation_leaves_the_system_prompt_pinned(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        put_tokens(store, CONVERSATION)
    files = {}
    for name, tokens in (("system", SYSTEM), ("conversation", CONVERSATION)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(json.dumps(tokens) + "\n")

    def run(*args: object) -> dict:
        result = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    for name in ("system", "conversation"):
        run("pin", path, "--namespace", "pin-sharing", "--tokens", files[name])
    report = run("unpin", path, "--namespace", "pin-sharing", "--tokens", files["conversation"])
    assert report["changed_blocks"] == 4 and [p["pinned_blocks"] for p in report["prompts"]] == [16]
    inspected = run("inspect", path)
    assert inspected["namespaces"][0]["pinned_blocks"] == 16 and inspected["pinned_bytes"] > 16 * BLOCK_BYTES
    assert run("unpin", path, "--namespace", "pin-sharing", "--tokens", files["system"])["namespace_blocks"] == 0
