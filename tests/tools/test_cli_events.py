"""``ucm-db events``: the inventory replay and the change feed as JSON lines
(through CliRunner, and followed through the real entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, maintenance

from cli_stores import NS_A, NS_B, invoke, invoke_json, make_store


def put_evented(store: ucm_db.Store, ns: ucm_db.Namespace, first_token: int, blocks: int) -> list[bytes]:
    tokens = list(range(first_token, first_token + blocks * ns.block_size))
    keys = ns.block_keys(tokens)
    fields, parent = {}, None
    for i, key in enumerate(keys):
        block_hash = key[:8]
        fields[key] = BlockEventFields(block_hash, parent, tuple(tokens[i * ns.block_size:(i + 1) * ns.block_size]), ns.block_size,
                                       lora_name="adapter" if ns is NS_B else None, lora_id=3 if ns is NS_B else None)
        parent = block_hash
    store.put(ns, keys, [b"x" * 64] * blocks, event_fields=fields)
    return keys


def lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.usefixtures("feed_from_zero")
def test_inventory_then_feed_with_vllm_field_names(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path)  # 23 plain blocks: left out of events
    with ucm_db.open(path) as store:
        keys = put_evented(store, NS_A, 100, 3)
        put_evented(store, NS_B, 500, 2)
        store.delete(NS_A, [keys[2]])
    events = lines(invoke("events", str(path)).stdout)
    stored = [e for e in events if e["type"] == "BlockStored"]
    # Inventory: 4 blocks held, parents first; then the feed from that snapshot (nothing after it).
    assert len(events) == 4 and len(stored) == 4
    seen: set[object] = set()
    for event in stored:  # parents first
        assert event["parent_block_hash"] is None or event["parent_block_hash"] in seen
        seen.add(event["block_hashes"][0])  # type: ignore[index]
    first = next(e for e in stored if e["key"] == keys[0].hex())
    assert first == {
        "type": "BlockStored", "block_hashes": [keys[0][:8].hex()], "parent_block_hash": None,
        "token_ids": list(range(100, 116)), "block_size": 16, "lora_id": None, "lora_name": None, "medium": "STORAGE",
        "group_idx": 0, "seq": 6, "namespace": NS_A.digest[:16].hex(), "key": keys[0].hex(), "epoch": 0,
    }
    # The whole feed: 5 puts, then the delete's removal, with the vLLM hash.
    feed = lines(invoke("events", str(path), "--since", 0).stdout)
    assert [e["type"] for e in feed] == ["BlockStored"] * 5 + ["BlockRemoved"]
    assert feed[-1]["block_hashes"] == [keys[2][:8].hex()] and feed[-1]["seq"] == 5
    only_b = lines(invoke("events", str(path), "--namespace", "test/beta").stdout)
    assert len(only_b) == 2 and all(e["lora_name"] == "adapter" and e["lora_id"] == 3 for e in only_b)
    assert "no namespace matches" in invoke("events", str(path), "--namespace", "nope", expect=2).stderr


def test_follower_falls_behind_and_resyncs(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store._tier.feed_max_records = 4
        for n in range(4):
            put_evented(store, NS_A, 1000 * n, 2)
    events = list(maintenance.iter_events(path, since_seq=0))
    assert events[0] == {"type": "AllBlocksCleared", "medium": "STORAGE"}
    assert len(events) == 9 and all(e["type"] == "BlockStored" for e in events[1:])


def test_follow_through_the_real_entry_point(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        put_evented(store, NS_A, 0, 2)
    exe = Path(sys.executable).parent / "ucm-db"
    follower = subprocess.Popen([str(exe), "events", str(path), "--follow", "--poll-interval", "0.05"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        seen = [json.loads(follower.stdout.readline()) for _ in range(2)]
        assert [e["type"] for e in seen] == ["BlockStored"] * 2
        with ucm_db.open(path) as store:
            keys = put_evented(store, NS_A, 5000, 1)
            store.delete(NS_A, keys)
        later = [json.loads(follower.stdout.readline()) for _ in range(2)]
        assert [(e["type"], e["key"]) for e in later] == [("BlockStored", keys[0].hex()), ("BlockRemoved", keys[0].hex())]
    finally:
        follower.terminate()
        follower.wait(timeout=30)


@pytest.mark.usefixtures("feed_from_zero")
def test_invalidate_hides_old_epochs_and_a_damaged_record_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        old = put_evented(store, NS_A, 0, 2)
        put_evented(store, NS_B, 0, 1)
        # A flipped length in one block's fields record (a damaged page): skipped and logged, never fatal.
        name = b"evf/" + old[1]
        value = store._tier.info_get(name)
        assert value is not None
        store._tier.info_put(name, value[:-1])
    assert len(lines(invoke("events", str(path)).stdout)) == 2
    follower = maintenance.iter_events(path, since_seq=0, follow=True, poll_interval_s=0.01, max_polls=3)
    assert [e["type"] for e in [next(follower) for _ in range(3)]] == ["BlockStored"] * 3
    maintenance.invalidate(path, ("test/alpha",))
    # The follower sees the epoch move on: cleared, then the inventory without the old epoch's blocks.
    rest = list(follower)
    assert rest[0]["type"] == "AllBlocksCleared" and [e["namespace"] for e in rest[1:]] == [NS_B.digest[:16].hex()]
    assert [e["namespace"] for e in lines(invoke("events", str(path)).stdout)] == [NS_B.digest[:16].hex()]


@pytest.mark.usefixtures("feed_from_zero")
def test_a_follower_checks_the_pages_once_not_every_poll(tmp_path: Path, monkeypatch) -> None:
    """Each poll reopens the store (no lock held between polls), but LMDB's
    page check at open walks the whole store in a child process (seconds per
    100k blocks): a follower runs it once, on its first read, not once per
    poll and per namespace. (The check is wrapped only to count its calls.)"""
    from ucm_db.engines.lmdb import engine as lmdb_engine
    from ucm_db.engines.lmdb.custody import RECORD_FILE

    path = tmp_path / "s"
    with ucm_db.open(path) as store:
        put_evented(store, NS_A, 0, 2)
        put_evented(store, NS_B, 0, 1)
    checks = []
    real = lmdb_engine.check_pages_at_open
    monkeypatch.setattr(lmdb_engine, "check_pages_at_open", lambda *a, **k: (checks.append(1), real(*a, **k))[1])
    for since in (None, 0):
        (path / "lmdb" / RECORD_FILE).unlink()  # else the last clean close spares the follower the walk (custody.py)
        checks.clear()
        seen = list(maintenance.iter_events(path, since_seq=since, follow=True, poll_interval_s=0.001, max_polls=5))
        assert len(seen) == 3 and len(checks) == 1, (since, len(checks))


def _damage_head(path: Path, next_seq: int | None, first_seq: int | None) -> None:
    """Rewrites the change feed head's fields through the engine's own
    transaction (its checksum sidecar, if any, left as it was)."""
    import struct

    with ucm_db.open(path) as store:
        def run(txn) -> None:  # type: ignore[no-untyped-def]
            old_next, old_first = struct.unpack("<QQ", bytes(txn.get("info", b"feed-head")))
            txn.put("info", b"feed-head", struct.pack("<QQ", old_next if next_seq is None else next_seq,
                                                      old_first if first_seq is None else first_seq))
        store._tier.engine.write(run)


@pytest.mark.parametrize("damage", [(1 << 63 | 5, None), (None, 9)], ids=["high-bit-next", "first-above-next"])
def test_events_since_0_ends_on_a_damaged_feed_head(tmp_path: Path, damage: tuple[int | None, int | None]) -> None:
    """Issue 46 finding 2: `ucm-db events --since 0` ran for ever on a head
    with a high bit in next_seq (2**63 empty reads) or first_seq > next_seq
    (resync, inventory, resync ...). It says AllBlocksCleared once, the
    inventory, and ends."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        put_evented(store, NS_A, 0, 3)
        put_evented(store, NS_A, 0, 2)  # already stored: no records
    _damage_head(path, *damage)
    exe = Path(sys.executable).parent / "ucm-db"
    done = subprocess.run([str(exe), "events", str(path), "--since", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [e["type"] for e in lines(done.stdout)] == ["AllBlocksCleared"] + ["BlockStored"] * 3


@pytest.mark.parametrize("interval", ["nan", "inf", "-1", "1e9"])
def test_a_poll_interval_that_is_no_finite_number_of_seconds_is_a_usage_error(tmp_path: Path, interval: str) -> None:
    """Issue 46 finding 11: ``--poll-interval nan|inf`` ended in a traceback."""
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    result = CliRunner().invoke(cli, ["events", str(tmp_path / "s"), "--follow", "--poll-interval", interval])
    assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "poll-interval" in result.output and "Traceback" not in result.output


def test_a_poll_interval_without_follow_is_refused(tmp_path: Path) -> None:
    """Audit F16: `events --poll-interval 5` without --follow was accepted and ignored."""
    path = tmp_path / "s"
    make_store(path)
    before = invoke_json("inspect", path)["blocks"]
    result = invoke("events", path, "--poll-interval", "5", expect=2)
    assert "--poll-interval sets how often --follow reads the feed" in result.stderr
    assert "add --follow" in result.stderr and result.stdout == ""
    assert invoke_json("inspect", path)["blocks"] == before
