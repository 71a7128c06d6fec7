"""A put is one write transaction (issue 50 item 3): the namespace's epoch
and the blocks' presence are read inside it, so a put of codec ``none`` or
of encoded blocks opens no read transaction of its own; a zstd put still
reads presence first, to compress only the blocks that are missing.

Each case counts the transactions through the store's real engine
(``engine.read``/``engine.write`` wrapped on the instance every part shares)
and checks that what the checks used to refuse before the transaction is
still refused, with nothing written.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, TierError, codec

NS = Namespace(model="test/put-transactions", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(7, 7 + 4 * 6))
KEYS = NS.block_keys(TOKENS)  # 6 blocks


def payloads(tag: str, n: int = len(KEYS)) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(2048, b".") for i in range(n)]


class Transactions:
    """Counts the read and write transactions of a store's engine."""

    def __init__(self, store: ucm_db.Store) -> None:
        self.reads = self.writes = 0
        engine = store._engine
        real_read, real_write = engine.read, engine.write

        def read(fn: Callable[[Any], Any]) -> Any:
            self.reads += 1
            return real_read(fn)

        def write(fn: Callable[[Any], Any]) -> Any:
            self.writes += 1
            return real_write(fn)

        engine.read, engine.write = read, write  # type: ignore[method-assign]

    def since(self, reads: int, writes: int) -> tuple[int, int]:
        return self.reads - reads, self.writes - writes

    def now(self) -> tuple[int, int]:
        return self.reads, self.writes


@pytest.fixture(params=["lmdb", "rocksdb"])
def engine(request) -> str:
    return request.param


def test_a_codec_none_put_is_one_write_transaction(tmp_path: Path, engine: str) -> None:
    with ucm_db.open(tmp_path / "s", engine=engine, codec="none") as store:
        counted = Transactions(store)
        store.put(NS, KEYS[:2], payloads("a", 2))  # the namespace's first put: registered (its epoch record) first
        assert counted.now() == (0, 2)  # its epoch record's write, then the put
        before = counted.now()
        result = store.put(NS, KEYS[2:4], payloads("a")[2:4])
        assert counted.since(*before) == (0, 1) and (result.stored, result.already_present) == (2, 0)
        before = counted.now()
        result = store.put_segments(NS, [(KEYS[3:5], payloads("a")[3:5]), (KEYS[5:], payloads("a")[5:])])
        assert counted.since(*before) == (0, 1) and (result.stored, result.already_present) == (2, 1)
        assert store.get(NS, KEYS) == payloads("a")


def test_an_encoded_put_is_one_write_transaction(tmp_path: Path, engine: str) -> None:
    values = payloads("e")
    blocks = [(key, KEYS[i - 1] if i else None, codec.encode(key, value)) for i, (key, value) in enumerate(zip(KEYS, values))]
    with ucm_db.open(tmp_path / "s", engine=engine) as store:
        store.put_encoded(NS, blocks[:3])
        counted = Transactions(store)
        result = store.put_encoded(NS, blocks)
        assert counted.now() == (0, 1) and (result.stored, result.already_present) == (3, 3)
        assert store.get(NS, KEYS) == values


def test_a_zstd_put_reads_presence_first_and_compresses_only_what_is_missing(tmp_path: Path, engine: str) -> None:
    with ucm_db.open(tmp_path / "s", engine=engine, codec="zstd") as store:
        store.put(NS, KEYS[:3], payloads("z", 3))
        encoded: list[bytes] = []
        real = store._state.codecs.encode_many

        def encode_many(items: Any, **options: Any) -> Any:
            encoded.extend(key for key, _ in items)
            return real(items, **options)

        store._state.codecs.encode_many = encode_many  # type: ignore[method-assign]
        counted = Transactions(store)
        result = store.put(NS, KEYS, payloads("z"))
        assert counted.now() == (1, 1)  # presence, then the put (its epoch checked inside)
        assert encoded == list(KEYS[3:]) and (result.stored, result.already_present) == (3, 3)
        assert store.get(NS, KEYS) == payloads("z")


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_blocks_stored_already_keep_their_payload_and_are_counted_once(tmp_path: Path, engine: str, codec_name: str) -> None:
    with ucm_db.open(tmp_path / "s", engine=engine, codec=codec_name, durability="group") as store:
        store.put(NS, KEYS[:3], payloads("old", 3))
        committed: list[int] = []
        real = store._state.activity.committed
        store._state.activity.committed = lambda stored_bytes: (committed.append(stored_bytes), real(stored_bytes))[1]  # type: ignore[method-assign]
        result = store.put(NS, KEYS, payloads("new"))
        assert (result.stored, result.already_present) == (3, 3)
        # A block already stored keeps what it was put with.
        assert store.get(NS, KEYS) == payloads("old", 3) + payloads("new")[3:]
        stats = store.stats()
        # Group durability counts the bytes the put stored, not those it found.
        assert committed == [stats.stored_bytes - sum(m.stored_bytes for m in store._tier.metas(KEYS[:3]) if m)]
        assert stats.blocks == 6 and store._tier.check() == []


