"""Review: speculative-decoding drafts in the namespace, input by input, over
vLLM's own configs (``EngineArgs(...).create_engine_config()``, no engine), and
the store's hits across engines with and without a draft.

Each engine serves a tiny local Llama (``test_review_identity_fuzz.write_llama``)
with a tiny EAGLE head, an EAGLE-3 head, a separate draft model, or a MiMo model
whose MTP module reads the target's own file. The KV cache config is vLLM's as
the attention layers specify it, the draft's layers appended to the target's
group (an EAGLE head or MTP module numbered from the target's layer count, a
draft model under ``draft_model.``) as vLLM groups a draft of the target's spec.

Invariants (connector/drafts.py, docs/connector.md "Speculative decoding"):
    * A draft input that changes the draft layers' K/V for the same tokens
      (its weights, its config, EAGLE-3's auxiliary layers, its quantization,
      its method) gives a namespace of its own; an engine without a draft never
      shares one with an engine whose blocks hold draft layers, either way.
    * Inputs that leave the draft's K/V as it is share: the same files at another
      path or through a link, a local revision, the speculative tokens of a
      one-layer drafter, ngram (no layers) against no drafter.
    * Identity is by content: draft weights rewritten in place move the
      namespace, restored move it back; a hub snapshot and a local copy of the
      same files are one draft; an MTP module keyed with the target's file.
    * In a real store, a lookup never crosses draft presence: a target-only
      engine gets no hit on a drafted engine's blocks, nor the reverse.
    * The review's two findings, each a repro that failed before its fix: the
      draft's RoPE reading ``max_model_len`` (LongRoPE: now keyed in the draft's
      inputs, drafts.py), and a callable ``hf_overrides`` vLLM composes onto the
      draft (now keyed by its code and bound values, callables.py).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm.envs  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.identity import KVShape, kv_shape, namespace  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

from tests.connector.test_review_identity_fuzz import engine_config, kv_cache_config_of, write_llama  # noqa: E402
from tests.connector.test_scheduler_worker import _put_units  # noqa: E402
from tests.vllm.identity_helpers import build_hub_cache  # noqa: E402

SEEDS = (5, 17, 29)
#: vLLM's model-class inspection cache (a subprocess per architecture, seconds each): kept where vLLM keeps it.
VLLM_CACHE_ROOT = str(vllm.envs.VLLM_CACHE_ROOT)
LONG_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128, "factor": 4.0,
             "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}


@pytest.fixture(autouse=True)
def own_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private fingerprint cache and memo per test; vLLM's own cache root as it is."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", VLLM_CACHE_ROOT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(fingerprints, "_memo", {})
    monkeypatch.setattr(fingerprints, "_warned", set())


def write_head(path: Path, seed: int, **config: Any) -> Path:
    """A one-layer EAGLE head of the target's KV spec (2 KV heads of 32), random weights of ``seed``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    described = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512,
                 "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32", **config}
    (path / "config.json").write_text(json.dumps(described))
    generator = torch.Generator().manual_seed(seed)
    save_file({"fc.weight": torch.randn(64, 128, generator=generator)}, str(path / "model.safetensors"))
    return path


def write_mimo(path: Path, seed: int) -> Path:
    """A 2-layer MiMo whose one MTP module lives in the target's own weights file."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                use_sliding_window=False).save_pretrained(path)
    described = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**described, "architectures": ["MiMoForCausalLM"],
                                                  "num_nextn_predict_layers": 1}))
    generator = torch.Generator().manual_seed(seed)
    save_file({"model.mtp_layers.0.input_proj.weight": torch.randn(64, 128, generator=generator)},
              str(path / "model.safetensors"))
    return path


def draft_layer_names(config: Any) -> list[str]:
    """The draft's attention layers as vLLM registers them (none for ngram or no drafter)."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return []
    draft = spec.draft_model_config.hf_text_config
    if spec.method == "draft_model":
        return [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(draft.num_hidden_layers)]
    first = config.model_config.hf_text_config.num_hidden_layers
    count = getattr(draft, "num_nextn_predict_layers", None) if spec.method == "mtp" else draft.num_hidden_layers
    return [f"model.layers.{first + i}.self_attn.attn" for i in range(int(count or 1))]


def shape_of(config: Any) -> KVShape:
    """The connector's KVShape, the draft's layers in the target's group (one spec: the target's)."""
    group = kv_cache_config_of(config).kv_cache_groups[0]
    names = group.layer_names + draft_layer_names(config)
    groups = [KVCacheGroupSpec(names, group.kv_cache_spec)]
    return kv_shape(config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), None)


def engine_ns(model: Path, **args: Any) -> bytes:
    return namespace(shape_of(engine_config(model, **args))).id


