"""A follower of ``ucm-db events`` resumed from a saved seq learns of an
epoch move it did not see (:mod:`ucm_db.store.epoch_moves`), and only of
those: a cursor past the move, or a namespace's first epoch, costs no resync.
"""

from __future__ import annotations

from pathlib import Path

import ucm_db
from ucm_db import BlockEventFields, Namespace, maintenance
from ucm_db.index import epoch_moves, records

NS = Namespace(model="epoch-moves", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="epoch-moves-other", kv_dtype="bfloat16", block_size=4)


def put_evented(store: ucm_db.Store, namespace: Namespace, tokens: list[int]) -> list[bytes]:
    epoch = store.epoch(namespace)
    keys = namespace.block_keys(tokens, epoch=epoch)
    fields = {k: BlockEventFields(b"h" + k[:15], None, tuple(tokens[4 * i:4 * i + 4]), 4, epoch=epoch)
              for i, k in enumerate(keys)}
    store.put(namespace, keys, [b"x" * 64] * len(keys), event_fields=fields)
    return list(keys)


def stored_then_followed(path: Path, *, move: bool) -> dict[str, object]:
    """A store with one evented chain (then, with ``move``, an epoch move and a chain at the new epoch); returns
    the cursor a follower saves: the last line of the inventory."""
    with ucm_db.open(path) as store:
        put_evented(store, NS, [1, 2, 3, 4])
        if move:
            store.bump_epoch(NS)
            put_evented(store, NS, [5, 6, 7, 8])
    return list(maintenance.iter_events(path, with_feed_id=True))[-1]


def resumed(path: Path, cursor: dict[str, object]) -> list[dict[str, object]]:
    return list(maintenance.iter_events(path, since_seq=int(cursor["seq"]), feed_id=str(cursor["feed_id"])))  # type: ignore[call-overload]


def test_a_follower_resumed_before_a_move_is_cleared_and_told_the_inventory(tmp_path: Path) -> None:
    path = tmp_path / "s"
    cursor = stored_then_followed(path, move=False)
    with ucm_db.open(path) as store:
        store.bump_epoch(NS)
        new = put_evented(store, NS, [5, 6, 7, 8])
    events = resumed(path, cursor)
    assert events[0]["type"] == "AllBlocksCleared"
    assert [bytes.fromhex(str(e["key"])) for e in events[1:]] == new


def test_a_follower_resumed_after_the_move_reads_on_without_a_resync(tmp_path: Path) -> None:
    path = tmp_path / "s"
    cursor = stored_then_followed(path, move=True)  # the inventory, after the move
    with ucm_db.open(path) as store:
        later = put_evented(store, NS, [9, 10, 11, 12])
    events = resumed(path, cursor)
    assert all(e["type"] == "BlockStored" for e in events)
    assert later[0] in {bytes.fromhex(str(e["key"])) for e in events}


def test_a_new_namespace_and_another_namespace_s_follower_cost_no_resync(tmp_path: Path) -> None:
    path = tmp_path / "s"
    cursor = stored_then_followed(path, move=False)
    with ucm_db.open(path) as store:
        put_evented(store, OTHER, [1, 2, 3, 4])  # its first epoch: no move
        store.bump_epoch(OTHER)
        put_evented(store, NS, [5, 6, 7, 8])
    only_ns = list(maintenance.iter_events(path, (NS.id.hex(),), since_seq=int(cursor["seq"]),  # type: ignore[call-overload]
                                           feed_id=str(cursor["feed_id"])))
    assert only_ns and all(e["type"] == "BlockStored" for e in only_ns)
    assert resumed(path, cursor)[0]["type"] == "AllBlocksCleared"  # every namespace's follower: OTHER moved


def test_a_damaged_move_record_counts_as_a_move_until_verify_fix_records_it_again(tmp_path: Path) -> None:
    path = tmp_path / "s"
    cursor = stored_then_followed(path, move=True)
    with ucm_db.open(path) as store:
        name = epoch_moves.MOVED_PREFIX + NS.id
        store._tier.engine.write(lambda txn: txn.put(records.INFO, name, b"\xff" * 8))  # the checksum no longer agrees
    assert resumed(path, cursor)[0]["type"] == "AllBlocksCleared"
    found = maintenance.verify(path)
    assert [p for p in found.index_problems if "epoch move record" in p], found.index_problems
    assert maintenance.verify(path, fix=True).feed_repaired
    assert not maintenance.verify(path).index_problems
    with ucm_db.open(path) as store:
        put_evented(store, NS, [9, 10, 11, 12])
    cursor = list(maintenance.iter_events(path, with_feed_id=True))[-1]  # past the move recorded again
    assert all(e["type"] == "BlockStored" for e in resumed(path, cursor))


def test_an_epoch_record_lost_and_renewed_by_verify_fix_counts_as_a_move(tmp_path: Path) -> None:
    """A record removed by damage outside ucm-db (the store is sealed: its blocks read as a lost epoch) gets a fresh
    epoch from ``verify --fix``; a follower resumed from before that holds the lost epoch's blocks and resyncs."""
    path = tmp_path / "s"
    cursor = stored_then_followed(path, move=False)
    with ucm_db.open(path) as store:
        name = b"epoch:" + NS.id
        assert store._tier.engine.read(lambda txn: txn.get(records.INFO, name)) is not None
        store._tier.engine.write(lambda txn: txn.delete(records.INFO, name))
    assert maintenance.verify(path, fix=True).epochs_renewed == 1
    with ucm_db.open(path) as store:
        new = put_evented(store, NS, [5, 6, 7, 8])
    events = resumed(path, cursor)
    assert events[0]["type"] == "AllBlocksCleared"
    assert [bytes.fromhex(str(e["key"])) for e in events[1:]] == new
