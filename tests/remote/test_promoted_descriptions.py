"""Blocks promoted from the remote describe their namespace, as a put does
(audit: a store filled by ``warm`` or by read-through had namespaces with no
description, so ``invalidate``, ``lookup``, ``pin`` and ``export`` could not
select them by model: an invalidation after a weight update could not reach
a kv_consumer node or a warmed one).

Every test runs real LMDB stores against a real remote tier on a local
directory (fsspec ``file://``): node A writes through to it, node B reads
from it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.errors import ConfigError
from ucm_db.index.local import BlockEntry
from ucm_db.store.view import open_view, select_namespaces

N_BLOCKS = 8
NS = Namespace(model="model-x", kv_dtype="bfloat16", block_size=4, layout="test")
OTHER = Namespace(model="model-y", kv_dtype="bfloat16", block_size=4, layout="test")
PROMPT = [(31 * i + 7) % 50_000 for i in range(N_BLOCKS * NS.block_size)]


def _payloads(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 512 + bytes(1536) for i in range(n)]


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A remote holding one 8-block chain of ``NS``, written through by node A."""
    url = f"file://{tmp_path / 'shared'}"
    with ucm_db.open(tmp_path / "a", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as a:
        a.put(NS, NS.block_keys(PROMPT), _payloads(N_BLOCKS))
    return url


def _described(path: Path) -> dict[str, dict]:
    with ucm_db.open(path) as store:
        return {ns_id: row.description for ns_id, row in store.stats().namespaces.items()}


def _read_through(store: ucm_db.Store, how: str) -> None:
    keys = NS.block_keys(PROMPT, epoch=store.epoch(NS))
    if how == "lookup":
        assert store.lookup(NS, keys, remote_deadline_s=10) == N_BLOCKS
    elif how == "get":
        assert store.get(NS, keys) == [bytearray(p) for p in _payloads(N_BLOCKS)]
    else:
        assert store.warm(NS, token_sequences=[PROMPT]).fetched == N_BLOCKS
    assert store.lookup(NS, keys, remote=False) == N_BLOCKS  # promoted: local now


@pytest.mark.parametrize("how", ["lookup", "get", "warm"])
def test_promotion_records_the_namespace_description(tmp_path: Path, url: str, how: str) -> None:
    """Before the fix: no description (``{}``), and ``invalidate --namespace
    model-x`` said "no namespace matches 'model-x' (... the store has: none)"."""
    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        _read_through(b, how)
    assert _described(tmp_path / "b") == {NS.id.hex(): NS.to_dict()}

    assert maintenance.lookup(tmp_path / "b", "model-x", [PROMPT])["prompts"][0]["stored_blocks"] == N_BLOCKS
    [row] = maintenance.invalidate(tmp_path / "b", ("model-x",), remote=url)  # shared with it: claimed there
    assert row == {"namespace": NS.id.hex(), "model": "model-x", "epoch": 1, "remote": "claimed"}
    # The invalidation reached this consumer node: its old blocks are not served again.
    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        epoch = b.epoch(NS)
        assert epoch >= 1
        assert b.lookup(NS, NS.block_keys(PROMPT, epoch=epoch), remote_deadline_s=10) == 0


def test_a_background_continuation_records_the_description(tmp_path: Path, url: str) -> None:
    """The part of a lookup's prefix promoted later, on the promotion thread,
    goes through the same door."""
    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        b.put(OTHER, OTHER.block_keys(PROMPT[:4]), _payloads(1))  # the store is sealed by its first put
        from ucm_db.remote.promotion import PromotionTarget

        keys = NS.block_keys(PROMPT, epoch=b.epoch(NS))
        wing = b._wing
        assert wing is not None
        assert wing.continuations.continue_later(b._tier, PromotionTarget(NS, b._epochs.before_put), list(keys), None)
        end = time.monotonic() + 20
        while b.lookup(NS, keys, remote=False) < N_BLOCKS and time.monotonic() < end:
            time.sleep(0.02)
        assert b.lookup(NS, keys, remote=False) == N_BLOCKS
    assert _described(tmp_path / "b")[NS.id.hex()] == NS.to_dict()
    with ucm_db.open(tmp_path / "b") as b:
        assert b.lookup(NS, NS.block_keys(PROMPT, epoch=b.epoch(NS))) == N_BLOCKS


@pytest.mark.parametrize("how", ["lookup", "get", "warm"])
def test_promotion_into_a_sealed_store_keeps_the_namespace_served(tmp_path: Path, url: str, how: str) -> None:
    """A described namespace without an epoch record reads as lost in a
    sealed store (store/epochs.py): promotion registers the epoch as a put
    does, so a node that only reads through still serves what it promoted
    after a restart, and ``verify`` finds no epoch problem."""
    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        b.put(OTHER, OTHER.block_keys(PROMPT[:4]), _payloads(1))  # seals the store
        _read_through(b, how)
    with ucm_db.open(tmp_path / "b") as b:  # no remote: served from the local tier alone
        assert b.lookup(NS, NS.block_keys(PROMPT, epoch=b.epoch(NS))) == N_BLOCKS
    assert maintenance.inspect(tmp_path / "b")["epoch_problems"] == []


def test_objects_of_another_namespace_are_never_described_as_it(tmp_path: Path, url: str) -> None:
    """A target's description is its namespace's own; objects of any other
    namespace are not promoted under it (nothing written)."""
    from ucm_db.remote.promotion import PromotionTarget, promote

    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        assert b._wing is not None
        run = b._wing.link.fetch_run(NS.id, NS.block_keys(PROMPT), None, time.monotonic() + 10)
        assert run is not None and len(run[0]) == N_BLOCKS
        registered: list[Namespace] = []
        assert promote(b._tier, run[0], PromotionTarget(OTHER, registered.append)) == 0
        assert registered == [] and b._tier.namespace_descriptions() == {}
        assert promote(b._tier, run[0], PromotionTarget(NS, registered.append)) == N_BLOCKS
        assert registered == [NS] and b._tier.namespace_descriptions() == {NS.id: NS.to_dict()}


def _undescribed_store(path: Path, url: str, n_blocks: int) -> None:
    """A store as ucm-db before the fix left it: ``n_blocks`` of the chain
    promoted with no namespace description."""
    with ucm_db.open(path, remote=url, capacity_bytes=1 << 26) as b:
        assert b._wing is not None
        objects, _ = b._wing.link.fetch_run(NS.id, NS.block_keys(PROMPT)[:n_blocks], None, time.monotonic() + 10) or ([], False)
        b._tier.put_blocks([BlockEntry.of_blob(o.key, o.parent, o.blob, o.raw_bytes, o.namespace_id) for o in objects])
    assert _described(path) == {NS.id.hex(): {}}


def test_an_undescribed_namespace_is_selected_by_its_full_id_only(tmp_path: Path, url: str) -> None:
    """Stores filled by the old code: the whole id selects the namespace
    where the caller can do without its description; the error that nothing
    matches lists it as undescribed (before: "the store has: none")."""
    _undescribed_store(tmp_path / "b", url, N_BLOCKS)
    with open_view(tmp_path / "b") as view:
        assert select_namespaces(view, (NS.id.hex(),), undescribed=True) == {NS.id}
        assert select_namespaces(view, (NS.id.hex().upper(),), undescribed=True) == {NS.id}
        for wanted, flag in ((NS.id.hex(), False), (NS.id.hex()[:16], True), ("model-x", True)):
            with pytest.raises(ConfigError) as caught:
                select_namespaces(view, (wanted,), undescribed=flag)
            assert f"{NS.id.hex()} (undescribed" in (caught.value.hint or "")


def test_an_undescribed_namespace_is_described_by_its_next_promotion(tmp_path: Path, url: str) -> None:
    """A store the old code filled heals with traffic: the next promotion of
    the namespace records its description, and invalidate finds it by model."""
    _undescribed_store(tmp_path / "b", url, 4)
    with pytest.raises(ConfigError, match="no namespace matches 'model-x'"):
        maintenance.invalidate(tmp_path / "b", ("model-x",))
    with ucm_db.open(tmp_path / "b", remote=url, capacity_bytes=1 << 26) as b:
        assert b.lookup(NS, NS.block_keys(PROMPT), remote_deadline_s=10) == N_BLOCKS  # promotes blocks 4..7
    assert _described(tmp_path / "b") == {NS.id.hex(): NS.to_dict()}
    assert maintenance.invalidate(tmp_path / "b", ("model-x",), remote=url)[0]["epoch"] == 1
