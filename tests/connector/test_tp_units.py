"""TP-independent blocks, layout level: every (writer TP, reader TP) pair.

For each layout kind and KV head count, one model-wide KV cache (all heads)
stands for what every rank computes. Writers at TP 1, 2, 4 and 8 each run
real :class:`UcmDbWorker` s (one per rank, holding that rank's heads, as
vLLM shards them) that save three blocks into a real LMDB store; readers at
TP 1, 2, 4 and 8 load them into zeroed caches at other block ids. Each
reader rank's blocks must equal, bit for bit, that rank's heads of the
model-wide cache: what a same-TP writer would have left there. No engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.identity import KVShape, namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.keys.units import head_range  # noqa: E402

TP_SIZES = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8)
KINDS = ("cpu", "flash", "kv_tuple", "mla")
NUM_BLOCKS, BLOCK, HEAD, LAYERS, LATENT = 8, 16, 8, 2, 24
SRC_BLOCKS, DST_BLOCKS = [5, 1, 6], [2, 7, 0]

#: kind -> (make the model-wide cache of one layer, axis of the heads in it)
MAKERS: dict[str, tuple[Callable[[int], Any], int | None]] = {
    "cpu": (lambda h: torch.randn(NUM_BLOCKS, h, BLOCK, 2 * HEAD), 1),
    "flash": (lambda h: torch.randn(2, NUM_BLOCKS, BLOCK, h, HEAD), 3),
    "kv_tuple": (lambda h: (torch.randn(NUM_BLOCKS, BLOCK, h, HEAD), torch.randn(NUM_BLOCKS, BLOCK, h, HEAD)), 2),
    "mla": (lambda h: torch.randn(NUM_BLOCKS, BLOCK, LATENT), None),
}


def _shard(entry: Any, axis: int | None, heads: tuple[int, int]) -> Any:
    """A rank's copy of its heads (MLA: the whole latent, replicated)."""
    if isinstance(entry, tuple):
        return tuple(_shard(t, axis, heads) for t in entry)
    if axis is None:
        return entry.clone()
    return entry.narrow(axis, heads[0], heads[1] - heads[0]).contiguous()


def _blocks(entry: Any, kind: str, blocks: list[int]) -> torch.Tensor:
    """Blocks ``blocks`` of a cache as raw int32 (bit-exact comparison)."""
    index = torch.tensor(blocks)
    if kind == "kv_tuple":
        parts = [t.index_select(0, index) for t in entry]
    elif kind == "flash":
        parts = [entry.index_select(1, index)]
    else:
        parts = [entry.index_select(0, index)]
    return torch.cat([p.reshape(-1).view(torch.int32) for p in parts])


def _zeros(entry: Any) -> Any:
    return tuple(torch.zeros_like(t) for t in entry) if isinstance(entry, tuple) else torch.zeros_like(entry)


def _shape(kind: str, heads: int, tp: int) -> KVShape:
    return KVShape(
        model="tp-units", kv_dtype="float32", block_size=BLOCK, use_mla=kind == "mla", layout=f"test-{kind}-{heads}",
        tp_size=tp, pp_size=1, kv_heads=heads, layers=LAYERS,
    )


def _rank_heads(kind: str, heads: int, tp: int, rank: int) -> tuple[int, int]:
    return (0, 1) if kind == "mla" else head_range(heads, tp, rank)


def _meta(keys: list[bytes], block_ids: list[int], load: bool) -> UcmDbConnectorMetadata:
    meta = UcmDbConnectorMetadata()
    (meta.loads if load else meta.saves).append(BlockTransfer("r", tuple(keys), tuple(block_ids)))
    return meta


def _run_ranks(settings: ConnectorSettings, shape: KVShape, caches: list[dict[str, Any]], meta: UcmDbConnectorMetadata) -> list[UcmDbWorker]:
    workers = []
    for rank, kv in enumerate(caches):
        worker = UcmDbWorker(settings, shape, NUM_BLOCKS)
        worker.register_kv_caches(kv, rank, 0)
        if meta.saves:
            worker.save(meta)
            worker.drain()
        else:
            worker.start_load(meta)
        workers.append(worker)
    return workers


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_tp_loads_what_every_writer_tp_stored(tmp_path: Path, kind: str, heads: int) -> None:
    torch.manual_seed(heads)
    make, axis = MAKERS[kind]
    model_kv = {f"model.layers.{i}.self_attn.attn": make(heads) for i in range(LAYERS)}
    stored_bytes = {}
    for writer_tp in TP_SIZES:
        # One store per writer TP: every read below comes from that TP's units.
        settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / f"w{writer_tp}"), "codec": "zstd"})
        shape = _shape(kind, heads, writer_tp)
        keys = namespace(shape).block_keys(list(range(len(SRC_BLOCKS) * BLOCK)))
        ranks = [{n: _shard(e, axis, _rank_heads(kind, heads, writer_tp, r)) for n, e in model_kv.items()} for r in range(writer_tp)]
        for worker in _run_ranks(settings, shape, ranks, _meta(keys, SRC_BLOCKS, load=False)):
            worker.shutdown()
        with ucm_db.open(settings.path) as store:
            stats = store.stats()
            stored_bytes[writer_tp] = (stats.blocks, stats.raw_bytes)
        for reader_tp in TP_SIZES:
            shape_r = _shape(kind, heads, reader_tp)
            spans = [_rank_heads(kind, heads, reader_tp, r) for r in range(reader_tp)]
            caches = [{n: _zeros(_shard(e, axis, span)) for n, e in model_kv.items()} for span in spans]
            workers = _run_ranks(settings, shape_r, caches, _meta(keys, DST_BLOCKS, load=True))
            for rank, (worker, cache, span) in enumerate(zip(workers, caches, spans)):
                assert worker.take_load_errors() == set(), (writer_tp, reader_tp, rank)
                for name, entry in model_kv.items():
                    expected = _blocks(_shard(entry, axis, span), kind, SRC_BLOCKS)
                    assert torch.equal(_blocks(cache[name], kind, DST_BLOCKS), expected), (writer_tp, reader_tp, rank, name)
                    assert not _blocks(cache[name], kind, [3]).any()  # blocks not loaded stay untouched
                worker.shutdown()
    # Every writer TP stored the same units: one per head (MLA: one) per block.
    units = 1 if kind == "mla" else heads
    assert set(stored_bytes.values()) == {(units * len(SRC_BLOCKS), stored_bytes[1][1])}, stored_bytes


def test_mixed_writer_tps_store_each_byte_once(tmp_path: Path) -> None:
    """TP=2 then TP=1 then TP=4 writers of the same prompt on one store: the
    second and third find every unit present and store nothing."""
    heads = 4
    model_kv = {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, heads, BLOCK, 2 * HEAD) for i in range(LAYERS)}
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    keys = namespace(_shape("cpu", heads, 1)).block_keys(list(range(len(SRC_BLOCKS) * BLOCK)))
    counts = []
    for tp in (2, 1, 4):
        ranks = [{n: _shard(e, 1, head_range(heads, tp, r)) for n, e in model_kv.items()} for r in range(tp)]
        for worker in _run_ranks(settings, _shape("cpu", heads, tp), ranks, _meta(keys, SRC_BLOCKS, load=False)):
            worker.shutdown()
        with ucm_db.open(settings.path) as store:
            stats = store.stats()
            counts.append((stats.blocks, stats.raw_bytes))
    block_bytes = LAYERS * heads * BLOCK * 2 * HEAD * 4
    assert counts == [(heads * len(SRC_BLOCKS), block_bytes * len(SRC_BLOCKS))] * 3
