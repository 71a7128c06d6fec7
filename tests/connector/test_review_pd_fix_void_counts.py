"""Review fixes of 2bbb753: ``saves_voided`` counts one unit at TP>1, and a
void whose delete fails is kept and retried (connector/worker/voids.py).

``saves_voided`` counts blocks per writing worker rank (vLLM sums the ranks'
stats, as for ``saved_blocks``): a rank counts the blocks of a save over a
failed load that it dropped itself, that it held and was told to drop, or
whose void deleted what its writer stored. The producer's scheduler counted
a void once besides, so a TP=2 producer whose ranks both failed their load
counted 9 for a 3-block save (each rank's drop and the scheduler's void) where
a ``kv_both`` engine counts 6 (test_failed_load_saves.py).

Real vLLM request objects, a real store, CPU KV tensors, no engine (the
failure is produced for real: a unit is deleted between lookup and load);
the retry test replaces the store's ``delete`` with one that raises once
(a disk failing the delete's write transaction: not produced here otherwise).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from test_failed_load_saves import IDS, PROMPT, _admitted, _output, settings  # noqa: E402,F401
from test_scheduler_worker import BS, _new_step, _shape  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402


@pytest.mark.parametrize("failing_ranks", [(1,), (0, 1)])
def test_a_tp2_producers_void_counts_its_blocks_once_per_writing_rank(settings: ConnectorSettings,
                                                                       failing_ranks: tuple[int, ...]) -> None:
    sched, workers, _, req = _admitted(settings, tp=2, role="kv_producer")
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    for rank in failing_ranks:  # that rank's head of block 1 goes between lookup and load
        assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[rank], g)]) == 1
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    nxt = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - BS))
    assert [t.block_ids for t in nxt.void_saves] == [(12, 13, 14)]
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    by_rank = [worker.counters.totals.data.get("saves_voided", 0) for worker in workers]
    by_scheduler = sched.counters.totals.data.get("saves_voided", 0)
    keys = sched.keys_for(req, 5)
    head0 = sched.store.lookup(ns, [unit_key(k, spans[0], g) for k in keys], remote=False)
    for worker in workers:
        worker.shutdown()
    sched.shutdown()
    assert head0 == (1 if 0 in failing_ranks else 2)  # rank 0's units of blocks 2-4 gone (or never stored)
    assert by_scheduler == 0  # was 3: the scheduler's count besides the workers'
    assert by_rank == [3, 3]  # each writing rank: dropped itself, or its void deleted its units
    assert sum(by_rank) + by_scheduler == 2 * 3  # what vLLM sums: as a kv_both engine's held drops at TP=2


def test_a_void_whose_delete_failed_is_retried_before_the_next_round(settings: ConnectorSettings,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sched, workers, _, req = _admitted(settings, tp=2, role="kv_producer")
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    assert sched.store.delete(ns, [unit_key(meta.loads[0].keys[1], spans[1], g)]) == 1  # rank 1's head of block 1
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
    real_delete, calls = sched.store.delete, []

    def delete_failing_once(*args: Any, **kwargs: Any) -> int:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")  # an LMDB delete needs pages
        return real_delete(*args, **kwargs)

    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    nxt = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - BS))
    assert nxt.void_saves and nxt.saves  # the void, and the recomputed save behind it
    keys = sched.keys_for(req, 5)
    head0 = [unit_key(k, spans[0], g) for k in keys]
    monkeypatch.setattr(sched.store, "delete", delete_failing_once)
    workers[0].start_load(nxt)
    workers[0].drain()
    left = sched.store.lookup(ns, head0, remote=False)
    workers[0].save(nxt)  # the recomputed save's round: the failed void is retried first
    workers[0].drain()
    monkeypatch.undo()
    voided = workers[0].counters.totals.data.get("saves_voided", 0)
    for worker in workers:
        worker.shutdown()
    sched.shutdown()
    assert left == 5  # the delete failed: the voided units still stored
    assert len(calls) == 2  # was 1: given up after logging
    assert voided == 3
