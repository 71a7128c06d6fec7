"""Reset and invalidation with the real scheduler and worker halves, a real
store and CPU KV tensors (connector/epochs.py): ``reset_cache`` moves the
namespace epoch on, lookups of every scheduler on the store see it from
their next step, a request running across the reset saves nothing more, and
the metadata carries the epoch to the workers; the engine that reset keys
its blocks apart from every other engine's (its weights may have changed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.epochs import private_epoch  # noqa: E402
from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _save_prompt, _shape  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))  # 4 blocks: 3 claimable


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})


def test_reset_hides_old_blocks_from_every_scheduler_until_stored_again(settings: ConnectorSettings) -> None:
    _save_prompt(settings, TOKENS, _kv())
    this, other = UcmDbScheduler(settings, _shape()), UcmDbScheduler(settings, _shape())
    assert other.get_num_new_matched_tokens(_request("o1", TOKENS), 0) == (3 * BS, False)
    assert this.reset_cache() is True
    assert this.get_num_new_matched_tokens(_request("t1", TOKENS), 0) == (0, False)
    # The other engine reads the epoch once per step: from its next step on, no stale hit.
    other.build_connector_meta(_new_step(_request("o2", TOKENS), [0], 1))
    assert other.get_num_new_matched_tokens(_request("o3", TOKENS), 0) == (0, False)
    # A restarted engine reads it from the store.
    restarted = UcmDbScheduler(settings, _shape())
    assert restarted.get_num_new_matched_tokens(_request("r1", TOKENS), 0) == (0, False)
    assert this.store.epoch(namespace(_shape())) == 1  # the store the connector's halves share in this process
    _save_prompt(settings, TOKENS, _kv())  # computed again by an engine on the model's files, stored at epoch 1
    for sched in (other, restarted):
        sched.build_connector_meta(_new_step(_request("x", TOKENS), [0], 1))
        assert sched.get_num_new_matched_tokens(_request("again", TOKENS), 0) == (3 * BS, False)
        sched.shutdown()
    # The engine that reset may run updated weights: it is served none of theirs.
    this.build_connector_meta(_new_step(_request("x", TOKENS), [0], 1))
    assert this.epoch is not None and this.epoch >= 1 << 63
    assert this.get_num_new_matched_tokens(_request("again", TOKENS), 0) == (0, False)
    this.shutdown()


def test_blocks_an_engine_stores_after_its_reset_are_never_served_to_another_engine(settings: ConnectorSettings) -> None:
    """vLLM resets the connector after a weight update: the KV the updated
    engine computes must not reach an engine (or a restart) on the files."""
    updated = UcmDbScheduler(settings, _shape())
    assert updated.reset_cache() is True
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    req = _request("u", TOKENS)
    _admit(updated, req)
    meta = updated.build_connector_meta(_new_step(req, [4, 5, 6, 7, 8], len(TOKENS)))
    (save,) = meta.saves
    assert meta.epoch == updated.epoch and save.keys == tuple(namespace(_shape()).block_keys(TOKENS, epoch=updated.epoch))
    worker.start_load(meta)
    worker.save(meta)
    worker.drain()
    updated.request_finished(req, [4, 5, 6, 7, 8])
    updated.build_connector_meta(_new_step(_request("x", TOKENS), [0], 1))
    assert updated.get_num_new_matched_tokens(_request("u1", TOKENS), 0) == (3 * BS, False)  # stored, for itself
    for other in (UcmDbScheduler(settings, _shape()), UcmDbScheduler(settings, _shape())):
        assert other.get_num_new_matched_tokens(_request("o", TOKENS), 0) == (0, False)
        other.shutdown()
    # A second reset (another update) draws anew: the first update's blocks are not served either.
    first = updated.epoch
    assert updated.reset_cache() is True and updated.epoch not in (first, 2) and updated.store.epoch(namespace(_shape())) == 2
    assert updated.get_num_new_matched_tokens(_request("u2", TOKENS), 0) == (0, False)
    worker.shutdown()
    updated.shutdown()


def test_a_private_epoch_follows_the_stores_and_never_meets_a_count() -> None:
    token = b"t" * 16
    assert private_epoch(1, token) == private_epoch(1, token) >= 1 << 63
    assert private_epoch(2, token) != private_epoch(1, token) != private_epoch(1, b"u" * 16)


def test_a_request_running_across_a_reset_saves_nothing_more_and_workers_learn_the_epoch(settings: ConnectorSettings) -> None:
    sched = UcmDbScheduler(settings, _shape())
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    req = _request("run", TOKENS)
    _admit(sched, req)
    meta = sched.build_connector_meta(_new_step(req, [4, 5, 6, 7, 8], 40))
    assert len(meta.saves) == 1 and meta.epoch == 0
    req.num_computed_tokens = 40
    assert sched.reset_cache() is True
    step = _new_step(req, [4, 5, 6, 7, 8], len(TOKENS) - 40)
    step.scheduled_new_reqs = []
    meta = sched.build_connector_meta(step)
    assert meta.saves == [] and meta.epoch == sched.epoch >= 1 << 63  # its KV predates the reset: never stored anew
    worker.start_load(meta)
    assert worker._epoch == sched.epoch
    # Preempted and back (vLLM computes it from 0): a new key chain at the new epoch, saved again.
    req.num_computed_tokens = 0
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(_new_step(req, [9, 10, 11, 12, 13], len(TOKENS)))
    (save,) = meta.saves
    assert save.keys == tuple(namespace(_shape()).block_keys(TOKENS, epoch=sched.epoch))
    worker.shutdown()
    sched.shutdown()


def test_a_damaged_epoch_record_claims_and_saves_nothing(settings: ConnectorSettings) -> None:
    _save_prompt(settings, TOKENS, _kv())
    with ucm_db.open(settings.path) as store:
        ns = namespace(_shape())
        store.bump_epoch(ns)
        store._tier.engine.write(lambda txn: txn.put("info", b"epoch:" + ns.digest[:16], bytes(8)))  # fails its checksum
    sched = UcmDbScheduler(settings, _shape())
    req = _request("d", TOKENS)
    assert _admit(sched, req) == 0
    meta = sched.build_connector_meta(_new_step(req, [0, 1, 2, 3, 4], len(TOKENS)))
    assert meta.saves == [] and meta.epoch == -1
    assert sched.reset_cache() is True  # a bump records a new epoch over the damage
    sched.build_connector_meta(_new_step(_request("e", TOKENS), [0], 1))
    assert sched.get_num_new_matched_tokens(_request("f", TOKENS), 0) == (0, False)
    sched.shutdown()


def test_reset_on_a_read_only_store_reports_failure(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ucm_db.open(path).close()
    settings = ConnectorSettings.from_extra_config({"path": str(path), "read_only": True})
    sched = UcmDbScheduler(settings, _shape())
    assert sched.reset_cache() is False
    assert sched.epoch is not None and sched.epoch >= 1 << 63  # its weights may have changed: keyed apart all the same
    sched.shutdown()


def test_a_request_back_with_its_kv_across_a_reset_saves_nothing_more(settings: ConnectorSettings) -> None:
    """A request that comes back to the allocator holding KV computed (or
    loaded) before a reset (back from an async load: vLLM asks for no lookup,
    only ``update_state_after_alloc``) keeps its old-epoch state: its blocks
    are never saved under the new epoch's keys."""
    sched = UcmDbScheduler(settings, _shape())
    req = _request("back", TOKENS)
    _admit(sched, req)
    sched.build_connector_meta(_new_step(req, [4, 5, 6, 7, 8], 2 * BS))
    req.num_computed_tokens = 2 * BS
    assert sched.reset_cache() is True
    sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    step = _new_step(req, [4, 5, 6, 7, 8], len(TOKENS) - 2 * BS)
    step.scheduled_new_reqs = []
    meta = sched.build_connector_meta(step)
    assert meta.saves == [] and meta.epoch == sched.epoch >= 1 << 63
    sched.shutdown()
