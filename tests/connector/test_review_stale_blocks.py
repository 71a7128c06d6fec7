"""Review of the stale-block tracker (2026-12-06, commit ac7a433:
connector/scheduler/stale_blocks.py): targeted adversarial scenarios on the
stand-in engine (test_stale_blocks_randomised.py draws random ones).

Findings, each pinned by a strict xfail until fixed (the fix follows each):

1. A tainted request's writes reach a request admitted in the same step.
   vLLM hashes a block when it *schedules* the tokens that fill it, so a
   request admitted later in the same ``schedule()`` takes it as a local hit
   and reads it in the same forward pass. The tracker marked a tainted
   request's writes stale only after the step's verdict, and judged only
   requests that held a stale block before the step: the reader was never
   tainted, its token delivered and the block stored under its keys.
   Fixed: the verdict is iterated, a tainted request's writes being stale
   to every request of its step (StaleBlocks.plan).
2. A tainted request aborted while its step runs (``EngineCore.step`` takes
   aborts between execution and the output) left the blocks it filled
   over stale KV hashed in vLLM's prefix cache: they were evicted only from
   the tables of requests still tracked when the output came back, and a
   freed block was forgotten by the tracker though it was still hashed.
   Fixed: a verdict keeps its tainted requests' tables, evicted at its
   output; a freed stale block is evicted as it is forgotten.
3. (Predates ac7a433: the failed step's saves.) Under MultiConnector with
   two ucm-db children, the child that did not load stores what a request
   sharing the other child's failed synchronous load computed over it: its
   worker never saw that failure, and the save was not held. Fixed: such a
   save is held (SaveSettlement.after_loads).

The shared setup of 1 and 2: A (PROMPT's first 4 blocks) claims the 3
stored ones, block 1 of its load fails (blocks 1-2, a unit going with its
descendants); R2 (those 4 blocks, then 80 tokens of its own) takes A's
blocks from vLLM's prefix cache in A's step, where the token budget gives
it one block of its own (128-160). vLLM rewinds A and reverts R2; the
client aborts A. In the next step R2 (no longer budget-bound) computes 128-208 over the
stale blocks (tainted, as it should be), and vLLM hashes its fresh block 5
(160-192) as it schedules it.

Real parts: vLLM's Scheduler, both halves of ucm-db's connector (and vLLM's
MultiConnector in 3), real stores; the failure is a real deleted unit.
The only settings changed on the scheduler after it is made are the token
budget and ``long_prefill_token_threshold``, both read by every ``schedule()``.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, kv_cache_config, lose_unit, stored_blocks  # noqa: E402
from test_failed_load_leaves import PROMPT, _stored_prompt  # noqa: E402

LOADER = PROMPT[:4 * BS]  # A: its whole table is shared by R2, so aborting it frees no stale block
SHARER = LOADER + [random.Random(11).randrange(VOCAB) for _ in range(80)]  # R2: 208 tokens, blocks 4-6 its own
BUDGET_TOKENS = 4096  # the stand-in engine's max_num_batched_tokens


def _budget(engine: StandInEngine, tokens: int) -> None:
    """The token budget of the next ``schedule()`` calls (vLLM copies it at start; both copies are read)."""
    engine.sched.max_num_scheduled_tokens = tokens
    engine.sched.scheduler_config.max_num_batched_tokens = tokens


def _lose_block_1(engine: StandInEngine, loads_of: Any = lambda meta: meta.loads, ours: Any = None) -> None:
    """Block 1 of the first load goes missing between the lookup and the load."""
    def lose(meta: Any) -> None:
        loads = loads_of(meta)
        if not loads:
            engine.runner.before_load = lose  # not yet: the next step's
            return
        lose_unit(ours or engine, loads[0], 1)
    engine.runner.before_load = lose


def _sharer_tainted_after_loader_aborted(root: Path) -> tuple[Path, StandInEngine]:
    """The module's shared setup, up to the step where R2 computes over the stale blocks (not run yet)."""
    store = _stored_prompt(root)
    engine = StandInEngine(root, store)
    _lose_block_1(engine)
    _budget(engine, 2 * BS)  # A computes its block 3, R2 its block 4 (128-160)
    engine.add("A", LOADER, 20)
    engine.add("R2", SHARER, 20)
    engine.step()
    first = engine.scheduled[0]
    assert dict(first.num_scheduled_tokens) == {"A": BS, "R2": BS} and engine.runner.invalid_seen, "A's load failed, R2 shared it"
    engine.sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # the client's abort, before the next step
    _budget(engine, BUDGET_TOKENS)
    return store, engine