def eagle(head: Path, tokens: int = 2, method: str = "eagle", **spec: Any) -> dict[str, Any]:
    return {"speculative_config": {"method": method, "model": str(head), "num_speculative_tokens": tokens, **spec}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target and drafts no test changes."""
    root = tmp_path_factory.mktemp("review_drafts")
    heads = {f"head{s}": write_head(root / f"head{s}", s) for s in (1, 2)}
    shutil.copytree(heads["head1"], root / "elsewhere" / "head1")
    os.symlink(heads["head1"], root / "linked")
    return {"target": write_llama(root / "target", seed=0), **heads, "copy": root / "elsewhere" / "head1",
            "link": root / "linked", "root": root}


# -- namespaces, input by input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_draft_inputs_that_change_draft_kv_never_share_a_namespace(models: dict[str, Path], seed: int) -> None:
    rng = random.Random(seed)
    root, target = models["root"] / f"changing{seed}", models["target"]
    aux = rng.sample([[0, 1], [1, 1], [0, 0], [1, 0]], 2)
    heads = {
        "eagle3 aux " + str(ids): write_head(root / f"e3_{i}", 3, architectures=["Eagle3LlamaForCausalLM"],
                                              eagle_aux_hidden_state_layer_ids=ids) for i, ids in enumerate(aux)}
    theta = rng.choice([20000.0, 50000.0])
    other_config = write_head(root / "rope", 1, rope_parameters={"rope_type": "default", "rope_theta": theta})
    tokens = rng.randint(1, 4)
    engines: dict[str, bytes] = {
        "no drafter": engine_ns(target),
        "eagle head1": engine_ns(target, **eagle(models["head1"], tokens)),
        "eagle head2 (other weights)": engine_ns(target, **eagle(models["head2"], tokens)),
        f"eagle head1's weights, rope_theta {theta}": engine_ns(target, **eagle(other_config, tokens)),
        "eagle head1 quantized fp8": engine_ns(target, **eagle(models["head1"], tokens, quantization="fp8")),
        "draft_model (a 2-layer Llama)": engine_ns(target, **eagle(write_llama(root / "small", seed), tokens,
                                                                  method="draft_model")),
        **{name: engine_ns(target, **eagle(head, tokens, method="eagle3")) for name, head in heads.items()},
    }
    by_id: dict[bytes, list[str]] = {}
    for name, ns in engines.items():
        by_id.setdefault(ns, []).append(name)
    assert [names for names in by_id.values() if len(names) > 1] == []


@pytest.mark.parametrize("seed", SEEDS)
def test_draft_inputs_that_keep_draft_kv_share_a_namespace(models: dict[str, Path], seed: int) -> None:
    rng = random.Random(seed)
    target, tokens = models["target"], rng.randint(1, 5)
    first = engine_ns(target, **eagle(models["head1"], 2))
    assert engine_ns(target, **eagle(models["copy"], 2)) == first  # the same files elsewhere
    assert engine_ns(target, **eagle(models["link"], 2)) == first  # through a link
    assert engine_ns(target, **eagle(models["head1"], tokens)) == first  # a one-layer head: the same KV
    assert engine_ns(target, **eagle(models["head1"], 2, revision=f"v{seed}")) == first  # local: no revision
    lookup = rng.randint(2, 5)
    ngram = {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_max": lookup}
    assert engine_ns(target, speculative_config=ngram) == engine_ns(target)  # no layers of its own


def test_a_draft_rewritten_in_place_moves_its_namespace_and_restored_moves_it_back(tmp_path: Path,
                                                                                  models: dict[str, Path]) -> None:
    head = write_head(tmp_path / "head", 7)
    before = engine_ns(models["target"], **eagle(head))
    saved = (head / "model.safetensors").read_bytes()
    write_head(head, 8)  # other weights, same names and sizes
    assert (head / "model.safetensors").stat().st_size == len(saved)
    assert engine_ns(models["target"], **eagle(head)) != before
    (head / "model.safetensors").write_bytes(saved)
    assert engine_ns(models["target"], **eagle(head)) == before


def test_an_mtp_module_in_the_targets_file_is_keyed_with_it(tmp_path: Path) -> None:
    """MiMo's MTP module is read from the target's own checkpoint: its one
    layer's KV is the same for any speculative tokens, and another file
    (target and module at once) is another namespace."""
    model = write_mimo(tmp_path / "mimo", 1)
    plain = engine_ns(model)
    one = engine_ns(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert one != plain
    assert engine_ns(model, speculative_config={"method": "mtp", "num_speculative_tokens": 3}) == one
    write_mimo(model, 2)
    assert engine_ns(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1}) not in (one, plain)


def test_a_hub_snapshot_and_a_local_copy_of_a_draft_are_one_draft(tmp_path: Path, models: dict[str, Path]) -> None:
    """A draft named by hub id is keyed by its snapshot's files (draft_shape:
    ``fingerprint(draft_model, None, load)``): the same files as a local copy,
    another commit's files another draft."""
    hub = tmp_path / "hub"
    c1, c2 = "1" * 40, "2" * 40
    build_hub_cache(hub, "org/head", {c1: models["head1"], c2: models["head2"]}, main=c1)
    load = SimpleNamespace(download_dir=str(hub), load_format="auto", ignore_patterns=None)

    def of(model: str, revision: str | None = None) -> str:
        config = SimpleNamespace(model=model, revision=revision, hf_config=None)
        return fingerprints.model_fingerprint(config, None, load)

    assert of("org/head") == of(str(models["head1"])) == of("org/head", c1)
    assert of("org/head", c2) == of(str(models["head2"])) != of("org/head")


