"""A ``kv_producer``'s voided save is never served by its own engine.

A producer beside another connector (MultiConnector) commits its save of a
step within the step, also over blocks the other connector loaded in it; if
that load failed, the save holds stale KV under the prompt's keys, and the
scheduler voids it once the step's output names the failure: the worker
deletes it in the next step (worker/voids.py). Found by the PD audit: a
request of the same prompt looked up in between (planned in the very step
that carried the void) was claimed those voided blocks and loaded them
before the delete ran, so its output was wrong. The scheduler fences a
voided save's keys now until the void has surely run (settlement.py). Nor
was such a void counted anywhere (``saves_voided`` counted only saves a
worker dropped itself); the workers whose void deleted it count it now.

Real parts: vLLM's Scheduler and MultiConnector, ucm-db's connectors on
real stores; the model runner is the stand-in of stand_in_engine.py, whose
outputs are right only if every KV it read was.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, stored_blocks  # noqa: E402
from test_audit_pd_harness import PdEngine, child, multi_transfer  # noqa: E402

from ucm_db.keys.units import unit_key  # noqa: E402

_RNG = random.Random(3)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(5 * BS + 5)]  # 5 whole blocks


def test_a_request_looked_up_before_a_void_ran_is_not_served_the_voided_blocks(tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    seed = StandInEngine(tmp_path, local)  # the local cache holds the prompt
    seed.add("S", PROMPT, 1)
    seed.run()
    seed.close()
    prefill = PdEngine(tmp_path, multi_transfer([child(shared, "kv_producer"), child(local, "kv_both")], "kv_producer"))
    producer, cache = (c._scheduler for c in prefill.children())

    def lose_block_2(meta: object) -> None:  # the local cache loses a unit between R's lookup and its load
        load = meta.metadata[1].loads[0]  # type: ignore[attr-defined]
        assert cache.store.delete(cache.namespace, [unit_key(load.keys[2], cache._spans[1], cache._grid)]) >= 1

    prefill.add("R", PROMPT, 3)
    prefill.runner.before_load = lose_block_2
    prefill.step()  # R loads 5 blocks from the cache (3 fail); the producer commits its save of all 5 over them
    first = prefill.scheduled[0].kv_connector_metadata.metadata
    assert [(t.req_id, len(t.block_ids)) for t in first[1].loads] == [("R", 5)]
    assert [(t.req_id, len(t.block_ids)) for t in first[0].saves] == [("R", 5)]
    assert prefill.runner.invalid_seen  # the output named the failed blocks: the save is voided next step
    prefill.add("Q", PROMPT, 3)  # the same prompt, looked up before the void ran
    prefill.step()
    second = prefill.scheduled[1].kv_connector_metadata.metadata
    assert len(second[0].void_saves) == 1
    assert [t.req_id for t in second[0].loads] == []  # was [Q]: 3 voided blocks claimed from the shared store
    prefill.run_until_done()
    keys = producer.keys_for(Request("k", PROMPT, SamplingParams(max_tokens=1), None), 5)
    fenced_after = producer._settlement.unfenced(keys, 5)
    voided = prefill.children("worker")[0]._worker.counters.totals.data.get("saves_voided", 0)  # the rank whose void deleted it
    prefill.close()
    assert prefill.outputs == {"R": greedy(PROMPT, 3), "Q": greedy(PROMPT, 3)}
    assert fenced_after == 5  # released once a step that saved was back: the void ran
    assert voided == 5  # the save its workers deleted, in ucm_db_saves_voided (was counted nowhere)
    assert stored_blocks(tmp_path, shared, PROMPT) == (5, [])  # recomputed and saved again, right


def test_a_void_of_a_request_aborted_before_it_is_still_carried_out(tmp_path: Path) -> None:
    """R is aborted right after the step whose output voided its save, and
    nothing else runs: vLLM steps once more for the finished request, whose
    metadata carries the void, so the shared store keeps none of the voided
    blocks (ran and found right); the void is counted (it was not)."""
    from vllm.v1.request import RequestStatus

    local, shared = tmp_path / "local", tmp_path / "shared"
    seed = StandInEngine(tmp_path, local)
    seed.add("S", PROMPT, 1)
    seed.run()
    seed.close()
    prefill = PdEngine(tmp_path, multi_transfer([child(shared, "kv_producer"), child(local, "kv_both")], "kv_producer"))
    cache = prefill.children()[1]._scheduler

    def lose_block_2(meta: object) -> None:
        load = meta.metadata[1].loads[0]  # type: ignore[attr-defined]
        assert cache.store.delete(cache.namespace, [unit_key(load.keys[2], cache._spans[1], cache._grid)]) >= 1

    prefill.add("R", PROMPT, 3)
    prefill.runner.before_load = lose_block_2
    prefill.step()
    prefill.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
    prefill.run_until_done()
    voids = [len(so.kv_connector_metadata.metadata[0].void_saves) for so in prefill.scheduled]
    voided = prefill.children("worker")[0]._worker.counters.totals.data.get("saves_voided", 0)
    prefill.close()
    assert voids == [0, 1]
    assert voided == 5  # counted in ucm_db_saves_voided (was 0: a producer's void was counted nowhere)
    assert stored_blocks(tmp_path, shared, PROMPT) == (0, [])  # its right blocks 0-1 go too (voids.py: what the save stored)
