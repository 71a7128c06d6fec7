"""Start-up of the connector (issue 11, item 6): a bad setting or an unusable
store stops it in its constructor (and in the engine core's earlier
``get_required_kvcache_layout`` call) with the hint in the error's first line
and one log line; a ``kv_consumer`` serves a store on a read-only volume.

Real vLLM config objects (a model directory holding only config.json), real
stores, a real read-only bind mount; no engine.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from readonly_mount import read_only_view, tree  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.identity import KVShape  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.stores import role_settings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError, TierError, UcmDbError  # noqa: E402

BLOCK = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
ROLES = (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("startup") / "model"
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512).save_pretrained(out)
    return out


def _configs(model_dir: Path, extra: dict[str, Any], kv_role: str = "kv_both") -> tuple[VllmConfig, KVCacheConfig]:
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role=kv_role,
                                kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=transfer,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return vllm_config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def start_log() -> Any:
    handler = _Lines()
    log = logging.getLogger("vllm.ucm_db.connector.connector")
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


def _assert_reported(exc: UcmDbError, lines: list[str], words: str) -> None:
    first = str(exc).splitlines()[0]
    assert words in first and f"(hint: {exc.hint})" in first and exc.hint
    assert lines and lines[-1] == f"ucm-db connector cannot start: {exc}"


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_a_bad_setting_stops_either_role_in_its_constructor(model_dir: Path, tmp_path: Path, start_log: list[str],
                                                            role: KVConnectorRole) -> None:
    vllm_config, kv_cache_config = _configs(model_dir, {"path": str(tmp_path / "store"), "capacity_bytes": "lots"})
    with pytest.raises(ConfigError) as info:
        UcmDbConnector(vllm_config, role, kv_cache_config)
    _assert_reported(info.value, start_log, "capacity_bytes must be an integer")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_an_unusable_store_stops_either_role_in_its_constructor(model_dir: Path, tmp_path: Path, start_log: list[str],
                                                                role: KVConnectorRole) -> None:
    (tmp_path / "store").write_text("not a directory")
    vllm_config, kv_cache_config = _configs(model_dir, {"path": str(tmp_path / "store")})
    with pytest.raises(TierError) as info:
        UcmDbConnector(vllm_config, role, kv_cache_config)
    _assert_reported(info.value, start_log, "is a file, not a directory")


def test_the_engine_cores_early_layout_question_runs_the_same_checks(model_dir: Path, tmp_path: Path, start_log: list[str]) -> None:
    (tmp_path / "store").write_text("not a directory")
    with pytest.raises(TierError) as info:
        UcmDbConnector.get_required_kvcache_layout(_configs(model_dir, {"path": str(tmp_path / "store")})[0])
    _assert_reported(info.value, start_log, "is a file, not a directory")
    good = _configs(model_dir, {"path": str(tmp_path / "good")})[0]
    assert UcmDbConnector.get_required_kvcache_layout(good) is None
    assert (tmp_path / "good" / "lmdb" / "data.mdb").exists()  # opened (and closed again)


def test_cuda_graph_question_checks_settings_and_names_layer_mode(tmp_path: Path, start_log: list[str]) -> None:
    assert UcmDbConnector.requires_piecewise_for_cudagraph({"path": str(tmp_path), "load_mode": "layer"}) is True
    assert UcmDbConnector.requires_piecewise_for_cudagraph({"path": str(tmp_path)}) is False
    with pytest.raises(ConfigError) as info:
        UcmDbConnector.requires_piecewise_for_cudagraph({"path": str(tmp_path), "lode_mode": "layer"})
    _assert_reported(info.value, start_log, "lode_mode")


def test_a_connector_holds_its_store_from_construction_to_shutdown(model_dir: Path, tmp_path: Path) -> None:
    vllm_config, kv_cache_config = _configs(model_dir, {"path": str(tmp_path / "store")})
    worker = UcmDbConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    assert (tmp_path / "store" / "lmdb" / "data.mdb").exists()  # before any KV cache is registered
    held = worker._held_store
    assert held is not None
    worker.shutdown()
    assert worker._held_store is None
    with pytest.raises(UcmDbError):  # closed with the last reference
        held.stats()


# -- a kv_consumer on a read-only volume ------------------------------------------------
SHAPE = KVShape(model="tiny", kv_dtype="bfloat16", block_size=BLOCK, use_mla=False, layout="cpu-test", tp_size=1, pp_size=1,
                kv_heads=2, layers=2)


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    shape = (16, 2, BLOCK, 128)
    if seed is None:
        return {f"layers.{i}.attn": torch.zeros(shape, dtype=torch.bfloat16) for i in range(2)}
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(2)}


def _step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: (block_ids,), {})
    return out


def _produce(path: Path, tokens: list[int], kv: dict[str, torch.Tensor]) -> None:
    settings, role = role_settings({"path": str(path)}, "kv_producer")
    sched, worker = UcmDbScheduler(settings, SHAPE, role), UcmDbWorker(settings, SHAPE, 16, role)
    worker.register_kv_caches(kv, 0, 0)
    req = Request("p", tokens, SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
    worker.save(sched.build_connector_meta(_step(req, list(range(len(tokens) // BLOCK + 1)), len(tokens))))
    worker.shutdown()
    sched.shutdown()


def test_a_consumer_serves_hits_from_a_read_only_volume(model_dir: Path, tmp_path: Path) -> None:
    tokens = list(range(3, 3 + 4 * BLOCK + 5))
    kv = _kv(3)
    _produce(tmp_path / "src" / "store", tokens, kv)
    before = tree(tmp_path / "src")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        extra = {"path": str(ro / "store")}
        settings, role = role_settings(extra, "kv_consumer")
        assert settings.store_options["read_only"] is True  # decided from the volume, not set by the user
        for saving in ("kv_both", "kv_producer"):
            with pytest.raises(TierError, match="not writable") as refused:
                role_settings(extra, saving)
            assert "kv_consumer" in refused.value.hint
        # The facade of both roles starts on it.
        vllm_config, kv_cache_config = _configs(model_dir, extra, "kv_consumer")
        for connector_role in ROLES:
            UcmDbConnector(vllm_config, connector_role, kv_cache_config).shutdown()
        sched, worker = UcmDbScheduler(settings, SHAPE, role), UcmDbWorker(settings, SHAPE, 16, role)
        fresh = _kv(None)
        worker.register_kv_caches(fresh, 0, 0)
        req = Request("c", tokens, SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
        ext, is_async = sched.get_num_new_matched_tokens(req, 0)
        assert (ext, is_async) == (4 * BLOCK, False)
        sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
        req.num_computed_tokens = ext
        meta = sched.build_connector_meta(_step(req, [9, 10, 11, 12, 13], len(tokens) - ext))
        assert meta.saves == [] and meta.loads[0].block_ids == (9, 10, 11, 12)
        worker.start_load(meta)
        assert worker.take_load_errors() == set()
        for name in kv:
            assert torch.equal(fresh[name][9:13].view(torch.int16), kv[name][0:4].view(torch.int16))
        assert sched.counters.totals.data["compression_ratio"] > 0  # a load-only server reports the store's ratio
        worker.shutdown()
        sched.shutdown()
    assert tree(tmp_path / "src") == before


def test_read_only_is_a_setting_too_and_a_saving_role_refuses_it(tmp_path: Path) -> None:
    extra = {"path": str(tmp_path / "store"), "read_only": True}
    settings, _ = role_settings(extra, "kv_consumer")
    assert settings.store_options["read_only"] is True
    with pytest.raises(TierError, match="read_only is set") as info:
        role_settings(extra, "kv_both")
    assert "kv_consumer" in info.value.hint
    assert RolePolicy("kv_consumer").saves is False
