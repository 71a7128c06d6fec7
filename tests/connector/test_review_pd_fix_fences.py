"""Review fixes of 2bbb753's producer fences (connector/scheduler/settlement.py).

(a) A hybrid model's group may lose every save of a step after planning
    (``GroupedScheduler._keeps``: a save meeting vLLM's null block): its
    worker then drains nothing in that step, so a fence noted as drained by
    it must wait for a later saving step. It was lifted once that step's
    output was back, though the void it waited for had not run.
(b) At most MAX_FENCES fences were kept, the oldest dropped first, though
    its void may not have run yet; now only fences whose draining step is
    planned are dropped, never one still waiting for it.

Real parts: vLLM's VllmConfig and KVCacheConfig of a tiny Gemma 2 (two KV
cache groups), the real connector facade and a real store for (a); the
settlement's own API for (b). The fence of (a) is made through the window
group's settlement (a sibling's failed load voiding a committed save, as
composition.py records it): producing one through a MultiConnector of
hybrid children needs an engine this file has no stand-in for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from test_hybrid import TOKENS, _Output, _groups, _request, _step, _vllm_config, blocks_of, model_dir  # noqa: E402,F401

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.scheduler import settlement  # noqa: E402
from ucm_db.connector.scheduler.settlement import SaveSettlement  # noqa: E402


def _void(fences: SaveSettlement, key: bytes, block: int) -> None:
    """A committed save over a sibling's load of ``block`` that failed: voided, its ``key`` fenced."""
    fences.record_loads(UcmDbConnectorMetadata(step=-1), [("sibling", (block,))])
    fences.track(-1, BlockTransfer("sibling", (key,), (block + 1,), after_loads=(block,)), 0, sibling=True)
    fences.settle(None, {block}, lambda req_id, start: None)


def test_a_hybrid_groups_step_that_lost_its_saves_keeps_its_fence(model_dir: Path, tmp_path: Path) -> None:
    config = _vllm_config(model_dir, {"path": str(tmp_path / "store")})
    config.kv_transfer_config.kv_role = "kv_producer"  # type: ignore[union-attr]
    scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _groups())
    grouped = scheduler._scheduler
    window = grouped.parts[0]  # the sliding-window group's scheduler
    voided = b"v" * 32
    _void(window._settlement, voided, 40)
    assert window._settlement.unfenced([voided], 1) == 0
    req = _request("a", TOKENS)
    block_ids = ([0, 0, 3, 4, 5, 6, 7], list(range(11, 18)))  # the window group's first blocks are vLLM's null block
    hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert hit == 0
    scheduler.update_state_after_alloc(req, blocks_of(block_ids), 0)
    meta = scheduler.build_connector_meta(_step(req, block_ids, req.num_tokens))
    assert [len(m.saves) for m in meta.groups] == [0, 1]  # the window group's save met the null block: dropped
    scheduler.update_connector_output(_Output(UcmDbWorkerMetadata(meta.step), set()))  # type: ignore[arg-type]
    fenced = window._settlement.unfenced([voided], 1)
    scheduler.shutdown()
    assert fenced == 0  # was 1: lifted, though the window group's worker drained nothing in that step


def test_a_fence_whose_void_is_not_planned_is_never_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settlement, "MAX_FENCES", 2)
    fences = SaveSettlement(several_ranks=True, publishes=True)
    keys = [bytes([i]) * 32 for i in range(4)]
    for i, key in enumerate(keys):
        _void(fences, key, 10 * i)
    assert [fences.unfenced([key], 1) for key in keys] == [0, 0, 0, 0]  # was [1, 1, 0, 0]: the oldest two dropped
    saving = UcmDbConnectorMetadata(step=0, saves=[BlockTransfer("other", (b"s" * 32,), (99,))])
    fences.take_verdicts(saving)  # every fence is drained by step 0 now
    _void(fences, b"n" * 32, 90)  # a fifth: the oldest drained ones go, down to MAX_FENCES of them
    assert [fences.unfenced([key], 1) for key in [*keys, b"n" * 32]] == [1, 1, 0, 0, 0]