def _close(engine: StandInEngine) -> dict[str, list[int]]:
    outputs = dict(engine.outputs)
    engine.close()
    return outputs


@pytest.mark.timeout(120)
def test_a_request_admitted_beside_a_tainted_one_never_reads_its_writes(tmp_path: Path) -> None:
    """In R2's tainted step W1 (R2's first 5 blocks and a token) and W2 (R2's
    prompt) arrive: W1 computes blocks 1-4 afresh (vLLM hashes them as it
    schedules them), so W2 finds blocks 0-4 (A's 0, W1's 1-4) and R2's
    block 5, hashed by R2's allocation earlier in the same ``schedule()``,
    and computes 192-208 over it. No block W2 holds was stale before the
    step, so the tracker never judges W2 (``_holds_stale``), and R2's wrong
    writes are marked stale only after the verdict. W2's first token is
    delivered wrong, and W2 stores block 5 under R2's prompt's keys.

    Fixed (2026-12-06): a slot a tainted request writes in the step is stale to every
    request of the step (vLLM writes a layer's KV for the whole batch before
    its attention reads any): iterate the verdict until no request reads a
    slot that is stale at the step's start and not written right, or that a
    tainted request writes in it, judging every scheduled request whose table
    holds such a block, not only those holding a stale block at the start."""
    store, engine = _sharer_tainted_after_loader_aborted(tmp_path)
    engine.add("W1", SHARER[:5 * BS + 1], 4)
    engine.add("W2", SHARER, 4)
    engine.step()
    step = engine.scheduled[-1]
    tables = {new.req_id: (new.num_computed_tokens, new.block_ids[0]) for new in step.scheduled_new_reqs}
    r2_block_5 = engine.sched.kv_cache_manager.get_block_ids("R2")[0][5]
    assert step.kv_connector_metadata.stale_reads, "R2 is tainted in this step"
    assert tables["W2"][0] == 6 * BS and tables["W2"][1][5] == r2_block_5, "W2 took R2's block 5 as a local hit"
    engine.run()
    outputs = _close(engine)
    assert outputs["R2"] == greedy(SHARER, 20)
    assert (outputs["W2"], stored_blocks(tmp_path, store, SHARER + outputs["W2"])[1]) == (greedy(SHARER, 4), [])


@pytest.mark.timeout(120)
def test_a_tainted_request_aborted_in_its_step_leaves_no_stale_block_hashed(tmp_path: Path) -> None:
    """The client aborts R2 while its tainted step runs (between execution
    and output). R2's block 5, hashed as that step was scheduled, is freed
    still hashed: the output's eviction (hooks.observe_output, over the
    stale reads) reads only the tables of requests still tracked, and
    ``StaleBlocks.forget_freed`` forgets a freed block though it is hashed
    ("its next holder writes it first" fails for a prefix-cache hit). Once
    W1 has computed R2's first 5 blocks again, W2 (R2's prompt) finds R2's
    block 5, computes over it and stores it.

    Fixed (2026-12-06): keep in the step's verdict the tables of its tainted requests as
    planned (as settlement.record_tables does for a failed load's step) and
    evict from the first stale block on at output_back, whether the request
    is still tracked or not; and forget a freed stale block only once it has
    no hash (or evict it as it is forgotten)."""
    store, engine = _sharer_tainted_after_loader_aborted(tmp_path)

    def abort_r2(eng: StandInEngine, so: Any, out: Any) -> None:
        if so.kv_connector_metadata.stale_reads and "R2" in eng.sched.requests:
            eng.sched.finish_requests("R2", RequestStatus.FINISHED_ABORTED)
    engine.post_execute.append(abort_r2)
    engine.step()
    engine.post_execute.clear()
    assert "R2" not in engine.sched.requests, "R2 was tainted, and aborted in that step"
    engine.add("X", [1, 2, 3], 3)  # steps go on: the tracker forgets the freed blocks
    engine.run()
    engine.add("W1", SHARER[:5 * BS + 1], 4)
    engine.add("W2", SHARER, 4)
    engine.run()
    outputs = _close(engine)
    assert (outputs["W2"], stored_blocks(tmp_path, store, SHARER + outputs["W2"])[1]) == (greedy(SHARER, 4), [])