def test_a_put_of_blocks_all_stored_already_writes_nothing(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put(NS, KEYS, payloads("a"))
        env = store._engine._environment()
        before = env.info()["last_txnid"]
        result = store.put(NS, KEYS, payloads("a"))
        assert (result.stored, result.already_present) == (0, 6)
        assert env.info()["last_txnid"] == before  # the write transaction dirtied no page: no commit
        store.put(NS, NS.block_keys(TOKENS + [1, 2, 3, 4])[-1:], payloads("b", 1), parent=KEYS[-1])
        assert env.info()["last_txnid"] == before + 1 and store.stats().blocks == 7 and store._tier.check() == []


# -- the epoch gate, now inside the put's transaction ----------------------------------------------
def _damage_epoch_record(store: ucm_db.Store) -> None:
    name = b"epoch:" + NS.digest[:16]
    store._engine.write(lambda txn: txn.put("info", name, (7).to_bytes(8, "little")))  # its checksum disagrees


def _lose_epoch_record(store: ucm_db.Store) -> None:
    name = b"epoch:" + NS.digest[:16]

    def lose(txn: Any) -> None:
        txn.delete("info", name)
        txn.delete("info", b"sum:" + name)
    store._engine.write(lose)


@pytest.mark.parametrize("harm", [_damage_epoch_record, _lose_epoch_record], ids=["damaged", "lost"])
@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_a_put_after_its_epoch_record_was_harmed_is_refused(tmp_path: Path, codec_name: str, harm, caplog) -> None:
    """The namespace is registered (this process put into it), then its
    epoch record is damaged or lost behind the gate's back: the next put
    finds it inside its own transaction and is refused, nothing written,
    the error logged once however often it is met."""
    caplog.set_level(logging.ERROR, logger="ucm_db")
    with ucm_db.open(tmp_path / "s", codec=codec_name) as store:
        store.put(NS, KEYS[:2], payloads("a", 2))
        harm(store)
        for _ in range(2):
            with pytest.raises(TierError, match="cannot be established") as caught:
                store.put(NS, KEYS[2:], payloads("a")[2:])
            assert "ucm-db invalidate" in caught.value.hint
        assert store._tier.count_prefix(KEYS) == 2 and store.stats().blocks == 2
        assert len([r for r in caplog.records if NS.digest[:16].hex() in r.getMessage()]) == 1
        # A bump establishes a new epoch: puts keyed at it are stored and served.
        epoch = store.bump_epoch(NS)
        fresh = NS.block_keys(TOKENS, epoch=epoch)
        store.put(NS, fresh, payloads("b"))
        assert store.lookup(NS, fresh) == 6


def test_a_put_keyed_at_the_epoch_another_process_moved_on_from_is_stored_unserved(tmp_path: Path) -> None:
    """As before the check moved into the transaction: the store cannot
    tell which epoch a put's keys are rooted at; the old epoch's blocks are
    stored, never served (readers key at the new epoch), and age out."""
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none") as store:
        store.put(NS, KEYS[:2], payloads("a", 2))  # registered at epoch 0
        code = (f"import ucm_db; from ucm_db import Namespace; s = ucm_db.open({str(path)!r}); "
                f"print(s.bump_epoch(Namespace(**{NS.to_dict()!r})))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
        result = store.put(NS, KEYS[2:], payloads("a")[2:])  # the old epoch's chain goes on
        assert result.stored == 4 and store._tier.count_prefix(KEYS) == 6
        assert store.epoch(NS) == 1
        at_one = NS.block_keys(TOKENS, epoch=1)
        assert store.lookup(NS, at_one) == 0
        store.put(NS, at_one, payloads("b"))
        assert store.lookup(NS, at_one) == 6 and store.get(NS, at_one) == payloads("b")


# -- the quarantine, read once per put ---------------------------------------------------------------
@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_a_stuck_payload_still_refuses_a_put_of_its_key(tmp_path: Path, engine: str, codec_name: str) -> None:
    """A put reads the quarantine table once (usually empty) instead of once
    per block: with a stuck entry in it (a payload left on a page the engine
    could not free, index/damage.py), a put of that key is refused as
    before, and puts of other keys go on."""
    stuck = KEYS[3]

    def leave_stuck(txn: Any) -> None:
        txn.put("blocks", stuck, b"payload on a damaged page")
        txn.put("quarantine", stuck, b'{"reason": "test", "payload_stuck": true}')

    with ucm_db.open(tmp_path / "s", engine=engine, codec=codec_name) as store:
        store.put(NS, KEYS[:3], payloads("a", 3))
        store._engine.write(leave_stuck)
        with pytest.raises(TierError, match="cannot be stored again") as caught:
            store.put(NS, KEYS[3:], payloads("a")[3:])
        assert "compact" in caught.value.hint
        assert store._tier.count_prefix(KEYS) == 3
        other = NS.block_keys(list(range(500, 500 + 4 * 2)))
        assert store.put(NS, other, payloads("o", 2)).stored == 2
