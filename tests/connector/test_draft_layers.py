"""Speculative decoding with a draft model (EAGLE, MTP): vLLM registers the
draft's attention layers beside the target's, numbered from the target's
layer count on. Where they share the target's KV cache group, the connector
stores and loads them with the target's, under a namespace naming the draft
(``connector/drafts.py``); where they cannot be, the worker leaves them out,
with a warning; a group of draft layers alone is stored as a hybrid model's
group under namespaces naming the draft. The engine proof (drafts over a hit accepted as cold) is
``tests/vllm/test_identity_engine.py``'s EAGLE test."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.drafts import draft_shape, is_draft_layer, stored_view  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _shape  # noqa: E402
from tests.connector.test_identity_inputs import model_dir  # noqa: E402,F401


def _caches(layers: int, fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(NUM_BLOCKS, 2, BS, 128, generator=gen) if fill
                                                  else torch.zeros(NUM_BLOCKS, 2, BS, 128)).to(torch.bfloat16)
            for i in range(layers)}


def test_a_draft_models_layers_in_a_group_of_their_own_are_left_out_and_the_targets_round_trip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shape = _shape()
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    with_draft = _caches(shape.layers + 1, fill=True)  # the last one is the drafter's (index == the model's layer count)
    writer = UcmDbWorker(settings, shape, NUM_BLOCKS)
    with caplog.at_level(logging.WARNING):
        writer.register_kv_caches(with_draft, 0, 0)
    assert any("of a speculative-decoding draft" in r.getMessage() for r in caplog.records)
    keys = tuple(namespace(shape).block_keys(list(range(3 * BS))))
    writer.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys, (1, 2, 3))]))
    writer.drain()
    writer.shutdown()

    target = _caches(shape.layers + 1, fill=False)
    reader = UcmDbWorker(settings, shape, NUM_BLOCKS)
    reader.register_kv_caches(target, 0, 0)
    reader.start_load(UcmDbConnectorMetadata(loads=[BlockTransfer("r", keys, (4, 5, 6))]))
    assert reader.take_load_errors() == set()
    for i in range(shape.layers):
        name = f"model.layers.{i}.self_attn.attn"
        assert torch.equal(target[name][4:7].view(torch.int16), with_draft[name][1:4].view(torch.int16))
    assert not target[f"model.layers.{shape.layers}.self_attn.attn"].any()  # the drafter's KV is its own
    reader.shutdown()


def test_draft_layers_in_the_targets_group_round_trip_with_it(tmp_path: Path) -> None:
    shape = _shape()
    shape = dataclasses.replace(shape, layers=shape.layers + 1, draft_layers=1)  # as kv_shape reads a stored draft
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")})
    with_draft = _caches(shape.layers, fill=True)
    writer = UcmDbWorker(settings, shape, NUM_BLOCKS)
    writer.register_kv_caches(with_draft, 0, 0)
    keys = tuple(namespace(shape).block_keys(list(range(3 * BS))))
    writer.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys, (1, 2, 3))]))
    writer.drain()
    writer.shutdown()

    target = _caches(shape.layers, fill=False)
    reader = UcmDbWorker(settings, shape, NUM_BLOCKS)
    reader.register_kv_caches(target, 0, 0)
    reader.start_load(UcmDbConnectorMetadata(loads=[BlockTransfer("r", keys, (4, 5, 6))]))
    assert reader.take_load_errors() == set()
    for name in target:  # the drafter's layer too
        assert torch.equal(target[name][4:7].view(torch.int16), with_draft[name][1:4].view(torch.int16)), name
    reader.shutdown()


def _attention(heads: int = 2, head_size: int = 64) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)


def _kv_config(*groups: dict[str, Any]) -> Any:
    """vLLM's KVCacheConfig of groups given as {layer name: spec}: one spec,
    or mixed ones as vLLM makes them (UniformTypeKVCacheSpecs)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    made = []
    for layers in groups:
        specs = set(layers.values())
        spec = specs.pop() if len(specs) == 1 else UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=dict(layers))
        made.append(KVCacheGroupSpec(list(layers), spec))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=made)


