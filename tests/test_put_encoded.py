"""The Store's one door for blocks already encoded (issue 47 item 2):
``Store.put_encoded``, what an archive import writes through, and
``Store.quarantine``, what ``ucm-db verify --fix`` quarantines through.

Both used to be reached around the Store (``store._tier.put_blocks``,
``store._tier.quarantine``): an import then skipped the store's epoch gate,
its group-durability count and (with a remote) upload queueing. Every
case here goes through the public methods and checks what the store's
own rules give: what reads back, what the commit counted, what is refused.
The remote half (queued and uploaded) is in tests/remote/test_encoded_puts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import ClosedError, ConfigError, CorruptBlockError, Namespace, TierError, codec, maintenance
from ucm_db.store.background import Background

NS = Namespace(model="test/put-encoded", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="test/put-encoded-other", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(100, 100 + 4 * 6))


def payloads(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(4096, b".") for i in range(n)]


def encoded(ns: Namespace, tokens: list[int] = TOKENS, tag: str = "p", *, epoch: int = 0) -> tuple[list[bytes], list[tuple[bytes, bytes | None, bytes]]]:
    """A chain's payloads and its blocks as a store holds them (key, parent, blob)."""
    keys = ns.block_keys(tokens, epoch=epoch)
    values = payloads(tag, len(keys))
    return values, [(key, keys[i - 1] if i else None, codec.encode(key, value)) for i, (key, value) in enumerate(zip(keys, values))]


def test_encoded_blocks_read_back_as_put_would_store_them(tmp_path: Path) -> None:
    values, blocks = encoded(NS)
    with ucm_db.open(tmp_path / "s") as store:
        first = store.put_encoded(NS, blocks[:4])
        assert (first.stored, first.already_present) == (4, 0)
        again = store.put_encoded(NS, blocks)  # the first four are stored: only the rest is written
        assert (again.stored, again.already_present) == (2, 4)
        keys = [key for key, _, _ in blocks]
        assert store.lookup(NS, keys) == len(keys)
        assert store.get(NS, keys) == values
        assert store.stats().namespaces[NS.digest[:16].hex()].blocks == len(keys)
        assert store._tier.check() == []


def test_a_blob_that_does_not_verify_writes_nothing(tmp_path: Path) -> None:
    _, blocks = encoded(NS)
    key, parent, blob = blocks[3]
    damaged = bytearray(blob)
    damaged[-1] ^= 0xFF
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(CorruptBlockError, match="does not verify"):
            store.put_encoded(NS, [*blocks[:3], (key, parent, bytes(damaged))])
        with pytest.raises(CorruptBlockError, match="another key"):
            store.put_encoded(NS, [(blocks[1][0], None, blocks[0][2])])  # a blob under a key not its own
        with pytest.raises(ConfigError):
            store.put_encoded(NS, [(key, parent)])  # type: ignore[list-item]
        with pytest.raises(ConfigError):
            store.put_encoded(NS, blob)  # type: ignore[arg-type]
        assert store.stats().blocks == 0


def test_encoded_puts_follow_the_stores_rules(tmp_path: Path) -> None:
    _, blocks = encoded(NS)
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(ucm_db.MissingAncestorError):
            store.put_encoded(NS, blocks[1:])  # the first block's parent is not stored
        store.put_encoded(NS, blocks)
        with pytest.raises(ConfigError, match="namespace"):
            store.put_encoded(OTHER, blocks)  # keys stored under another namespace
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        with pytest.raises(TierError, match="read-only"):
            store.put_encoded(NS, blocks)
    store = ucm_db.open(tmp_path / "s")
    store.close()
    with pytest.raises(ClosedError):
        store.put_encoded(NS, blocks)


def test_a_namespace_whose_epoch_is_unknown_takes_no_encoded_blocks(tmp_path: Path) -> None:
    _, blocks = encoded(NS)
    with ucm_db.open(tmp_path / "s") as store:
        store.put_encoded(NS, blocks[:2])
        store.bump_epoch(NS)
        name = b"epoch:" + NS.digest[:16]
        store._engine.write(lambda txn: (txn.delete("info", name), txn.delete("info", b"sum:" + name)))  # lost
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(TierError, match="cannot be established"):
            store.put_encoded(NS, blocks)
        assert store.stats().blocks == 2


def test_an_import_is_counted_for_group_durability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import's commits count toward the next group sync, as puts do
    (they went around the Store before: the maintenance thread never heard
    of them, and a large import was synced only at close)."""
    with ucm_db.open(tmp_path / "a") as source:
        source.put(NS, NS.block_keys(TOKENS), payloads("a", len(TOKENS) // 4))
        stored_bytes = source.stats().stored_bytes
    maintenance.export_archive(tmp_path / "a", tmp_path / "x.tar")
    with ucm_db.open(tmp_path / "b", durability="group"):
        pass
    counted: list[int] = []
    real = Background.committed

    def counting(self: Background, committed_bytes: int) -> None:
        counted.append(committed_bytes)
        real(self, committed_bytes)

    monkeypatch.setattr(Background, "committed", counting)
    report = maintenance.import_archive(tmp_path / "x.tar", tmp_path / "b")
    assert report["stored"] == len(TOKENS) // 4 and report["skipped"] == []
    assert sum(counted) == stored_bytes


def test_an_import_leaves_a_namespace_whose_epoch_is_unknown_alone(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "a") as source:
        source.put(NS, NS.block_keys(TOKENS), payloads("a", len(TOKENS) // 4))
        source.put(OTHER, OTHER.block_keys(TOKENS), payloads("o", len(TOKENS) // 4))
    maintenance.export_archive(tmp_path / "a", tmp_path / "x.tar")
    with ucm_db.open(tmp_path / "b") as store:
        store.put(NS, NS.block_keys(TOKENS[:4]), payloads("b", 1))
        name = b"epoch:" + NS.digest[:16]
        store.bump_epoch(NS)
        store._engine.write(lambda txn: (txn.delete("info", name), txn.delete("info", b"sum:" + name)))  # lost
    report = maintenance.import_archive(tmp_path / "x.tar", tmp_path / "b")
    [problem] = report["epoch_problems"]
    assert NS.digest[:16].hex() in problem
    skipped = {row["key"] for row in report["skipped"] if "epoch" in row["reason"]}
    assert skipped == {key.hex() for key in NS.block_keys(TOKENS)}
    assert report["stored"] == len(TOKENS) // 4  # the other namespace's blocks
    with ucm_db.open(tmp_path / "b") as store:
        assert store.stats().namespaces[NS.digest[:16].hex()].blocks == 1


def test_quarantine_rechecks_the_block_unless_told_its_metadata_is_at_fault(tmp_path: Path) -> None:
    values, blocks = encoded(NS)
    keys = [key for key, _, _ in blocks]
    with ucm_db.open(tmp_path / "s") as store:
        store.put_encoded(NS, blocks)
        assert store.quarantine(keys[2], "a check said so") is False  # it reads well: it stays
        assert store.get(NS, keys) == values
        assert store.quarantine(keys[4], "parent cycle", recheck=False) is True
        assert store.lookup(NS, keys) == 4  # it and its descendant went
        assert store._tier.quarantine_records()[keys[4]]["reason"] == "parent cycle"
        assert store._tier.check() == []
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        with pytest.raises(TierError, match="read-only"):
            store.quarantine(keys[0], "no", recheck=False)
