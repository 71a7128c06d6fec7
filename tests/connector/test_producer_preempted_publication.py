"""A ``kv_producer``'s publication counts the blocks its saves committed,
however a preemption moved its save marks (audit finding 3).

Under async scheduling request R's prefill step commits its 5 prompt blocks
(a producer commits within the step); the next step, planned before R's
output is back, preempts R for another request's block; R's output then
ends it (``max_tokens`` 1). A preemption moves R's save mark back to its
stored prefix (what it computes again after resuming is saved again), and
``request_finished`` published that mark: 0 blocks, with all 5 stored, so
the decode engine recomputed the whole prompt. The committed mark is kept
apart now; a preemption leaves it, a failed load or a voided save moves it
back.

Real parts: vLLM's AsyncScheduler, both halves of ucm-db's connector, a real
store; the model runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, stored_blocks  # noqa: E402

_RNG = random.Random(9)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(5 * BS + 3)]  # 6 blocks, 5 whole
OTHER = [_RNG.randrange(VOCAB) for _ in range(31)]  # 1 block; a second one at its second decode step


@pytest.mark.parametrize("delivers_stale_output", [True, False])
def test_a_producer_preempted_after_committing_publishes_what_it_committed(tmp_path: Path, delivers_stale_output: bool) -> None:
    """``delivers_stale_output``: vLLM delivers R's output of the step in
    flight when R was preempted, and R ends without running again (what
    vLLM does where no connector asks for KV delivery: ucm-db's
    ``requires_kv_delivery`` was False); else vLLM drops it and R runs again
    (resumed: looked up, its last token computed again)."""
    store = tmp_path / "store"
    engine = StandInEngine(tmp_path, store, overlapped=True, num_blocks=8, role="kv_producer")
    engine.sched.requires_kv_delivery = not delivers_stale_output
    engine.add("B", OTHER, 4)
    engine.step()  # step 1: B's prefill
    engine.add("R", PROMPT, 1)
    engine.run()
    saves = [[(t.req_id, len(t.block_ids)) for t in so.kv_connector_metadata.saves] for so in engine.scheduled]
    preempted = [set(so.preempted_req_ids) for so in engine.scheduled]
    outputs, published = dict(engine.outputs), engine.kv_params["R"]["ucm_db"]
    keys = engine.ours.keys_for(Request("probe", PROMPT, SamplingParams(max_tokens=1), None), 5)
    engine.close()
    assert ("R", 5) in saves[1] and preempted[2] == {"R"}  # committed in step 2, preempted by step 3
    assert outputs == {"B": greedy(OTHER, 4), "R": greedy(PROMPT, 1)}
    assert stored_blocks(tmp_path, store, PROMPT) == (5, [])
    assert published["blocks"] == 5 and published["last_key"] == keys[4].hex()
