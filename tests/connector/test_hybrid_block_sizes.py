"""KV cache groups of different block sizes (connector/hybrid/groups.py).

vLLM gives every KV cache group pages of one size: where layers of one kind
have a smaller page (fewer KV heads, a smaller head), vLLM's
``unify_kv_cache_spec_page_size`` enlarges their block size instead. A tiny
Gemma 4 (sliding-window layers of head size 64, full-attention layers of head
size 128) gets a sliding-window group of 64-token blocks beside a
full-attention group of 32-token blocks; the scheduler's block size is their
lcm (64), ``cache_config.block_size`` their minimum (32). Before, ucm-db read
every group's block ids as blocks of 32 tokens: the sliding-window group
stored nothing of a prefill and a restarted engine hit nothing.

Real parts: vLLM's specs made by ``unify_kv_cache_spec_page_size``, its
``KVCacheConfig``, its ``Scheduler`` (the block ids it hands the connector
per group), the connector facade of both roles, a real store, CPU KV
tensors of the shape vLLM-CPU gives each group; no model runs
(tests/vllm/test_hybrid_block_sizes_engine.py runs one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.hybrid.groups import claim_step, group_extra, group_namespace, kv_groups  # noqa: E402
from ucm_db.connector.hybrid.hooks import GroupedScheduler, group_shape  # noqa: E402
from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

from test_hybrid import _request, _vllm_config, model_dir  # noqa: E402,F401
from test_hybrid_failed_loads import _run  # noqa: E402

BS = 32  # cache_config.block_size: the full-attention group's
WINDOW_BS = 64  # the sliding-window group's, enlarged by vLLM
NUM_BLOCKS = 48
LAYER = "model.layers.{}.self_attn.attn"
WINDOW_LAYERS = [LAYER.format(i) for i in (0, 2)]
FULL_LAYERS = [LAYER.format(i) for i in (1, 3)]
TOKENS = list(range(7, 7 + 7 * BS + 5))  # 229 tokens: 7 whole 32-token blocks, 3 whole 64-token ones


def _groups(window_head: int = 64) -> KVCacheConfig:
    """vLLM's groups of the tiny Gemma 4: specs at block size 32 made
    uniform in page size by vLLM (``window_head`` 128: pages already equal)."""
    specs = unify_kv_cache_spec_page_size({
        **{n: SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=window_head, dtype=torch.bfloat16, sliding_window=128)
           for n in WINDOW_LAYERS},
        **{n: FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=128, dtype=torch.bfloat16) for n in FULL_LAYERS},
    })
    groups = [KVCacheGroupSpec(WINDOW_LAYERS, specs[WINDOW_LAYERS[0]]), KVCacheGroupSpec(FULL_LAYERS, specs[FULL_LAYERS[0]])]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM-CPU's KV caches ([blocks, heads, group's block size, 2 * head size]): one page size."""
    gen = torch.Generator().manual_seed(seed or 0)
    shapes = {**{n: (NUM_BLOCKS, 2, WINDOW_BS, 128) for n in WINDOW_LAYERS}, **{n: (NUM_BLOCKS, 2, BS, 256) for n in FULL_LAYERS}}
    return {n: torch.zeros(s, dtype=torch.bfloat16) if seed is None else torch.randn(s, generator=gen).to(torch.bfloat16)
            for n, s in shapes.items()}


class _Engine:
    """vLLM's scheduler (it makes ucm-db's scheduler half) and ucm-db's worker half over the tiny Gemma 4's groups."""

    def __init__(self, model_dir: Path, store: Path, kv: dict[str, torch.Tensor]) -> None:
        config = _vllm_config(model_dir, {"path": str(store)})
        config.cache_config.enable_prefix_caching = False
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        # What vLLM's engine core passes: the groups' lcm, and hashes at their gcd (resolve_kv_cache_block_sizes).
        self.sched = Scheduler(config, _groups(), StructuredOutputManager(config), WINDOW_BS, BS)
        self.worker = UcmDbConnector(config, KVConnectorRole.WORKER, _groups())
        self.worker.register_kv_caches(kv)
        self.kv = kv
        self.ours = self.sched.connector._scheduler  # type: ignore[union-attr]
        assert isinstance(self.ours, GroupedScheduler)

    def hits(self, *reqs: Any) -> dict[str, int]:
        """Runs the requests to their end; each one's tokens computed when first scheduled (its hit)."""
        for req in reqs:
            self.sched.add_request(req)
        hits = _run(self.sched, self.worker)
        self.worker._worker.drain()  # type: ignore[union-attr]
        return hits

    def stored(self) -> dict[int, int]:
        """Block size of each group namespace -> its stored units."""
        return {ns.description["block_size"]: ns.blocks for ns in self.ours.parts[0].store.stats().namespaces.values()}

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]


