"""A model whose only KV cache group is a sliding window (Mistral-7B-v0.1's
kind: one uniform group, served by the ordinary path): vLLM's block tables
then hold its null block (id 0) outside the window, and the connector must
never save from it (its zeros would be stored under a prompt's keys) nor
load into it (connector/hybrid/null_blocks.py). Both halves of the real
connector facade, a real store, vLLM-CPU's KV cache layout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402

from tests.connector.test_hybrid import BS, LAYER, NUM_BLOCKS, WINDOW, _request, _step, _vllm_config, blocks_of, model_dir  # noqa: E402,F401
from ucm_db.connector import UcmDbConnector  # noqa: E402

LAYERS = [LAYER.format(i) for i in range(4)]
TOKENS = list(range(7, 7 + 6 * BS + 5))  # 6 whole blocks and 5 tokens
NULL = 0


def _window_only() -> KVCacheConfig:
    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=WINDOW)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    caches = {name: torch.zeros((NUM_BLOCKS, 2, BS, 128), dtype=torch.bfloat16) if seed is None
              else torch.randn((NUM_BLOCKS, 2, BS, 128), generator=gen).to(torch.bfloat16) for name in LAYERS}
    for cache in caches.values():
        cache[NULL].zero_()  # vLLM's null block holds zeros
    return caches


class _Engine:
    def __init__(self, model_dir: Path, store: Path, kv: dict[str, torch.Tensor]) -> None:
        config = _vllm_config(model_dir, {"path": str(store)})
        self.scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _window_only())
        self.worker = UcmDbConnector(config, KVConnectorRole.WORKER, _window_only())
        self.worker.register_kv_caches(kv)

    def run(self, req_id: str, block_ids: list[int], local_tokens: int = 0) -> tuple[int, object]:
        """Lookup, allocation and the prefill step of TOKENS; (hit tokens, the step's metadata)."""
        req = _request(req_id, TOKENS)
        hit, is_async = self.scheduler.get_num_new_matched_tokens(req, local_tokens)
        assert hit is not None and not is_async
        self.scheduler.update_state_after_alloc(req, blocks_of((block_ids,)), hit)
        req.num_computed_tokens = local_tokens + hit
        meta = self.scheduler.build_connector_meta(_step(req, (block_ids,), len(TOKENS) - req.num_computed_tokens))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        assert self.worker.get_block_ids_with_load_errors() == set()
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.worker._worker.drain()  # type: ignore[union-attr]
        self.scheduler.request_finished_all_groups(req, (block_ids,))
        return hit, meta

    def stored_blocks(self) -> int:
        return sum(ns.blocks for ns in self.scheduler._held_store.stats().namespaces.values())  # type: ignore[union-attr]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def test_a_window_only_model_never_saves_from_nor_loads_into_the_null_block(model_dir: Path, tmp_path: Path) -> None:
    first = _Engine(model_dir, tmp_path / "store", _kv(1))
    assert first.scheduler._null_blocks.active
    # vLLM's own cache holds the first 5 blocks, the store none (a save refused or
    # evicted before): below the window vLLM's table holds the null block.
    hit, meta = first.run("local", [NULL, NULL, NULL, 13, 14, 15, 16], local_tokens=5 * BS)
    assert hit == 0 and meta.saves == []  # a chain from the null block's zeros is never stored
    assert first.stored_blocks() == 0
    # The whole prompt computed in its own blocks: stored.
    assert first.run("whole", list(range(1, 8)))[0] == 0
    assert first.stored_blocks() == 6 * 2  # 6 blocks x 2 KV heads
    first.close()

    fresh = _kv(None)
    second = _Engine(model_dir, tmp_path / "store", fresh)
    # An external hit: vLLM pads the blocks it skips below the window with the null block.
    hit, meta = second.run("hit", [NULL, NULL, 23, 24, 25, 26, 27])
    assert hit == 6 * BS
    assert all(NULL not in t.block_ids for t in meta.loads) and meta.loads  # the window's blocks loaded, not block 0
    for cache in fresh.values():
        assert not cache[NULL].any()  # the null block still holds zeros
    saved = _kv(1)
    for name in LAYERS:
        for old, new in zip(range(3, 7), [23, 24, 25, 26]):  # blocks 2-5 (block i was at i + 1)
            assert torch.equal(fresh[name][new], saved[name][old])
    second.close()


def test_an_async_load_left_without_blocks_is_still_reported_finished(model_dir: Path, tmp_path: Path) -> None:
    """vLLM holds an async-loading request until the worker reports it: a
    load whose every block is the null block is emptied, not dropped, and
    the worker reports it at once."""
    from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

    engine = _Engine(model_dir, tmp_path / "store", _kv(None))
    nulls = BlockTransfer("all-null", keys=(b"k" * 32, b"j" * 32), block_ids=(NULL, NULL))
    real = BlockTransfer("real", keys=(b"i" * 32, b"h" * 32), block_ids=(NULL, 5))
    meta = engine.scheduler._null_blocks.apply(UcmDbConnectorMetadata(step=1, async_loads=[nulls, real], loads=[nulls]))
    assert meta.loads == [] and [t.block_ids for t in meta.async_loads] == [(), (5,)]
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv(None)  # type: ignore[arg-type]
    engine.worker.clear_connector_metadata()
    reported: set[str] = set()
    for _ in range(50):
        _, recving = engine.worker.get_finished(set())
        reported |= recving or set()
        if reported >= {"all-null", "real"}:
            break
        time.sleep(0.05)
    assert reported == {"all-null", "real"}
    engine.close()
