"""The scheduler's namespace travels in every step's metadata, and a worker
that derived another one (their vLLM configs differ: a bug, never a choice)
loads and saves nothing from then on (connector/worker/hooks.py): a
worker must never read another model's blocks into its KV cache, nor store
its own under the scheduler's keys. Real scheduler and worker halves, a
real store, CPU KV tensors."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.test_request_controls import BS, NUM_BLOCKS, SHAPE, Engine, _kv, _prefill_step, _request  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402


def test_a_worker_of_another_namespace_refuses_the_schedulers_loads_and_saves(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_policy": "always"})
    tokens = list(range(1, 4 * BS + 10))
    same = Engine(settings)
    assert same.prefill(_request(tokens))[0] == 0  # stored under the scheduler's namespace
    stored = same.stored_units()
    same.close()

    scheduler = UcmDbScheduler(settings, SHAPE)
    worker = UcmDbWorker(settings, dataclasses.replace(SHAPE, extra='{"dtype":"float16"}'), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    try:
        req = _request(tokens + [3] * BS)
        hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
        assert hit == 4 * BS  # the scheduler's own namespace holds these blocks
        scheduler.update_state_after_alloc(req, None, hit)  # type: ignore[arg-type]
        req.num_computed_tokens = hit
        block_ids = list(range(req.num_tokens // BS + 1))
        meta = scheduler.build_connector_meta(_prefill_step(req, block_ids, req.num_tokens - hit))
        assert meta.namespace == scheduler._namespace.id and meta.loads and meta.saves
        with caplog.at_level(logging.ERROR, logger="vllm.ucm_db.connector.worker.hooks"):
            worker.start_load(meta)
            worker.finish_loads()
        assert "not this worker's" in caplog.text
        assert worker.take_load_errors() == set(block_ids[:4])  # every claimed block fails: vLLM recomputes it
        worker.save(meta)
        worker.drain()
        assert scheduler.store.stats().blocks == stored  # the new block was not saved under the scheduler's keys
    finally:
        worker.shutdown()
        scheduler.shutdown()
