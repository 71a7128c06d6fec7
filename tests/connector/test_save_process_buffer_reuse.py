"""``save_process``: a shared staging buffer freed on the model's thread
(a held save dropped while the staging pool is full) and a new one mapped
into its place the same step: the next save still commits (the worker
audit's F3: ``locate`` named the freed buffer, whose FORGET the same
request sent before the PUT, so the child failed the writer's round).

Real parts: the worker (TP=2, rank 0) with a real commit process and
shared staging, a real store, CPU KV tensors; the metadata is built by
hand, as the scheduler builds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, _shape  # noqa: E402

NUM_BLOCKS = 200


def _transfer(tag: int, first: int, blocks: int, hold_id: int = -1) -> BlockTransfer:
    keys = tuple(bytes([tag, i % 256, i // 256]) * 10 + b"xx" for i in range(blocks))
    return BlockTransfer(f"r{tag}", keys, tuple(range(first, first + blocks)), hold_id=hold_id)


def _step(worker: UcmDbWorker, meta: UcmDbConnectorMetadata) -> dict[str, float]:
    """Runs one step's loads and saves, waits for the writer; the counters' change."""
    before = dict(worker.counters.totals.data)
    worker.start_load(meta)
    worker.save(meta)
    worker.drain()
    return {name: value - before.get(name, 0) for name, value in worker.counters.totals.data.items()}


def test_a_save_staged_where_a_dropped_held_save_was_commits(tmp_path: Path) -> None:
    # 1 MiB of pending saves: the staging pool keeps at most 1 MiB of free buffers.
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "codec": "none", "save_process": True,
                                                    "max_pending_save_bytes": 1 << 20})
    worker = UcmDbWorker(settings, _shape(tp_size=2), NUM_BLOCKS)
    kv = {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, 1, BS, 128).to(torch.bfloat16) for i in range(2)}
    worker.register_kv_caches(kv, 0, 0)
    assert worker._writer is not None and worker._writer._route.committer is not None
    # Step 0: a 32-block save commits; its 512 KiB buffer goes back to the pool.
    assert _step(worker, UcmDbConnectorMetadata(step=0, saves=[_transfer(1, 0, 32)])).get("saved_blocks") == 32
    # Step 1: a 64-block save is held for the scheduler's verdict (a new 1 MiB buffer).
    assert not _step(worker, UcmDbConnectorMetadata(step=1, saves=[_transfer(2, 40, 64, hold_id=0)])).get("saved_blocks")
    # Step 2: the verdict drops it; the full pool frees its buffer on this thread, and
    # this step's 64-block save maps a new one, which the kernel places in the hole.
    changed = _step(worker, UcmDbConnectorMetadata(step=2, held_drops=[0], saves=[_transfer(3, 110, 64)]))
    assert changed.get("saves_voided") == 64
    assert changed.get("saved_blocks") == 64
    assert not worker.counters.totals.data.get("save_errors")
    worker.shutdown()
