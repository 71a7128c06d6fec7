"""Under vLLM's async scheduling every ucm-db claim loads asynchronously
(audit finding 2, wrong KV saved).

With async scheduling (vLLM's default on GPU) step N+1 is planned, and runs,
before step N's output is back. A synchronous load (``load_mode`` ``block``
or ``layer``) that fails in step N, the step that ends a request's prefill,
is reported while its first decode step is in flight: vLLM rewinds the
request to the failed block, but the runner's token table holds the
placeholder it gave the in-flight step, so the scheduler's tokens and the
KV drift apart by one position; the outputs go wrong, and ucm-db stored the
decode block's KV under the scheduler's tokens. An async claim never gets
there: vLLM holds the request while the load runs and computes nothing over
it, and a failed one is recomputed from the failed block. So under async
scheduling every claim is async, whatever ``load_mode`` says, a request's
later claims too (a sync one would bring the drift back), and a request
whose async load failed claims no further than the block that failed (its
claims cannot fail the same way forever).

Real parts: vLLM's AsyncScheduler / Scheduler, both halves of ucm-db's
connector, a real store; the model runner is the stand-in of
stand_in_engine.py (KV depends on every KV read; outputs and stored blocks
checked exactly).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, lose_unit, stored_blocks  # noqa: E402

_RNG = random.Random(7)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(5 * BS + 3)]  # 5 whole blocks


def _stored_prompt(root: Path) -> Path:
    store = root / "store"
    writer = StandInEngine(root, store)
    writer.add("w", PROMPT, 4)
    writer.run()
    writer.close()
    return store


def _lose_block_2_of_the_first_load(engine: StandInEngine) -> None:
    def lose(meta: Any) -> None:
        loads = meta.loads or meta.async_loads
        if not loads:
            engine.runner.before_load = lose
            return
        lose_unit(engine, loads[0], 2)
    engine.runner.before_load = lose


@pytest.mark.parametrize(("load_mode", "async_scheduling"), [("block", True), ("layer", True), ("block", False)])
def test_a_load_failing_under_async_scheduling_leaves_outputs_and_store_right(
        tmp_path: Path, load_mode: str, async_scheduling: bool) -> None:
    store = _stored_prompt(tmp_path)
    engine = StandInEngine(tmp_path, store, overlapped=async_scheduling, extra={"load_mode": load_mode})
    _lose_block_2_of_the_first_load(engine)
    engine.add("R", PROMPT, 40)
    engine.run()
    outputs = engine.outputs["R"]
    metas = [so.kv_connector_metadata for so in engine.scheduled]
    engine.close()
    assert len(engine.runner.invalid_seen) == 3  # block 2 failed, with the blocks after it in its load
    if async_scheduling:
        assert not any(meta.loads for meta in metas) and sum(len(meta.async_loads) for meta in metas) == 1
    else:  # without async scheduling nothing changes: the mode's synchronous claim
        assert sum(len(meta.loads) for meta in metas) == 1 and not any(meta.async_loads for meta in metas)
    assert outputs == greedy(PROMPT, 40)
    right, wrong = stored_blocks(tmp_path, store, PROMPT + outputs)
    assert wrong == [] and right == (len(PROMPT) + 39) // BS


@pytest.mark.parametrize("load_mode", ["block", "async"])
def test_under_async_scheduling_a_later_claim_is_async_and_stops_before_a_block_that_failed(
        tmp_path: Path, load_mode: str) -> None:
    """R's async load fails at block 2; vLLM keeps blocks 0-1 and recomputes
    the rest. Asked again (as vLLM asks when it resumes R after a
    preemption), ucm-db claims blocks 0-1 only, asynchronously again (with
    ``load_mode: "async"`` a request's later claims used to be synchronous)."""
    store = _stored_prompt(tmp_path)
    engine = StandInEngine(tmp_path, store, overlapped=True, extra={"load_mode": load_mode})
    _lose_block_2_of_the_first_load(engine)
    request = engine.add("R", PROMPT, 40)
    while len(engine.outputs.get("R", ())) < 8:
        engine.step()
    engine.runner.connector._worker.drain()  # type: ignore[union-attr]  # R's recomputed blocks are stored again
    try:
        assert len(engine.runner.invalid_seen) == 3
        assert engine.ours.get_num_new_matched_tokens(request, 0) == (2 * BS, True)
    finally:
        engine.close()


@pytest.mark.parametrize(("async_scheduling", "pipeline_stages", "overlap"),
                         [(False, 1, False), (True, 1, True), (False, 2, True)])
def test_a_pipeline_parallel_batch_queue_makes_every_claim_async(
        tmp_path: Path, async_scheduling: bool, pipeline_stages: int, overlap: bool) -> None:
    """A pipeline-parallel engine keeps one batch in flight a stage, so its
    steps overlap without async scheduling: a synchronous load failing there
    is reported after the next step computed over it, which the stale-block
    tracker cannot judge. The scheduler half built from such a config claims
    every hit asynchronously, as under async scheduling (tested above)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from stand_in_engine import kv_cache_config, vllm_config

    from ucm_db.connector import UcmDbConnector
    from ucm_db.connector.engine_facts import steps_overlap

    config = vllm_config(tmp_path, tmp_path / "store", {"load_mode": "block"}, async_scheduling=async_scheduling)
    config.parallel_config.pipeline_parallel_size = pipeline_stages
    assert steps_overlap(config) is overlap
    connector = UcmDbConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    try:
        assert connector._scheduler._async_always is overlap  # type: ignore[union-attr]  # RequestState.claims_async
    finally:
        connector.shutdown()