def _model(kv_heads: int = 2, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(dtype="torch.bfloat16", quantization=None, get_total_num_kv_heads=lambda: kv_heads,
                           get_head_size=lambda: 64, hf_config=SimpleNamespace(), **fields)


def _vllm(method: str = "eagle", pp: int = 1, speculative_tokens: int = 2, draft_kv_heads: int = 2,
          **spec_fields: Any) -> SimpleNamespace:
    """vLLM's config as the drafts module reads it: a 2-layer target of 2
    KV heads, and a draft (its model config) of ``draft_kv_heads``."""
    spec = SimpleNamespace(method=method, quantization=None, use_eagle_block_drop=lambda: method == "eagle",
                           num_speculative_tokens=speculative_tokens, kv_cache_dtype=None, attention_backend=None,
                           draft_model_config=_model(draft_kv_heads, model="/draft"))
    vars(spec).update(spec_fields)
    return SimpleNamespace(speculative_config=spec, load_config=None, parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
                           cache_config=SimpleNamespace(cache_dtype="auto"), attention_config=SimpleNamespace(backend=None),
                           model_config=_model(hf_text_config=SimpleNamespace(num_hidden_layers=2)))


TARGET = {f"model.layers.{i}.self_attn.attn": _attention() for i in range(2)}
files = {"/draft": "blake3:d1"}


def _by_files(config: object, _dir: object, _load: object) -> str:
    return files[config.model]  # type: ignore[attr-defined]


def _stored(vllm: SimpleNamespace, config: Any) -> tuple[int, dict[str, Any] | None]:
    return draft_shape(vllm, stored_view(vllm, config), _by_files)


def test_a_draft_sharing_the_targets_spec_is_stored_and_named_by_its_method_files_and_layers() -> None:
    eagle = _kv_config({**TARGET, "model.layers.2.self_attn.attn": _attention()})
    layers, inputs = _stored(_vllm(), eagle)
    assert layers == 1 and inputs == {"method": "eagle", "layers": 1, "model": "blake3:d1", "dtype": "bfloat16"}
    files["/draft"] = "blake3:d2"  # another head: another namespace
    assert _stored(_vllm(), eagle)[1] != inputs
    files["/draft"] = "blake3:d1"
    # A separate draft model of the target's spec (vLLM names it draft_model.*, from layer 0).
    small = _kv_config({**TARGET, "draft_model.model.layers.0.self_attn.attn": _attention()})
    assert _stored(_vllm("draft_model"), small) == (1, {**inputs, "method": "draft_model"})
    # Several draft layers: how many run (the speculative tokens) is named too.
    mtp = _kv_config({**TARGET, **{f"model.layers.{i}.self_attn.attn": _attention() for i in (2, 3)}})
    assert _stored(_vllm("mtp", speculative_tokens=3), mtp)[1]["speculative_tokens"] == 3  # type: ignore[index]
    assert _stored(SimpleNamespace(speculative_config=None), _kv_config(TARGET)) == (0, None)
    assert _stored(_vllm("ngram"), _kv_config(TARGET)) == (0, None)  # no layers of its own


def test_a_draft_is_keyed_by_the_load_config_vllm_loads_it_with() -> None:
    """vLLM loads a drafter with the speculative config's ``draft_load_config``
    where one is set (``get_draft_load_config``), a separate draft model with
    the target's: a draft of random weights (``dummy``) is not the real one."""
    from vllm.config import LoadConfig

    given: list[str] = []

    def by_files(config: Any, _dir: object, load: Any) -> str:
        given.append(str(load.load_format))
        return files[config.model]

    def stored(method: str, draft_load: Any) -> dict[str, Any] | None:
        vllm = _vllm(method, draft_load_config=draft_load)
        vllm.load_config = LoadConfig()
        vllm.parallel_config.tensor_parallel_size = 1
        return draft_shape(vllm, stored_view(vllm, eagle), by_files)[1]

    eagle = _kv_config({**TARGET, "model.layers.2.self_attn.attn": _attention()})
    real = stored("eagle", None)
    assert real == {"method": "eagle", "layers": 1, "model": "blake3:d1", "dtype": "bfloat16"}  # as before
    dummy = stored("eagle", LoadConfig(load_format="dummy"))
    assert given == ["auto", "dummy"] and dummy != real
    assert dummy is not None and dummy["load"] == {"load_format": "dummy", "dummy_shards": [1, 1]}
    ignoring = stored("eagle", LoadConfig(ignore_patterns=["*.bin"]))
    assert ignoring is not None and ignoring["load"] == {"load_format": "auto", "ignore_patterns": ["*.bin"]}
    # A separate draft model is loaded with the target's load config (vLLM's DraftModelProposer).
    small = _kv_config({**TARGET, "draft_model.model.layers.0.self_attn.attn": _attention()})
    vllm = _vllm("draft_model", draft_load_config=LoadConfig(load_format="dummy"))
    vllm.load_config = LoadConfig()
    given.clear()
    assert draft_shape(vllm, stored_view(vllm, small), by_files)[1] == {**real, "method": "draft_model"}
    assert given == ["auto"]


def test_drafts_that_cannot_be_stored_are_left_out_of_what_the_connector_sees() -> None:
    from ucm_db.connector.hybrid.groups import kv_groups

    # A draft model of another KV spec: vLLM mixes the specs in the target's group, which ucm-db cannot store,
    # in the workers; the scheduler gets one of them (vLLM's generate_scheduler_kv_cache_config): the draft's
    # model config says it is not the target's, in every process.
    draft = "draft_model.model.layers.0.self_attn.attn"
    mixed = _kv_config({**TARGET, draft: _attention(heads=1)})
    other = _vllm("draft_model", draft_kv_heads=1)
    view = stored_view(other, mixed)
    assert view.kv_cache_groups[0].layer_names == list(TARGET)
    assert view.kv_cache_groups[0].kv_cache_spec == _attention()  # the target's own spec
    assert len(kv_groups(view)) == 1 and draft_shape(other, view, _by_files) == (0, None)
    with pytest.raises(ConfigError, match="cannot store"):
        kv_groups(mixed)  # what refused the engine's start before
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    schedulers = generate_scheduler_kv_cache_config([mixed])  # the scheduler's copy: one spec for all three
    assert not hasattr(schedulers.kv_cache_groups[0].kv_cache_spec, "kv_cache_specs")
    assert _stored(other, schedulers) == (0, None)
    assert stored_view(other, schedulers).kv_cache_groups[0].layer_names == list(TARGET)
    # A draft told another KV cache dtype or attention backend: vLLM lays its pages out apart.
    eagle_like = _kv_config({**TARGET, "model.layers.2.self_attn.attn": _attention()})
    assert _stored(_vllm(kv_cache_dtype="fp8"), eagle_like) == (0, None)
    assert _stored(_vllm(attention_backend="TRITON_ATTN"), eagle_like) == (0, None)
    # Qwen3-Next's MTP module, numbered from 0 under mtp.: a draft's (there, in a hybrid model: left out).
    assert is_draft_layer("mtp.layers.0.self_attn.attn", 48) and not is_draft_layer("model.layers.47.self_attn.attn", 48)
    # Several pipeline stages: the scheduler sees stage 0's config, without the draft.
    eagle = _kv_config({**TARGET, "model.layers.2.self_attn.attn": _attention()})
    assert _stored(_vllm(pp=2), eagle) == (0, None)
    assert stored_view(_vllm(pp=2), eagle).kv_cache_groups[0].layer_names == list(TARGET)
    assert stored_view(_vllm(), eagle) is eagle


# -- a hit one block shorter (an EAGLE-style drafter) ---------------------------------


def test_a_consumer_with_a_drafter_claims_its_producers_blocks_less_the_last_at_once(tmp_path: Path) -> None:
    """The block the hit gives back is not a missing announced block: a
    consumer does not wait for it (it waited out load_deadline_s before)."""
    import time

    import test_roles as roles

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_deadline_s": 5.0})
    tokens = list(range(3, 3 + 5 * roles.BS + 7))
    params = roles._produce(settings, tokens, roles._kv(0))  # 5 blocks announced, all visible
    sched = UcmDbScheduler(settings, dataclasses.replace(roles.SHAPE, drops_last_block=True), roles.CONSUMER)
    started = time.monotonic()
    assert sched.get_num_new_matched_tokens(roles._request("c", tokens, params), 0) == (4 * roles.BS, False)
    assert time.monotonic() - started < 1.0
    assert sched.counters.totals.data["publication_misses"] == 0
    sched.shutdown()


@pytest.mark.parametrize(("cap_blocks", "claimed"), [(None, 5), (4, 4), (2, 2), (1, 1)])
def test_a_hit_that_gives_back_its_last_block_still_loads_up_to_the_cap(tmp_path: Path, cap_blocks: int | None,
                                                                      claimed: int) -> None:
    """The lookup goes one block past a max_load_tokens cap, as vLLM's own
    EAGLE hit looks one past its limit: a capped hit is the cap, not one
    block less (a one-block cap loaded nothing)."""
    import test_roles as roles

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    tokens = list(range(3, 3 + 6 * roles.BS + 7))
    roles._produce(settings, tokens, roles._kv(0))  # 6 blocks stored
    params = None if cap_blocks is None else {"ucm_db": {"max_load_tokens": cap_blocks * roles.BS}}
    sched = UcmDbScheduler(settings, dataclasses.replace(roles.SHAPE, drops_last_block=True))
    ext, _ = sched.get_num_new_matched_tokens(roles._request("r", tokens, params), 0)
    assert ext == claimed * roles.BS
    sched.shutdown()



def test_a_group_of_draft_layers_alone_is_stored_as_a_hybrid_group_under_namespaces_naming_the_draft(model_dir: Path) -> None:
    """A drafter of an attention type the target lacks (a sliding window
    here) gets a KV cache group of its own, which ucm-db stores as a hybrid
    model's group. Every group's namespace then names the draft (the
    layout counts the group's layers), so no engine with another draft, or
    none, reads these blocks."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from ucm_db.connector.hybrid.groups import group_namespace, kv_groups
    from ucm_db.connector.identity import kv_shape, stored_groups
    from tests.connector.test_identity_inputs import _vllm_config

    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    split = _kv_config(TARGET, {"model.layers.2.self_attn.attn": window})
    assert stored_view(_vllm(), split).kv_cache_groups == split.kv_cache_groups  # the drafter's group kept as vLLM numbers it
    assert _stored(_vllm(), split) == (1, {"method": "eagle", "layers": 1, "model": "blake3:d1", "dtype": "bfloat16"})

    def group_namespaces(draft: SimpleNamespace | None) -> list[bytes]:
        config = _vllm_config(model_dir)
        config.speculative_config = draft
        kv = split if draft is not None else _kv_config(TARGET)
        groups = stored_groups(config, kv)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("ucm_db.connector.identity.model_fingerprint", _by_files_or_target)
            base = namespace(kv_shape(config, kv, None))
        return [group_namespace(base, groups, g).id for g in groups]

    mine = group_namespaces(_vllm().speculative_config)
    assert len(mine) == 2 and [g.kind for g in kv_groups(split)] == ["full_attention", "sliding_window"]
    files["/draft"] = "blake3:d2"  # another head of the same shape
    try:
        theirs = group_namespaces(_vllm().speculative_config)
    finally:
        files["/draft"] = "blake3:d1"
    none = group_namespaces(None)
    assert set(mine).isdisjoint(theirs) and set(mine).isdisjoint(none)


def _by_files_or_target(config: Any, *args: Any, **kwargs: Any) -> str:
    return files.get(getattr(config, "model", ""), "blake3:target")