# -- MultiConnector -------------------------------------------------------------------------


def _child(path: Path) -> dict[str, Any]:
    return {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": str(path), "codec": "none", "save_process": False}}


def _multi_engine(root: Path, stores: list[Path]) -> StandInEngine:
    """The stand-in engine with vLLM's MultiConnector over one ucm-db child per store, on both sides."""
    engine = StandInEngine(root, stores[0])
    engine.sched.connector.shutdown()  # type: ignore[union-attr]
    engine.runner.connector.shutdown()
    config = copy.copy(engine.config)  # as MultiConnector copies it for each child
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [_child(path) for path in stores]})
    engine.config = config
    engine.sched = Scheduler(config, kv_cache_config(256), StructuredOutputManager(config), BS)
    engine.runner.connector = MultiConnector(config, KVConnectorRole.WORKER, kv_cache_config(256))  # type: ignore[assignment]
    engine.runner.connector.register_kv_caches(engine.runner.kv)
    return engine


def _multi_shared_failed_load(root: Path, chunk_tokens: int) -> tuple[list[Path], dict[str, list[int]], list[Any], int]:
    """test_review_load_path's scenario (A = PROMPT, R2 = its first 4 blocks
    and 3 tokens) under MultiConnector: the first child's store holds
    PROMPT's first 3 blocks and loads them, the second's is empty; returns
    the stores, the outputs, the children's trackers after the run and
    the number of steps whose metadata named stale reads (either child's)."""
    stores = [_stored_prompt(root), root / "empty"]
    engine = _multi_engine(root, stores)
    engine.sched.scheduler_config.long_prefill_token_threshold = chunk_tokens
    children = engine.sched.connector._connectors  # type: ignore[union-attr]
    _lose_block_1(engine, lambda meta: meta.metadata[0].loads, SimpleNamespace(ours=children[0]._scheduler))
    engine.add("A", PROMPT, 20)
    engine.add("R2", PROMPT[:4 * BS] + [5, 6, 7], 60)
    engine.run()
    assert engine.runner.invalid_seen and set(engine.scheduled[0].num_scheduled_tokens) == {"A", "R2"}
    outputs = dict(engine.outputs)
    reports = sum(any(meta.stale_reads for meta in so.kv_connector_metadata.metadata) for so in engine.scheduled)
    for child in engine.runner.connector._connectors:  # type: ignore[attr-defined]
        child._worker.drain()
    engine.runner.connector.shutdown()
    engine.sched.connector.shutdown()  # type: ignore[union-attr]
    return stores, outputs, [child._scheduler._planner.stale for child in children], reports


@pytest.mark.timeout(120)
def test_two_ucm_db_children_judge_a_chunked_recompute_alike(tmp_path: Path) -> None:
    """Both children track the failed blocks (each hears the other's failure
    in ``invalid_block_ids`` and subtracts only its own stale reads): R2 is
    rewound, every output is right, and both trackers end empty."""
    _, outputs, trackers, reports = _multi_shared_failed_load(tmp_path, chunk_tokens=16)
    assert reports, "R2 read the stale blocks: the scenario happened"
    assert outputs == {"A": greedy(PROMPT, 20), "R2": greedy(PROMPT[:4 * BS] + [5, 6, 7], 60)}
    assert all(t.empty and not t._verdicts for t in trackers)


