"""Review of 2bbb753 (e), (d): the producer's fence of a voided save.

1. vLLM calls ``request_finished`` (``_free_request``) inside
   ``update_from_output`` before ``update_connector_output``, which is where
   the scheduler settles the step and lifts the fences whose void ran. A
   request whose recomputed save lands in the step that carries its own
   void finishes in that step's output, while its fence still stands: its
   publication is cut at the first fenced block, though the store holds the
   recomputed, right blocks (published 0 of 5, and logged as a dropped save).
2. The fence is lifted once the output of a step that drained the writer is
   back, whether or not the void's delete worked. A delete that failed
   (logged, ``SaveVoids.delete``) left the voided units stored; the
   request's recomputed save then found them "already stored" (first writer
   wins), so the wrong KV stayed under the prompt's keys for every reader.
   Fixed: the worker keeps a failed void and retries it before each later
   round (worker/voids.py); a delete failing once is retried before the
   recomputed save commits. (A delete that keeps failing leaves the units
   stored until it succeeds: docs/pd.md names that window.)

Real parts: vLLM's Scheduler and MultiConnector, ucm-db's connectors on real
stores; the model runner is the stand-in of stand_in_engine.py. Test 2
replaces the producer store's ``delete`` with one that raises once (a full
or failing disk during the delete, a fault not produced here otherwise).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, stored_blocks  # noqa: E402
from test_audit_pd_harness import PdEngine, child, multi_transfer  # noqa: E402

from ucm_db.connector.roles import Publication  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

_RNG = random.Random(5)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(5 * BS + 5)]  # 5 whole blocks


def _producer_over_a_failing_cache(tmp_path: Path) -> tuple[PdEngine, Path]:
    """A producer (shared store) beside a kv_both cache holding the prompt,
    whose next load of it loses block 2 (an eviction between lookup and load)."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    seed = StandInEngine(tmp_path, local)
    seed.add("S", PROMPT, 1)
    seed.run()
    seed.close()
    prefill = PdEngine(tmp_path, multi_transfer([child(shared, "kv_producer"), child(local, "kv_both")], "kv_producer"))
    cache = prefill.children()[1]._scheduler

    def lose_block_2(meta: Any) -> None:
        load = meta.metadata[1].loads[0]
        assert cache.store.delete(cache.namespace, [unit_key(load.keys[2], cache._spans[1], cache._grid)]) >= 1

    prefill.runner.before_load = lose_block_2
    return prefill, shared


def test_a_request_recomputed_after_its_void_publishes_its_stored_blocks(tmp_path: Path) -> None:
    prefill, shared = _producer_over_a_failing_cache(tmp_path)
    prefill.add("R", PROMPT, 1)
    try:
        prefill.run_until_done()
        params = prefill.kv_params["R"]
        voids = [len(so.kv_connector_metadata.metadata[0].void_saves) for so in prefill.scheduled]
    finally:
        prefill.close()
    assert voids[:2] == [0, 1]  # the save of step 0 was voided in step 1, which saved R's recomputed blocks
    assert prefill.outputs == {"R": greedy(PROMPT, 1)}
    assert stored_blocks(tmp_path, shared, PROMPT) == (5, [])  # the store holds all 5, right
    published = Publication.from_params(params)
    assert published is not None and published.blocks == 5  # was 0: cut at the fence lifted just after


def test_a_void_whose_delete_failed_leaves_no_wrong_kv_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, shared = _producer_over_a_failing_cache(tmp_path)
    producer_worker = prefill.children("worker")[0]._worker
    store = producer_worker._store
    real_delete, calls = store.delete, []

    def delete_failing_once(*args: Any, **kwargs: Any) -> int:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")  # stands for a disk failing the void's write transaction once
        return real_delete(*args, **kwargs)

    monkeypatch.setattr(store, "delete", delete_failing_once)
    prefill.add("R", PROMPT, 3)
    try:
        prefill.run_until_done()
    finally:
        prefill.close()
    monkeypatch.undo()
    voided = producer_worker.counters.totals.data.get("saves_voided", 0)
    assert prefill.outputs == {"R": greedy(PROMPT, 3)}
    assert len(calls) == 2  # the failed void, kept and retried before the recomputed save's round
    assert voided == 5  # counted once its delete went through
    assert stored_blocks(tmp_path, shared, PROMPT) == (5, [])  # was (2, [2, 3, 4]): the voided KV, served to every reader
