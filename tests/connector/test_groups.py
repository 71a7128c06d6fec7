"""KV cache groups (connector/hybrid/groups.py) with vLLM's real
KVCacheConfig objects: one namespace per group naming its layers and spec;
a single-group model keeps its namespace; unstorable specs are refused."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
)

from ucm_db.connector.hybrid.groups import group_namespace, kv_groups  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

BASE = Namespace(model="tiny-gemma2", kv_dtype="bfloat16", block_size=32, layout="cpu")


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _full(names: list[str]) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(names, FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))


def _window(names: list[str], window: int) -> KVCacheGroupSpec:
    spec = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)
    return KVCacheGroupSpec(names, spec)


def test_each_group_has_a_namespace_naming_its_layers_and_spec() -> None:
    config = _config(_window(["l.0", "l.2"], 128), _full(["l.1", "l.3"]))
    groups = kv_groups(config)
    assert [(g.kind, g.sliding_window, g.layer_names) for g in groups] == [
        ("sliding_window", 128, ("l.0", "l.2")), ("full_attention", None, ("l.1", "l.3"))]
    namespaces = [group_namespace(BASE, groups, g) for g in groups]
    assert len({ns.digest for ns in namespaces} | {BASE.digest}) == 3
    other_window = kv_groups(_config(_window(["l.0", "l.2"], 256), _full(["l.1", "l.3"])))
    assert group_namespace(BASE, other_window, other_window[0]).digest != namespaces[0].digest


def test_a_single_group_model_keeps_its_namespace() -> None:
    groups = kv_groups(_config(_full(["l.0", "l.1"])))
    assert group_namespace(BASE, groups, groups[0]) == BASE


def test_a_state_space_group_is_refused_with_the_fix() -> None:
    mamba = KVCacheGroupSpec(["m.0"], MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,)))
    with pytest.raises(ConfigError, match="MambaSpec") as caught:
        kv_groups(_config(_full(["l.1"]), mamba))
    assert "without ucm-db" in caught.value.hint


def test_a_single_group_keeps_any_attention_spec_it_had() -> None:
    """MLA (one group) was served before groups were known: still is."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    groups = kv_groups(_config(KVCacheGroupSpec(["l.0"], spec)))
    assert [g.kind for g in groups] == ["MLAAttentionSpec"] and group_namespace(BASE, groups, groups[0]) == BASE
