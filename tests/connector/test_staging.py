"""Save staging reuse (connector/worker/staging.py): a pooled buffer goes back to
the pool only after the writer is done with it, so reuse never mixes one
save's KV into another's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.identity import KVShape, namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.staging import StagingPool  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

BS, HEADS, LAYERS, NUM_BLOCKS = 16, 2, 2, 48


def test_released_buffer_is_reused_in_its_power_of_two_bucket() -> None:
    pool = StagingPool(lambda rows: torch.empty((rows, 2, 64), dtype=torch.uint8), max_free_bytes=1 << 20)
    first = pool.take(5)
    assert tuple(first.staging.shape) == (5, 2, 64)
    other = pool.take(5)  # first is still leased: never handed out twice
    assert other.staging.data_ptr() != first.staging.data_ptr()
    first.release()
    first.release()  # idempotent: the buffer is not pooled twice
    assert pool.free_bytes == 8 * 2 * 64
    again = pool.take(7)  # same bucket (8 rows)
    assert again.staging.data_ptr() == first.staging.data_ptr() and again.staging.shape[0] == 7
    assert pool.free_bytes == 0
    bigger = pool.take(9)  # 16-row bucket: a new buffer
    assert bigger.staging.data_ptr() not in (first.staging.data_ptr(), other.staging.data_ptr())


def test_free_buffers_are_bounded() -> None:
    pool = StagingPool(lambda rows: torch.empty((rows, 1, 1024), dtype=torch.uint8), max_free_bytes=4096)
    leases = [pool.take(4) for _ in range(3)]  # 4 KiB each
    for lease in leases:
        lease.release()
    assert pool.free_bytes == 4096  # one kept, two freed


def _shape() -> KVShape:
    return KVShape(model="staging", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test", tp_size=1,
                   pp_size=1, kv_heads=HEADS, layers=LAYERS)


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, HEADS, BS, 64)
    return {f"layers.{i}.attn": (torch.randn(shape).to(torch.bfloat16) if fill else torch.zeros(shape, dtype=torch.bfloat16))
            for i in range(LAYERS)}


def _worker(path: Path, caches: dict[str, torch.Tensor]) -> UcmDbWorker:
    settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", "load_policy": "always"})
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(caches, 0, 0)
    return worker


def test_queued_saves_keep_their_staging_until_committed(tmp_path: Path) -> None:
    """Many saves queue behind a writer held at its first commit (a gate
    around the store's put: the one way to make the writer lag on demand);
    each save's staging stays its own until committed, so every block loads
    back with its own KV, and the buffers are pooled afterwards."""
    source = _caches(fill=True)
    saver = _worker(tmp_path / "s", source)
    gate = threading.Event()
    writer_store = saver._writer._store  # type: ignore[union-attr]
    real_put = writer_store.put_segments

    def gated_put(*args: object, **kwargs: object) -> object:
        gate.wait(30)
        return real_put(*args, **kwargs)

    writer_store.put_segments = gated_put  # type: ignore[method-assign]
    keys = namespace(_shape()).block_keys(list(range(NUM_BLOCKS * BS)))
    step = 3
    for start in range(0, NUM_BLOCKS, step):
        meta = UcmDbConnectorMetadata()
        ids = tuple(range(start, start + step))
        meta.saves.append(BlockTransfer("r", tuple(keys[start:start + step]), ids, parent=keys[start - 1] if start else None))
        saver.save(meta)  # staged while earlier saves wait for the gate
    assert saver._staging.free_bytes == 0  # type: ignore[attr-defined]  # nothing released before its commit
    gate.set()
    saver.drain()
    assert saver._staging.free_bytes > 0  # type: ignore[attr-defined]
    assert saver.counters.totals.data["saved_blocks"] == NUM_BLOCKS
    saver.shutdown()

    target = _caches(fill=False)
    reader = _worker(tmp_path / "s", target)
    meta = UcmDbConnectorMetadata()
    meta.loads.append(BlockTransfer("r", tuple(keys), tuple(range(NUM_BLOCKS))))
    reader.start_load(meta)
    assert reader.take_load_errors() == set()
    for name, expected in source.items():
        assert torch.equal(target[name].view(torch.int16), expected.view(torch.int16))
    reader.shutdown()