# -- the store: hits never cross draft presence --------------------------------------------------------------------


def test_store_hits_never_cross_between_engines_with_and_without_a_draft(tmp_path: Path,
                                                                         models: dict[str, Path]) -> None:
    target = models["target"]
    shapes = {"none": shape_of(engine_config(target)),
              **{name: shape_of(engine_config(target, **eagle(models[name]))) for name in ("head1", "copy", "head2")}}
    assert (shapes["none"].draft_layers, shapes["head1"].draft_layers, shapes["head1"].layers) == (0, 1, 3)
    block = shapes["none"].block_size
    tokens = [(7 * i + 3) % 256 for i in range(4 * block + 5)]

    def hit(writer: str, reader: str) -> int:
        settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / f"{writer}-{reader}")})
        sched = UcmDbScheduler(settings, shapes[reader])
        try:
            _put_units(sched.store, shapes[writer], list(namespace(shapes[writer]).block_keys(tokens)))
            matched, _ = sched.get_num_new_matched_tokens(Request("r", tokens, SamplingParams(max_tokens=1), None), 0)
            return int(matched or 0)
        finally:
            sched.shutdown()

    assert hit("head1", "copy") == 3 * block  # the same draft: its blocks, the last given back (EAGLE)
    assert hit("none", "none") == 4 * block
    assert hit("head1", "none") == hit("none", "head1") == hit("head1", "head2") == 0


# -- the review's findings ----------------------------------------------------------------------------------


def test_a_longrope_draft_under_another_max_model_len_gets_another_namespace(models: dict[str, Path]) -> None:
    """vLLM builds an EAGLE head under the target's VllmConfig
    (``_create_draft_vllm_config``), and ``Phi3LongRoPEScaledRotaryEmbedding``
    picks its long factors for every position when ``max_model_len`` exceeds
    the draft's ``original_max_position_embeddings``. The target (default
    RoPE) keys no length (context_length.py reads the target's RoPE only), so
    the draft's KV changes under one namespace."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import Phi3LongRoPEScaledRotaryEmbedding

    head = write_head(models["root"] / "longrope", 1, rope_parameters=LONG_ROPE)
    configs = [engine_config(models["target"], max_model_len=length, **eagle(head)) for length in (100, 200)]
    long_factors = []
    for config in configs:
        with set_current_vllm_config(config):
            rope = Phi3LongRoPEScaledRotaryEmbedding(32, 32, 512, 128, 10000.0, True, torch.float32,
                                                     LONG_ROPE["short_factor"], LONG_ROPE["long_factor"])
        long_factors.append(rope.use_long_rope)
    assert long_factors == [False, True]  # the draft's K is rotated otherwise at every position
    assert namespace(shape_of(configs[0])).id != namespace(shape_of(configs[1])).id


def draft_rope(theta: float, config: Any) -> Any:
    """An ``hf_overrides`` function that changes the one-layer draft's RoPE and leaves the target's config."""
    if getattr(config, "num_hidden_layers", 0) == 1:
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def test_a_callable_hf_override_that_changes_only_the_draft_gets_another_namespace(models: dict[str, Path]) -> None:
    """vLLM composes a callable ``hf_overrides`` onto the draft's config
    (``SpeculativeConfig.compose_draft_hf_overrides``); ucm-db keys it by its
    name (``functools.partial`` for any partial) and a digest of the target's
    config, and the draft by its files: a draft of another RoPE shares the
    namespace."""
    configs = [engine_config(models["target"], hf_overrides=functools.partial(draft_rope, theta),
                             **eagle(models["head1"])) for theta in (20000.0, 80000.0)]
    thetas = [c.speculative_config.draft_model_config.hf_text_config.rope_parameters["rope_theta"] for c in configs]
    assert thetas == [20000.0, 80000.0]  # the draft's K rotated otherwise
    assert configs[0].model_config.hf_text_config.to_dict() == configs[1].model_config.hf_text_config.to_dict()
    assert namespace(shape_of(configs[0])).id != namespace(shape_of(configs[1])).id
