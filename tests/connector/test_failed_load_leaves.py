"""A request that leaves before its failed load is reported leaves no stale
KV in vLLM's prefix cache (audit finding 1, wrong KV served and saved).

Request A (5 whole blocks) claims the 3 stored ones; one unit of block 1 is
lost between the lookup and the load (another engine's eviction), so the
load fails (blocks 1-2: a unit goes with its descendants) and the step
computes blocks 3-4 over stale blocks. Before vLLM processes that
step's output A leaves: the client aborts it (``EngineCore.step`` takes
aborts between ``execute_model`` and ``update_from_output``), or the next
step, planned before the output is back, preempts it (steps overlap). vLLM
rewinds only the requests it still runs or holds waiting and, under
``kv_load_failure_policy: "recompute"``, evicts nothing; ucm-db used to evict
only the blocks of requests it still tracked (an aborted one is forgotten, a
preempted one holds no blocks). The failed block and those computed over it
stayed hashed in vLLM's prefix cache: the next request of the prompt took
them as a local hit, computed over them, and ucm-db stored the wrong KV under
the right keys for every engine on the store. Evicting the failed blocks
alone is not enough: vLLM's prefix lookup stops at the first block it does
not find, but once a later request computes blocks 1-2 again and caches
them, the stale blocks 3-4, still hashed under the same block hashes, are
found again. Now every failed block leaves vLLM's prefix cache with every
later block of each block table that held one as the steps were planned
(settlement.py), and vLLM drops a preempted request's in-flight output
(``requires_kv_delivery``), whose token was sampled over the failed load.

Real parts: vLLM's Scheduler / AsyncScheduler, both halves of ucm-db's
connector, a real store; the model runner is a stand-in whose KV depends on
every KV it reads (stand_in_engine.py), so outputs and stored blocks are
checked exactly. tests/vllm/test_failed_load_engine.py runs the abort on a
real engine.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, lose_unit, stored_blocks  # noqa: E402

_RNG = random.Random(7)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(5 * BS + 3)]  # 5 whole blocks
OTHER = [_RNG.randrange(VOCAB) for _ in range(31)]


def _stored_prompt(root: Path) -> Path:
    """A first engine computed PROMPT's first 3 blocks and stored them."""
    store = root / "store"
    writer = StandInEngine(root, store)
    writer.add("w", PROMPT[:3 * BS + 1], 4)
    writer.run()
    writer.close()
    return store


def _lose_block_1_of_the_load(engine: StandInEngine) -> None:
    def lose(meta: Any) -> None:
        if not meta.loads:
            engine.runner.before_load = lose  # not yet: the next step's
            return
        (load,) = meta.loads
        lose_unit(engine, load, 1)
    engine.runner.before_load = lose


def _table(engine: StandInEngine, req_id: str) -> list[int]:
    """The block table ``req_id`` was first scheduled with."""
    return next(list(new.block_ids[0]) for so in engine.scheduled for new in so.scheduled_new_reqs if new.req_id == req_id)


def _hashed(engine: StandInEngine, block_ids: list[int]) -> list[bool]:
    """Which of ``block_ids`` vLLM's prefix cache holds (hashed)."""
    pool = engine.sched.kv_cache_manager.block_pool
    return [pool.blocks[b].block_hash is not None for b in block_ids]


def test_a_request_aborted_before_its_failed_load_is_reported_leaves_no_stale_block(tmp_path: Path) -> None:
    store = _stored_prompt(tmp_path)
    engine = StandInEngine(tmp_path, store)
    _lose_block_1_of_the_load(engine)
    reported: list[set[int]] = []

    def abort_a(eng: StandInEngine, so: Any, out: Any) -> None:
        if "A" in so.num_scheduled_tokens and "A" in eng.sched.requests:
            reported.append(set(out.kv_connector_output.invalid_block_ids))
            eng.sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # the client's abort, before the output
    engine.post_execute.append(abort_a)
    engine.add("A", PROMPT, 40)
    engine.run()
    engine.post_execute.clear()
    table = _table(engine, "A")
    assert len(reported) == 1 and reported[0] == set(table[1:3])  # blocks 1-2 failed to load
    # Block 0 loaded right; blocks 1-4 are stale (3-4 computed over 1-2: no failed block id names them).
    assert _hashed(engine, table[:5]) == [True, False, False, False, False]
    for req_id in ("D", "E"):  # D computes blocks 1-4 again; E finds them in vLLM's prefix cache
        engine.add(req_id, PROMPT, 40)
        engine.run()
    outputs = dict(engine.outputs)
    engine.close()
    assert outputs == {"D": greedy(PROMPT, 40), "E": greedy(PROMPT, 40)}
    right, wrong = stored_blocks(tmp_path, store, PROMPT + outputs["D"])
    assert wrong == [] and right == (len(PROMPT) + 39) // BS


def test_a_request_preempted_before_its_failed_load_is_reported_leaves_no_stale_block(tmp_path: Path) -> None:
    """Steps overlap (the step after A's load is planned before its output is
    back) and vLLM's async scheduling is off in the config, as a pipeline-
    parallel engine's batch queue runs: ucm-db claims synchronously. A's
    load fails in step 2; step 3 preempts A (an 8-block KV cache, B needs a
    block); then step 2's output names the failed blocks."""
    store = _stored_prompt(tmp_path)
    engine = StandInEngine(tmp_path, store, overlapped=True, async_scheduling=False, num_blocks=8)
    _lose_block_1_of_the_load(engine)
    update, hashed = engine.sched.update_from_output, []

    def update_then_look(so: Any, out: Any) -> Any:
        outputs = update(so, out)
        if out.kv_connector_output.invalid_block_ids:  # step 2's output, A preempted already
            hashed.append(_hashed(engine, _table(engine, "A")[:5]))
        return outputs
    engine.sched.update_from_output = update_then_look  # type: ignore[method-assign]
    engine.add("B", OTHER, 10)
    engine.step()  # step 1: B's prefill
    engine.add("A", PROMPT, 10)
    engine.run()  # A, resumed, computes blocks 1-4 again
    preempted = [set(so.preempted_req_ids) for so in engine.scheduled]
    assert preempted[2] == {"A"} and engine.runner.invalid_seen  # step 3 preempted A, whose load had failed
    assert hashed == [[True, False, False, False, False]]
    engine.add("D", PROMPT, 10)  # finds A's blocks in vLLM's prefix cache
    engine.run()
    outputs = dict(engine.outputs)
    engine.close()
    # A's token sampled over the failed load (in flight when A was preempted) is dropped, not delivered.
    assert outputs == {"A": greedy(PROMPT, 10), "B": greedy(OTHER, 10), "D": greedy(PROMPT, 10)}
    for tokens in (PROMPT + outputs["A"], PROMPT + outputs["D"]):
        assert stored_blocks(tmp_path, store, tokens)[1] == []
