"""The arrangement of a unit's bytes is part of the namespace
(connector/engine_facts.kv_view, keyed by connector/identity.py): two KV
layouts of equal unit size under one platform tag never share blocks, while
the default CPU layout keeps the namespaces stores already hold. And a KV
cache group whose layers' pages differ is refused with its real cause.

Real vLLM configs, specs and vLLM's own KV cache allocator; off CPU the
platform is a stand-in (no GPU here), as in test_identity_guards.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import _vllm_config, model_dir  # noqa: E402,F401
from ucm_db.connector.identity import kv_shape, namespace  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _spec(**changes: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(**{"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16, **changes})


def _kv(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _on(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """A stand-in GPU platform for identity.py (after the configs and
    caches are made: vLLM's own code asks the platform more)."""
    import vllm.platforms

    stand_in = SimpleNamespace(device_name=device, device_type="cuda", fp8_dtype=lambda: torch.float8_e4m3fn)
    monkeypatch.setattr(vllm.platforms, "current_platform", stand_in, raising=False)


def _layout(config: Any, spec: Any) -> dict[str, Any]:
    return json.loads(kv_shape(config, _kv(spec), "layout-test").layout)


def _allocated(spec: Any, order: str, num_blocks: int = 8) -> dict[str, torch.Tensor]:
    """The per-layer KV caches vLLM 0.32's allocator hands a connector, for ``spec`` in physical ``order``."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=LAYERS, layer_stride=page * num_blocks, block_stride=page)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[order])
    for cache in caches.values():
        cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    return caches


# -- the default CPU layout keeps its namespaces -----------------------------------

#: Namespace ids computed by ucm-db before the layout's view and the model-dtype ISA were keyed (x86_64, no AMX;
#: model "golden-model"): a namespace moving here strands every block of every CPU store.
_GOLDEN = {
    ("auto", "bfloat16"): "17b87e470bcfbcb9bcdd51a11aa71d3c",
    ("auto", "float16"): "5483fb18aa1cbe558b22f99410ba829d",
    ("fp8", "bfloat16"): "5adac51980f71a9d3c4629f83c327a2b",
    ("fp8", "float16"): "8121d71893502beca4aeb16eb333f15a",
}


@pytest.mark.skipif(os.uname().machine != "x86_64" or not torch.cpu._is_avx512_supported(),
                    reason="the golden ids are an x86_64 AVX-512 host's (its ISA tag)")
@pytest.mark.parametrize(("cache_dtype", "dtype"), sorted(_GOLDEN))
def test_cpu_namespaces_keep_their_golden_ids(model_dir: Path, monkeypatch: pytest.MonkeyPatch, cache_dtype: str,
                                              dtype: str) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # the ISA of the host the ids were taken on
    config = _vllm_config(model_dir, dtype=dtype)
    config.cache_config.cache_dtype = cache_dtype
    spec = _spec(dtype=torch.uint8 if cache_dtype == "fp8" else getattr(torch, dtype))
    shape = kv_shape(config, _kv(spec), "golden-model")
    assert "kv_view" not in json.loads(shape.layout)
    assert namespace(shape).id.hex() == _GOLDEN[(cache_dtype, dtype)]


# -- what is keyed is what the adapter is handed ------------------------------------


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "two-head-slots"])
def test_the_view_keyed_is_the_one_vllms_allocator_hands_the_adapter(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       order: str, packed: bool) -> None:
    """vLLM 0.32 views every layer ``[blocks, slots, tokens, content]``
    whatever the physical order: the adapter sees the kind and block the
    namespace names (ROCm AITER's shuffled layout publishes two head slots,
    a K and a V plane of every head, as ``packed`` here)."""
    spec = _spec(num_head_slots=2, state_content_bytes=2 * 64 * 2) if packed else _spec()
    layout, config = detect_layout(_allocated(spec, order), 8), _vllm_config(model_dir)
    _on(monkeypatch, "rocm")
    view = _layout(config, spec)["kv_view"]
    first = layout.layers[0].segments[0][0]  # one block of one layer: [slots, tokens, content]
    assert view["kind"] == layout.kind == "cpu"
    assert view["block"] == [int(first.shape[1]), int(first.shape[2]) * first.element_size()]
    assert view.get("head_slots", first.shape[0]) == layout.heads


def test_two_layouts_of_equal_unit_size_under_one_platform_get_two_namespaces(model_dir: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On ROCm a model of 2 KV heads per rank gets units of one size from
    the per-head layout (head h: ``[block, K|V]``) and from AITER's shuffled
    one (unit 0: every head's K, unit 1: every V): one platform tag, one KV
    dtype, other bytes."""
    dense, shuffled = _spec(), _spec(num_head_slots=2, state_content_bytes=2 * 64 * 2)
    units = {name: detect_layout(_allocated(spec, "LBHNC"), 8) for name, spec in (("dense", dense), ("shuffled", shuffled))}
    assert units["dense"].unit_bytes == units["shuffled"].unit_bytes and units["dense"].heads == units["shuffled"].heads
    config = _vllm_config(model_dir)
    _on(monkeypatch, "rocm")
    layouts = {name: _layout(config, spec) for name, spec in (("dense", dense), ("shuffled", shuffled))}
    assert layouts["dense"]["platform"] == layouts["shuffled"]["platform"] == "rocm"
    assert namespace(kv_shape(config, _kv(dense), "m")).id != namespace(kv_shape(config, _kv(shuffled), "m")).id


def test_a_cuda_namespace_is_not_one_an_older_vllm_wrote_flash_blocks_under(model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 0.32 vLLM handed FlashAttention's ``[2, blocks, block, heads,
    head]`` (a head's unit: K then V), since 0.32 ``[blocks, heads, block,
    K|V]``: units of one size, other bytes, both under platform ``cuda``.
    The 0.32 namespace names its view, so it is neither the one the
    connector keyed before (no view) nor an older vLLM's."""
    torch.manual_seed(0)
    k, v = torch.randn(8, 32, 2, 64).to(torch.bfloat16), torch.randn(8, 32, 2, 64).to(torch.bfloat16)  # [blocks, block, heads, head]
    flash = detect_layout({n: torch.stack([k, v]) for n in LAYERS}, 8)
    viewed = detect_layout({n: torch.cat([k, v], dim=-1).permute(0, 2, 1, 3) for n in LAYERS}, 8)
    rows = {}
    for name, layout in (("flash", flash), ("viewed", viewed)):
        rows[name] = layout.new_unit_staging(1)
        layout.gather_units([3], rows[name])
    assert flash.unit_bytes == viewed.unit_bytes and not torch.equal(rows["flash"], rows["viewed"])

    config, spec = _vllm_config(model_dir), _spec()
    _on(monkeypatch, "cuda")
    shape = kv_shape(config, _kv(spec), "m")
    layout = json.loads(shape.layout)
    assert layout["platform"] == "cuda" and layout.pop("kv_view") == {"kind": "cpu", "block": [32, 256]}
    before = Namespace.from_dict({**namespace(shape).to_dict(), "layout": json.dumps(layout, sort_keys=True, separators=(",", ":"))})
    import vllm.v1.kv_cache_interface as interface

    monkeypatch.delattr(interface, "compute_layer_kv_cache_shape_bytes")  # an older vLLM: its backends shape the caches
    older = kv_shape(config, _kv(spec), "m")
    assert json.loads(older.layout)["kv_view"] == {"kind": "runner", "runner": "types"}  # the stand-in platform's package
    assert len({namespace(shape).id, before.id, namespace(older).id}) == 3


def test_a_cpu_view_other_than_the_default_is_keyed(model_dir: Path) -> None:
    """Packed content (per-token scales inside the page) on CPU: the CPU
    namespace names it; the default layout's has no view."""
    config = _vllm_config(model_dir)
    assert "kv_view" not in _layout(config, _spec())
    assert _layout(config, _spec(state_content_bytes=2 * 64 * 2 + 8))["kv_view"] == {"kind": "cpu", "block": [32, 264]}


# -- a group of mixed pages is refused with its cause ------------------------------


def _mixed(first: Any, second: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    specs = dict(zip(LAYERS, (first, second)))
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=specs))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def test_a_group_of_mixed_pages_is_refused_naming_kv_cache_dtype_skip_layers(model_dir: Path) -> None:
    """vLLM's ``kv_cache_dtype_skip_layers`` keeps layer 0 in bf16 beside
    fp8 layers: one group (UniformTypeKVCacheSpecs) of two page sizes."""
    config = _vllm_config(model_dir)
    config.cache_config.cache_dtype = "fp8"
    config.cache_config.kv_cache_dtype_skip_layers = ["0"]
    with pytest.raises(ConfigError) as refused:
        kv_shape(config, _mixed(_spec(), _spec(dtype=torch.uint8)), None)
    message, hint = str(refused.value), refused.value.hint or ""
    assert "full or sliding-window" not in hint  # they are full attention
    assert "differ" in message and "kv_cache_dtype_skip_layers=['0']" in message
    assert "16384 bytes a page" in message and "8192 bytes a page" in message
    assert "without ucm-db" in hint and "without kv_cache_dtype_skip_layers" in hint


def test_a_group_of_mixed_head_sizes_is_refused_naming_them(model_dir: Path) -> None:
    """Layers of two head sizes in one KV dtype: the skip setting, though
    set, is not what mixed the pages, and is not blamed."""
    config = _vllm_config(model_dir)
    config.cache_config.kv_cache_dtype_skip_layers = ["0"]
    with pytest.raises(ConfigError) as refused:
        kv_shape(config, _mixed(_spec(), _spec(head_size=128)), None)
    assert "head size 64" in str(refused.value) and "head size 128" in str(refused.value)
    assert "skip_layers" not in str(refused.value) + (refused.value.hint or "")
    assert "full or sliding-window" not in (refused.value.hint or "")