def test_vllm_gives_the_groups_their_own_block_sizes() -> None:
    """The facts the connector serves: vLLM's groups, and the hit step ucm-db derives."""
    groups = kv_groups(_groups())
    assert [(g.kind, g.block_size) for g in groups] == [("sliding_window", WINDOW_BS), ("full_attention", BS)]
    assert claim_step(groups, BS) == WINDOW_BS
    assert [g.block_size for g in kv_groups(_groups(window_head=128))] == [BS, BS]


def test_each_group_is_saved_keyed_and_loaded_at_its_own_block_size(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    saved = _kv(1)
    writer = _Engine(model_dir, tmp_path / "store", saved)
    assert writer.hits(_request("a", TOKENS)) == {"a": 0}
    # Before: {32: 7 * 2}; the sliding-window group's 64-token blocks were read as 32-token ones, and none saved.
    assert writer.stored() == {WINDOW_BS: 3 * 2, BS: 7 * 2}  # whole blocks of 2 head units per group
    window = writer.ours.parts[0]
    assert window.namespace.block_size == WINDOW_BS
    assert window.keys_for(_request("k", TOKENS), 3) == list(window.namespace.block_keys(TOKENS, stop=3 * WINDOW_BS))
    writer.close()

    fresh = _kv(None)
    reader = _Engine(model_dir, tmp_path / "store", fresh)
    assert reader.hits(_request("b", TOKENS)) == {"b": 3 * WINDOW_BS}  # 192: the 64-token group's 3 blocks
    # Every block the reader loaded holds the writer's page of the same tokens (null blocks aside).
    pages = {n: {bytes(saved[n][i].view(torch.uint8).flatten().numpy()) for i in range(1, NUM_BLOCKS)} for n in saved}
    loaded = {n: [fresh[n][i] for i in range(1, NUM_BLOCKS) if fresh[n][i].any()] for n in fresh}
    assert [len(loaded[n]) for n in WINDOW_LAYERS + FULL_LAYERS] == [2, 2, 6, 6]  # window: block 0 of 3 is outside it
    for name, blocks in loaded.items():
        assert all(bytes(b.view(torch.uint8).flatten().numpy()) in pages[name] for b in blocks), name
    reader.close()


def test_a_hit_ends_where_every_group_holds_whole_blocks(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """The full-attention group holds 5 blocks (160 tokens), the sliding-window
    group 3 (192): 160 would claim half a 64-token block the sliding-window
    group cannot load (wrong KV): the hit is 128, the lcm's multiple."""
    writer = _Engine(model_dir, tmp_path / "store", _kv(2))
    writer.hits(_request("a", TOKENS))
    full = writer.ours.parts[1]
    shape = group_shape(writer.worker.shape, writer.ours.groups[1])
    key = full.keys_for(_request("k", TOKENS), 6)[5]
    full.store.delete(full.namespace, [k for span in reader_spans(shape) for k in UnitKeys([key], grid(shape), span)])
    writer.close()
    reader = _Engine(model_dir, tmp_path / "store", _kv(None))
    answers = [part.get_num_new_matched_tokens(_request("probe", TOKENS), 0)[0] for part in reader.ours.parts]
    assert answers == [3 * WINDOW_BS, 5 * BS]
    assert reader.hits(_request("c", TOKENS)) == {"c": 2 * WINDOW_BS}
    reader.close()


def test_groups_of_one_block_size_keep_their_namespaces(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Stores written before stay valid: a group at the deployment's block
    size has the namespace it had (the deployment's, with the group's
    description); one at another block size names it, so an engine whose
    group has another block size never reads its blocks."""
    config = _vllm_config(model_dir, {"path": str(tmp_path / "store")})
    for groups, window_block_size in ((_groups(window_head=128), BS), (_groups(), WINDOW_BS)):
        connector = UcmDbConnector(config, KVConnectorRole.SCHEDULER, groups)
        base = namespace(connector.shape)
        assert base.block_size == BS
        before = [Namespace.from_dict({**base.to_dict(), "extra": group_extra(base.extra, json.dumps(
            g.describe(), sort_keys=True, separators=(",", ":")))}) for g in connector.groups]  # ucm-db's namespaces before
        window, full = [group_namespace(base, connector.groups, g) for g in connector.groups]
        assert full == before[1] and window.to_dict() == {**before[0].to_dict(), "block_size": window_block_size}
        assert (window.id == before[0].id) is (window_block_size == BS)
        connector.shutdown()
