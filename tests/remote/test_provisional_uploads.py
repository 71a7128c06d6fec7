"""With a write-back remote, a provisional block reaches the remote only once
its writer settles its tag (ucm_db/index/provisional.py): other nodes are
never served what a dead writer stored, nor what a void took back. A
write-through put uploads at once (its caller's contract).

Real stores with a ``file://`` remote. Checked: a tagged put uploads
nothing, its settle queues and uploads it; a block stored below a held one
by an untagged put stays queued (the ancestor repair neither sends it nor
its held parent) and goes once the parent is settled; a void (delete, then
settle) uploads nothing and leaves the queue empty; a sweep of a dead
owner's held blocks leaves nothing queued or uploaded; a write-through put
of a tagged block uploads it before it returns. The killed-writer cases are
tests/test_provisional_puts.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db.index import provisional as marks

NS = ucm_db.Namespace(model="provisional-uploads", kv_dtype="bfloat16", block_size=4)
UNIT = 4096
OPTIONS = {"capacity_bytes": 64 << 20, "codec": "none", "sync_interval_s": 0.2}


def _chain(seed: int, blocks: int) -> ucm_db.BlockKeys:
    return NS.block_keys(list(range(seed, seed + 4 * blocks)))


def _payloads(keys: ucm_db.BlockKeys) -> list[bytes]:
    return [bytes([key[0]]) * UNIT for key in keys]


def _objects(shared: Path, keys: ucm_db.BlockKeys) -> list[bool]:
    return [(shared / NS.short_id / key[:1].hex() / key.hex()).exists() for key in keys]


@pytest.fixture
def remote_store(tmp_path: Path) -> Iterator[tuple[ucm_db.Store, Path]]:
    shared = tmp_path / "remote"
    with ucm_db.open(tmp_path / "s", **OPTIONS, remote=f"file://{shared}", remote_mode="write_back") as store:
        yield store, shared


def _put(store: ucm_db.Store, keys: ucm_db.BlockKeys, tag: bytes | None) -> None:
    provisional_tags = {key: tag for key in keys} if tag is not None else None
    store.put_segments(NS, [(keys, _payloads(keys))], provisional=provisional_tags)


def test_a_tagged_put_uploads_nothing_until_its_settle(remote_store: tuple[ucm_db.Store, Path]) -> None:
    store, shared = remote_store
    owner = store.provisional_owner()
    keys, tag = _chain(0, 3), owner.tag()
    _put(store, keys, tag)
    store.flush(upload_timeout_s=30)
    assert _objects(shared, keys) == [False] * 3, "a provisional block was uploaded before its settle"
    owner.settle([tag])
    store.flush(upload_timeout_s=30)
    assert _objects(shared, keys) == [True] * 3, "a settled block was never uploaded"
    owner.close()


def test_a_block_below_a_held_one_waits_for_the_settle(remote_store: tuple[ucm_db.Store, Path]) -> None:
    store, shared = remote_store
    owner = store.provisional_owner()
    chain, tag = _chain(100, 4), owner.tag()
    _put(store, chain[:2], tag)
    store.put(NS, chain[2:], _payloads(chain[2:]))  # untagged, queued: its parent is held
    with pytest.raises(ucm_db.TierError, match="waiting for upload"):
        store.flush(upload_timeout_s=1.5)
    assert _objects(shared, chain) == [False] * 4, "the ancestor repair sent a held block or what hangs under it"
    owner.settle([tag])
    store.flush(upload_timeout_s=30)
    assert _objects(shared, chain) == [True] * 4
    owner.close()


def test_a_void_uploads_nothing_and_leaves_no_row(remote_store: tuple[ucm_db.Store, Path]) -> None:
    store, shared = remote_store
    owner = store.provisional_owner()
    keys, tag = _chain(200, 2), owner.tag()
    _put(store, keys, tag)
    store.delete(NS, list(keys))  # the void: its load failed, so these are wrong
    owner.settle([tag])
    store.flush(upload_timeout_s=30)
    assert _objects(shared, keys) == [False, False]
    with ucm_db.open(shared.parent / "other", **OPTIONS, remote=f"file://{shared}") as other:
        assert other.lookup(NS, keys) == 0
    owner.close()


def test_a_sweep_leaves_nothing_held_queued_or_uploaded(tmp_path: Path) -> None:
    shared, path = tmp_path / "remote", tmp_path / "s"
    remote = {"remote": f"file://{shared}", "remote_mode": "write_back"}
    with ucm_db.open(path, **OPTIONS, **remote) as store:
        owner = store.provisional_owner()
        chain = _chain(300, 3)
        _put(store, chain[:2], owner.tag())
        store.put(NS, chain[2:], _payloads(chain[2:]))
        owner.close()  # gone without settling: the next open's sweep takes its blocks
    with ucm_db.open(path, **OPTIONS, **remote) as store:
        assert store.lookup(NS, chain, remote=False) == 0
        store.flush(upload_timeout_s=30)
        engine = store._state.engine  # noqa: SLF001 - the held rows are the index's own
        assert engine.read(lambda txn: list(txn.scan("info", marks.HELD_PREFIX))) == []
        assert engine.read(lambda txn: list(txn.scan("uploads"))) == []
    assert _objects(shared, chain) == [False] * 3


def test_a_write_through_put_uploads_tagged_blocks_at_once(tmp_path: Path) -> None:
    shared = tmp_path / "remote"
    with ucm_db.open(tmp_path / "s", **OPTIONS, remote=f"file://{shared}", remote_mode="write_through") as store:
        owner = store.provisional_owner()
        keys, tag = _chain(400, 2), owner.tag()
        _put(store, keys, tag)
        assert _objects(shared, keys) == [True, True], "a write-through put returned before its upload"
        store.delete(NS, list(keys), remote=True)  # a void retracts them there
        owner.settle([tag])
        store.flush(upload_timeout_s=30)
        assert _objects(shared, keys) == [False, False]
        owner.close()
