"""A producer's void deletes the voided save's units from the remote tier too.

A ``kv_producer`` commits (and with ``publish: "remote"``, uploads) its save
over a load within the step; if another rank's load failed, the save is
voided a step later. With a write-back remote its upload is held until the
save's fate is known, so the wrong units never reach the remote. The void deleted its units from the local tier only, so the next
lookup of the prompt promoted the wrong units back from the remote, the
recomputed right ones were then "already present" (first writer wins), and
every node of the remote was served the wrong KV (the review's repro: "head
0 of block 4 is WRONG (the voided save's)", producer and consumer node).

Now ``Store.delete`` on a store with a remote retracts what it deleted
(ucm_db/index/retractions.py): it records each removed unit in its
transaction, deletes their remote objects, and never promotes them back.

Real parts: the scheduler, the workers (TP=2), a real LMDB store, a
``file://`` remote, a second node reading it; CPU KV tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from test_failed_load_saves import _output, _seed  # noqa: E402
from test_scheduler_worker import BS, _admit, _kv, _new_step, _request, _shape  # noqa: E402
from test_void_keeps_others_saves import IDS, PROMPT, _rank_worker  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

MODES = {
    "publish-remote": {"remote_mode": "write_through", "publish": "remote"},  # uploaded within the step
    "write-back": {"remote_mode": "write_back"},  # publish "local"; the upload is held until the save's settle
}


def _unit(worker: object, block_id: int) -> bytes:
    """Rank ``worker``'s unit of vLLM block ``block_id``, as it saves it."""
    staging = worker.layout.new_unit_staging(1)  # type: ignore[attr-defined]
    worker.layout.gather_units([block_id], staging)  # type: ignore[attr-defined]
    return staging[0, 0].numpy().tobytes()


def _object(shared: Path, ns: ucm_db.Namespace, key: bytes) -> Path:
    return shared / ns.short_id / key[:1].hex() / key.hex()


@pytest.mark.parametrize("save_process", [False, True], ids=["in-process", "commit-process"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_voided_save_is_not_served_back_from_the_remote(tmp_path: Path, mode: str, save_process: bool) -> None:
    """TP=2 producer: rank 1's load of block 1 fails, rank 0 commits and
    uploads its save of blocks 2-4; the void deletes them here and on the
    remote. The same prompt later is computed again, and the right units
    are what the producer and another node read."""
    shared = tmp_path / "shared"
    settings = ConnectorSettings.from_extra_config(
        {"path": str(tmp_path / "s"), "codec": "none", "remote": f"file://{shared}", "save_process": save_process, **MODES[mode]})
    _seed(settings, {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}, blocks=2)
    sched = UcmDbScheduler(settings, _shape(2), RolePolicy("kv_producer"))
    workers = [_rank_worker(settings, rank, "kv_producer") for rank in (0, 1)]
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    req = _request("b", PROMPT)
    assert _admit(sched, req) == 2 * BS
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    assert [t.voidable for t in meta.saves] == [True], "a TP=2 producer's save over loads may be voided"
    keys = sched.keys_for(req, 5)
    head0 = [unit_key(k, spans[0], g) for k in keys]
    lost = unit_key(keys[1], spans[1], g)
    assert sched.store.delete(ns, [lost]) == 1  # rank 1's load of block 1 fails: gone here ...
    _object(shared, ns, lost).unlink(missing_ok=True)  # ... and on the remote
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)  # rank 0 commits blocks 2-4, computed over rank 1's failed block
    assert workers[1].take_load_errors() == {11}
    wrong = _unit(workers[0], 14)
    sched.store.flush(upload_timeout_s=30)
    uploaded = [_object(shared, ns, key).exists() for key in head0[2:]]
    if mode == "publish-remote":  # write-through: the consumer reads the upload within the step
        assert all(uploaded), "the wrong units did not reach the remote"
    else:  # write-back: a voidable save's upload waits for its settle (ucm_db/index/provisional.py)
        assert not any(uploaded), "a voidable save was uploaded before its fate was known"
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    sched.request_finished(req, IDS)  # the client went away: b is not computed again
    nxt = sched.build_connector_meta(_new_step(_request("idle", PROMPT[:3]), [30], 0))
    assert [t.block_ids for t in nxt.void_saves] == [(12, 13, 14)]
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    assert not any(_object(shared, ns, key).exists() for key in head0[2:]), "the void left its units on the remote"
    assert sched.store.lookup(ns, head0) == 2, "a lookup promoted the voided units back"
    # Later, request c with the same prompt: looked up, computed (right KV: other values), saved by both ranks.
    for worker in workers:
        for layer in worker.layout.layers:
            layer.segments[0][:] = torch.randn(layer.segments[0].shape).to(torch.bfloat16)
    c = _request("c", PROMPT)
    assert _admit(sched, c) == BS  # block 1 is gone (rank 1's head), block 0 hits
    step = sched.build_connector_meta(_new_step(c, IDS, len(PROMPT) - BS))
    for worker in workers:
        worker.start_load(step)
        worker.save(step)
    right = _unit(workers[0], 14)
    assert right != wrong
    sched.request_finished(c, IDS)
    for worker in workers:
        worker.shutdown()
    sched.store.flush(upload_timeout_s=30)
    sched.shutdown()
    every = [unit_key(k, span, g) for k in keys for span in spans]
    with ucm_db.open(tmp_path / "s") as producer:
        assert producer.lookup(ns, head0) == 5
        assert bytes(producer.get(ns, [head0[4]])[0]) == right, "the producer serves the voided save's KV"
    with ucm_db.open(tmp_path / "consumer", remote=f"file://{shared}", remote_deadline_s=10) as other:
        got = other.get(ns, every)
        assert all(unit is not None for unit in got)
        assert bytes(got[4 * len(spans)]) == right, "another node is served the voided save's KV"
