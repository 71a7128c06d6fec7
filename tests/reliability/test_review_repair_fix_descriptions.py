"""`verify --fix` and `compact` beside damaged namespace descriptions (the
fixes of the review of commit 788643b, tests/reliability/test_review_repair_records.py).

A description is never deleted: one that still rebuilds its namespace is
resealed, any other becomes a placeholder (:mod:`ucm_db.index.descriptions`).
So a namespace whose epoch record is lost stays unknown through every fix
path and gets a fresh epoch, never 0: the KV of before an invalidation is
never served again. A placeholder namespace reads as undescribed until its
next put records its description again.

The damage is written through the engine's raw tables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.engines.base import Txn
from ucm_db.index import damage
from ucm_db.migrations.access import open_engine
from ucm_db.store import epochs

from .harness import NS, chain_tokens, payload_for

DESC = b"nsdesc:" + NS.id
EPOCH = b"epoch:" + NS.id
OTHER = Namespace(model="another-model", kv_dtype="bfloat16", block_size=4)


def edit(path: Path, change: Callable[[Txn], object]) -> None:
    engine = open_engine(path)
    try:
        engine.write(change)
    finally:
        engine.close()


def _torn(txn: Txn) -> None:
    value = bytes(txn.get("info", DESC))
    txn.put("info", DESC, value[:-1] + b" ")  # not JSON any more; the sidecar disagrees


#: How the description is damaged, and whether a fix can rebuild it.
DAMAGE: dict[str, tuple[Callable[[Txn], object], bool]] = {
    "whole": (lambda txn: None, True),
    "sidecar": (lambda txn: txn.put("info", b"sum:" + DESC, b"\0" * 8), True),
    "torn": (_torn, False),
    "another namespace's": (lambda txn: txn.put("info", DESC, OTHER.description_json), False),
}


def _fix(path: Path, route: str) -> None:
    if route == "compact, then verify --fix":
        maintenance.compact(path)
        with pytest.raises(epochs.EpochUnknownError), ucm_db.open(path) as store:
            store.epoch(NS)  # compact renews nothing: still unknown, never 0
    assert maintenance.verify(path, fix=True).epochs_renewed == 1


@pytest.mark.parametrize("route", ["verify --fix", "compact, then verify --fix"])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_namespace_whose_epoch_record_is_lost_gets_a_fresh_epoch_whatever_its_description(
    tmp_path: Path, kind: str, route: str,
) -> None:
    path = tmp_path / "s"
    tokens = chain_tokens("fix-desc-" + kind, 3)
    stale = NS.block_keys(tokens, epoch=0)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, stale, [payload_for(k, 3000) for k in stale])
        assert store.bump_epoch(NS) == 1  # a weight update: the blocks above are never served again
    spoil, rebuildable = DAMAGE[kind]

    def damage_and_lose_epoch(txn: Txn) -> None:
        spoil(txn)
        txn.delete("info", EPOCH)
        txn.delete("info", b"sum:" + EPOCH)
    edit(path, damage_and_lose_epoch)

    _fix(path, route)
    again = maintenance.verify(path)
    assert not again.problems, again.index_problems
    with ucm_db.open(path) as store:
        epoch = store.epoch(NS)
        assert epoch >= epochs.FRESH_EPOCH_BASE, epoch  # fresh: never 0, never a reused one
        assert store.lookup(NS, NS.block_keys(tokens, epoch=epoch), remote=False) == 0
        described = store._tier.namespace_descriptions()
    assert (described.get(NS.id) == NS.to_dict()) is rebuildable, described


def test_a_placeholder_namespace_is_undescribed_until_its_next_put_describes_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("fix-placeholder", 3))
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    edit(path, _torn)

    fixed = maintenance.verify(path, fix=True)
    assert fixed.index_repaired.get("descriptions_lost") == 1, fixed.index_repaired
    assert not maintenance.verify(path).problems
    rows = maintenance.inspect(path)["namespaces"]
    assert [(row["id"], row["model"]) for row in rows] == [(NS.id.hex(), None)]  # undescribed, still held
    with pytest.raises(ucm_db.ConfigError) as caught:
        maintenance.invalidate(path, (NS.model,))
    assert f"{NS.id.hex()} (undescribed" in (caught.value.hint or "") and "verify --fix" in (caught.value.hint or "")

    more = NS.block_keys(chain_tokens("fix-placeholder-next", 2))
    with ucm_db.open(path) as store:
        store.put(NS, more, [payload_for(k, 3000) for k in more])
        assert store._tier.namespace_descriptions() == {NS.id: NS.to_dict()}
    assert maintenance.invalidate(path, (NS.model,))[0]["epoch"] == 1
    assert not maintenance.verify(path).problems


def test_a_rewritten_creation_record_names_no_made_up_creation(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30):
        pass
    edit(path, lambda txn: txn.put("info", b"created", b"{torn"))

    assert maintenance.verify(path, fix=True).index_repaired.get("records_rewritten") == 1
    assert not maintenance.verify(path).problems
    created = maintenance.inspect(path)["created"]
    assert "created_ns" not in created and "ucm_db_version" not in created, created
    assert created["format_version"] >= 1 and "verify --fix" in created["rewritten"]["by"], created


def test_orphans_dropped_counts_only_the_orphans_it_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key evicted whole between the scan for orphans and their drop is no
    orphan. The scan's answer is the stand-in here (it names a key that is
    gone): the window between its read transaction and the drop's write
    transaction is not reachable from outside."""
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("fix-orphans", 2))
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    edit(path, lambda txn: txn.delete("meta", keys[1]))  # its payload and head are orphans now
    gone = bytes(32)
    monkeypatch.setattr(damage, "_orphan_payload_keys", lambda txn: [keys[1], gone])
    with ucm_db.open(path) as store:
        assert store._tier.damage.drop_orphan_payloads() == (1, 0)
        assert store._engine.read(lambda txn: (txn.get("blocks", keys[1]), txn.get("heads", keys[1]))) == (None, None)


def test_the_epoch_hint_names_verify_fix_too(tmp_path: Path) -> None:
    error = epochs.unknown_error(NS.id, "lost", str(tmp_path))
    assert f"ucm-db verify --fix {tmp_path}" in (error.hint or "") and f"--namespace {NS.id.hex()}" in (error.hint or "")
