"""A worker refuses to start when the KV caches vLLM registers are not laid
out as its namespace says (connector/layout_views.py, called from
connector/worker/hooks.py ``register_kv_caches``): units stored under a
namespace describing another byte arrangement would be wrong KV for every
engine on the store.

Real vLLM configs and specs, the worker's namespace from the connector's own
``kv_shape``, KV caches from vLLM 0.32's own allocator as vLLM-CPU makes them
(test_layout_identity.py), a real worker half on a real store. Off CPU the
platform is a stand-in while the namespace is computed (no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import _vllm_config, model_dir  # noqa: E402,F401
from tests.connector.test_layout_identity import LAYERS, _allocated, _kv, _on, _spec  # noqa: E402
from ucm_db.connector.identity import KVShape, kv_shape  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

NUM_BLOCKS = 8


def _start(tmp_path: Path, shape: KVShape, caches: dict[str, torch.Tensor]) -> UcmDbWorker:
    """A worker half of ``shape`` that registered ``caches`` (rank 0 of TP=1), on a store of its own."""
    worker = UcmDbWorker(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")}), shape, NUM_BLOCKS)
    try:
        worker.register_kv_caches(caches, 0, 0)
    except BaseException:
        worker.shutdown()
        raise
    return worker


def _flash_like() -> dict[str, torch.Tensor]:
    """FlashAttention's caches before vLLM 0.32 (``[2, blocks, block, heads,
    head]``) for the spec of :func:`_spec`: 2 heads per rank, units of
    the same size as the CPU layout's, another byte order."""
    return {name: torch.randn(2, NUM_BLOCKS, 32, 2, 64).to(torch.bfloat16) for name in LAYERS}


def _cpu_default(model_dir: Path, **spec: Any) -> KVShape:
    config = _vllm_config(model_dir)
    if spec.get("dtype") is torch.uint8:
        config.cache_config.cache_dtype = "fp8"
    shape = kv_shape(config, _kv(_spec(**spec)), "kv-view-test")
    assert "kv_view" not in json.loads(shape.layout)  # the default CPU layout: the namespace names no view
    return shape


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_vllm_cpu_caches_start_under_the_default_cpu_namespace(model_dir: Path, tmp_path: Path, order: str,  # noqa: F811
                                                                dtype: torch.dtype) -> None:
    worker = _start(tmp_path, _cpu_default(model_dir, dtype=dtype), _allocated(_spec(dtype=dtype), order, NUM_BLOCKS))
    try:
        assert worker.layout.kind == "cpu" and worker.layout.heads == 2
    finally:
        worker.shutdown()


def test_vllm_cpu_caches_split_into_kernel_blocks_start_too(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A vLLM block of 32 tokens as two kernel blocks of 16 (the allocator's
    ``kernel_block_sizes``): its tokens are the vLLM block's."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = _spec()
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(LAYERS), layers=LAYERS, layer_stride=page * NUM_BLOCKS, block_stride=page)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout["LBHNC"], kernel_block_sizes=[16])
    assert next(iter(caches.values())).shape == (2 * NUM_BLOCKS, 2, 16, 128)
    _start(tmp_path, _cpu_default(model_dir), caches).shutdown()


@pytest.mark.parametrize("caches", ["flash", "cpu-16x256"])
def test_caches_of_another_layout_with_the_same_unit_size_are_refused_under_the_cpu_namespace(
        model_dir: Path, tmp_path: Path, caches: str) -> None:  # noqa: F811
    """Units of one size, other bytes: a flash-like cache, and a 4-D cache
    whose head block is 16 tokens of 256 bf16 (K and V of two tokens
    side by side, as a packed layout could be): the CPU namespace names
    neither. The layer and head counts agree (the check before this one)."""
    shape = _cpu_default(model_dir)
    kv = _flash_like() if caches == "flash" else {n: torch.randn(NUM_BLOCKS, 2, 16, 256).to(torch.bfloat16) for n in LAYERS}
    with pytest.raises(ConfigError) as refused:
        _start(tmp_path, shape, kv)
    message, hint = refused.value.message, refused.value.hint
    seen = '"kind": "flash", "block": [32, 256]' if caches == "flash" else '"kind": "cpu", "block": [16, 512]'
    assert f"laid out as {{{seen}, \"head_slots\": 2}}" in message
    assert 'names the view {"kind": "cpu", "block": [32, 256], "head_slots": 2} (the default CPU layout' in message
    assert "worker tp=0 pp=0" in message and LAYERS[0] in message
    assert "bug" in hint and "both views" in hint and "without ucm-db" in hint


def test_a_namespace_naming_a_view_takes_the_caches_that_show_it_only(model_dir: Path, tmp_path: Path,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA namespace (a stand-in platform) names vLLM 0.32's view
    ``[blocks, heads, block, K|V]``: caches viewed so start (here host
    tensors of that view), an older vLLM's FlashAttention caches do not."""
    config, spec = _vllm_config(model_dir), _spec()
    with monkeypatch.context() as patched:
        _on(patched, "cuda")
        shape = kv_shape(config, _kv(spec), "kv-view-test")
    assert json.loads(shape.layout)["kv_view"] == {"kind": "cpu", "block": [32, 256]}
    _start(tmp_path, shape, _allocated(spec, "LBNHC", NUM_BLOCKS)).shutdown()
    with pytest.raises(ConfigError, match=r'laid out as \{"kind": "flash".*names the view \{"kind": "cpu"'):
        _start(tmp_path, shape, _flash_like())


def test_a_namespace_whose_view_is_not_the_caches_is_refused(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Packed content (per-token scales inside the page, as the CPU
    namespace keys it: test_layout_identity.py) against dense caches: the
    arithmetic and the allocation disagree."""
    packed = _spec(state_content_bytes=2 * 64 * 2 + 8)
    shape = kv_shape(_vllm_config(model_dir), _kv(packed), "kv-view-test")
    assert json.loads(shape.layout)["kv_view"] == {"kind": "cpu", "block": [32, 264]}
    _start(tmp_path, shape, _allocated(packed, "LBHNC", NUM_BLOCKS)).shutdown()  # what the allocator makes of it
    with pytest.raises(ConfigError, match=r'"block": \[32, 256\].*names the view \{"kind": "cpu", "block": \[32, 264\]') as refused:
        _start(tmp_path, shape, _allocated(_spec(), "LBHNC", NUM_BLOCKS))
    assert "default CPU layout" not in refused.value.message


def test_mla_caches_start_under_the_default_cpu_namespace(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """MLA's latent alone (no V): one slot of ``[block, latent]``."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    shape = kv_shape(_vllm_config(model_dir), _kv(spec), "kv-view-test")
    assert shape.use_mla and "kv_view" not in json.loads(shape.layout)
    caches = _allocated(spec, "LBHNC", NUM_BLOCKS)
    assert next(iter(caches.values())).shape == (NUM_BLOCKS, 1, 32, 96)
    _start(tmp_path, shape, caches).shutdown()
    with pytest.raises(ConfigError, match=r'"block": \[16, 384\].*names the view \{"kind": "cpu", "block": \[32, 192\]'):
        _start(tmp_path, shape, {n: torch.zeros(NUM_BLOCKS, 1, 16, 192, dtype=torch.bfloat16) for n in LAYERS})