@pytest.mark.timeout(120)
def test_a_child_that_did_not_load_stores_nothing_over_a_siblings_failed_load(tmp_path: Path) -> None:
    """Without chunking: in the failed step the empty child plans R2's save
    of blocks 0-3 (A's, shared) with ``after_loads`` but not held
    (settlement.hold_id: ``sibling`` is only the loader's own request,
    composition.sibling_block_ids), so it is tracked as one rank's save
    over its own loads, which its worker drops itself; but that worker never
    saw the failure (the other child's worker loaded), and stores it: PROMPT's
    blocks 1-3 under their keys, wrong. The filled child stores nothing wrong.

    Fixed (2026-12-06): a save over blocks another connector loaded in a step whose output
    is not back is held (``sibling``) whichever request the load was for
    (SaveSettlement.after_loads: the blocks of every unsettled sibling load
    among the save's block ids)."""
    stores, outputs, _, _ = _multi_shared_failed_load(tmp_path, chunk_tokens=0)
    assert outputs["R2"] == greedy(PROMPT[:4 * BS] + [5, 6, 7], 60)
    assert stored_blocks(tmp_path, stores[0], PROMPT + outputs["A"])[1] == []
    assert stored_blocks(tmp_path, stores[1], PROMPT + outputs["A"])[1] == []


# -- claims that hold ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_nothing_is_tracked_while_no_load_fails(tmp_path: Path) -> None:
    """Cost when nothing failed: A's sync load succeeds and R2 shares it,
    both chunked; at every step the tracker holds nothing, names no stale
    read and keeps no verdict."""
    engine = StandInEngine(tmp_path, _stored_prompt(tmp_path))
    engine.sched.scheduler_config.long_prefill_token_threshold = 16
    tracker = engine.ours._planner.stale
    seen: list[tuple[bool, tuple[int, ...], int]] = []
    engine.post_execute.append(lambda eng, so, out: seen.append(
        (tracker.empty, so.kv_connector_metadata.stale_reads, len(tracker._verdicts))))
    engine.add("A", PROMPT, 8)
    engine.add("R2", SHARER, 8)
    engine.run()
    outputs = _close(engine)
    assert engine.scheduled[0].kv_connector_metadata.loads, "A loaded PROMPT's stored blocks"
    assert outputs == {"A": greedy(PROMPT, 8), "R2": greedy(SHARER, 8)}
    assert seen and set(seen) == {(True, (), 0)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_tainted_sharer_stores_nothing_wrong_and_leaves_no_state(tmp_path: Path, role: str) -> None:
    """test_review_load_path's chunked scenario (R2 computes 60 tokens
    while A's recompute is chunked by 16) for a producer (saves committed
    within their steps) too: outputs right, no wrong block stored for
    either prompt, and once every request finished the tracker holds no
    block and no verdict (nothing leaks)."""
    store = _stored_prompt(tmp_path)
    engine = StandInEngine(tmp_path, store, role=role)
    engine.sched.scheduler_config.long_prefill_token_threshold = 16
    _lose_block_1(engine)
    sharer = PROMPT[:4 * BS] + [5, 6, 7]
    engine.add("A", PROMPT, 20)
    engine.add("R2", sharer, 60)
    engine.run()
    tracker = engine.ours._planner.stale
    reports = [so.kv_connector_metadata.stale_reads for so in engine.scheduled if so.kv_connector_metadata.stale_reads]
    outputs = _close(engine)
    assert reports, "R2 read the stale blocks: the scenario happened"
    assert outputs == {"A": greedy(PROMPT, 20), "R2": greedy(sharer, 60)}
    assert stored_blocks(tmp_path, store, sharer + outputs["R2"])[1] == []
    assert stored_blocks(tmp_path, store, PROMPT + outputs["A"])[1] == []
    assert tracker.empty and not tracker._verdicts
