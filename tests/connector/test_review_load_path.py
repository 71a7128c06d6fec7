"""Review of the connector's load path (2026-12-06): a wrong-KV defect,
fixed by connector/scheduler/stale_blocks.py (these tests were strict xfails
until then; docs/connector.md).

Finding: a failed *synchronous* load of a block that another request shares
in the same step leaves that request computing over the stale block.

Request A claims 3 stored blocks (``load_mode: "block"``, the default, or
``"layer"``). vLLM caches a sync claim's blocks when it allocates them, so
request R2, admitted in the same step with the same prefix, takes them (and
the block A computes in that step) as a local hit. One unit of A's block 1
is lost between the lookup and the load (another engine's eviction): blocks
1-2 fail and are reported. vLLM (``_update_requests_with_invalid_blocks``,
``kv_load_failure_policy: "recompute"``) rewinds A to block 1 and lets R2
keep blocks 1-2 as computed, counting on A to write them again before R2
reads them. That holds only if A's recompute of both blocks lands in the
same forward pass as R2's next tokens, or before. It does not when:

* A's recompute is chunked below the shared blocks (vLLM's
  ``--long-prefill-token-threshold``, its knob against one long prefill
  starving the others): in the next step A rewrites half of block 1 while
  R2 computes 16 tokens over blocks 1-2;
* A leaves before it recomputes them (the client's abort, taken between the
  failed step's output and the next step).

R2's output was then wrong for good (vLLM heard of no further failure), and
ucm-db stored the KV R2 computed over the stale blocks under R2's keys: a
wrong block served as a hit to every engine on the store (a chat's next turn
sends R2's answer back as its prefix). Now the scheduler follows the stale
blocks slot by slot until they are written again, and has vLLM rewind R2
(the workers report the stale blocks R2 reads) and saves nothing R2 computed
over them. With ``load_mode: "async"`` vLLM
caches a claim's blocks only once its load succeeded, so nobody shares them
and the same run is right (the control test below, which passes).

Real parts: vLLM's Scheduler, both halves of ucm-db's connector, a real
store (the failure is a real deleted unit); the model runner is the
stand-in whose KV depends on every KV it reads (stand_in_engine.py), so
outputs and stored blocks are checked exactly. The only setting changed on
vLLM's scheduler after it is made is ``long_prefill_token_threshold``
(read by ``schedule()`` at every step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from stand_in_engine import BS, StandInEngine, greedy, lose_unit, stored_blocks  # noqa: E402
from test_failed_load_leaves import PROMPT, _stored_prompt  # noqa: E402

SHARER = PROMPT[:4 * BS] + [5, 6, 7]  # R2: A's (PROMPT's) first 4 blocks, then its own tokens


def _lose_block_1_of_the_first_load(engine: StandInEngine) -> None:
    def lose(meta: Any) -> None:
        loads = [*meta.loads, *meta.async_loads]
        if not loads:
            engine.runner.before_load = lose  # not yet: the next step's
            return
        lose_unit(engine, loads[0], 1)  # blocks 1-2 of A's load fail (a unit goes with its descendants)
    engine.runner.before_load = lose


def _shared_failed_load(root: Path, *, sharer_tokens: int, chunk_tokens: int = 0, abort_loader: bool = False,
                        load_mode: str = "block") -> tuple[Path, StandInEngine, dict[str, list[int]]]:
    """A and R2 admitted in one step, A's load failing as the module says;
    returns the store, the engine (closed) and the outputs."""
    store = _stored_prompt(root)  # PROMPT's first 3 blocks stored by a first engine
    engine = StandInEngine(root, store, extra={"load_mode": load_mode})
    engine.sched.scheduler_config.long_prefill_token_threshold = chunk_tokens
    _lose_block_1_of_the_first_load(engine)
    if abort_loader:
        update = engine._update

        def update_then_abort(so: Any, out: Any) -> None:
            update(so, out)
            if out.kv_connector_output.invalid_block_ids and "A" in engine.sched.requests:
                # The client's abort of A, taken before the next step (EngineCore's input queue).
                engine.sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
        engine._update = update_then_abort  # type: ignore[method-assign]
    engine.add("A", PROMPT, 20)
    engine.add("R2", SHARER, sharer_tokens)
    engine.run()
    outputs = dict(engine.outputs)
    engine.close()
    assert engine.runner.invalid_seen, "the scenario needs A's load to fail"
    if load_mode != "async":
        first = engine.scheduled[0]
        assert set(first.num_scheduled_tokens) == {"A", "R2"}, "the scenario needs A and R2 in one step"
    return store, engine, outputs


@pytest.mark.timeout(180)
def test_a_request_sharing_a_failed_sync_load_never_computes_over_the_stale_block(tmp_path: Path) -> None:
    _, engine, outputs = _shared_failed_load(tmp_path, sharer_tokens=20, chunk_tokens=16)
    assert outputs["A"] == greedy(PROMPT, 20)
    assert outputs["R2"] == greedy(SHARER, 20)
    reports = [so.kv_connector_metadata.stale_reads for so in engine.scheduled if so.kv_connector_metadata.stale_reads]
    assert reports, "R2 was never found reading the stale blocks: the scenario did not happen"


@pytest.mark.timeout(180)
def test_no_block_computed_over_a_shared_failed_sync_load_is_stored(tmp_path: Path) -> None:
    store, _, outputs = _shared_failed_load(tmp_path, sharer_tokens=60, chunk_tokens=16)
    _, wrong = stored_blocks(tmp_path, store, SHARER + outputs["R2"])
    assert wrong == []  # before the fix: [4], the block R2 completed over the stale blocks 1-2


@pytest.mark.timeout(180)
def test_a_sharer_of_a_failed_sync_load_whose_loader_is_aborted_computes_no_stale_kv(tmp_path: Path) -> None:
    _, _, outputs = _shared_failed_load(tmp_path, sharer_tokens=20, abort_loader=True)
    assert outputs["R2"] == greedy(SHARER, 20)


@pytest.mark.timeout(180)
def test_control_the_same_run_with_async_loads_is_right(tmp_path: Path) -> None:
    """The harness is exact: where nobody shares a block before its load
    succeeded (``load_mode: "async"``), the same failure and chunking give
    right outputs and store no wrong block."""
    store, engine, outputs = _shared_failed_load(tmp_path, sharer_tokens=60, chunk_tokens=16, load_mode="async")
    assert outputs == {"A": greedy(PROMPT, 20), "R2": greedy(SHARER, 60)}
    assert stored_blocks(tmp_path, store, SHARER + outputs["R2"])[1] == []

