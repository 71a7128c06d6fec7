"""Identity: the namespaces and storage units of a vLLM deployment, and of
each request its key chain and the extras hashed into it.

A namespace fingerprints the model (``model_id`` if configured, else a
BLAKE3 digest of the files vLLM loads it from, a hub model's being those of
the snapshot its revision resolves to: :mod:`ucm_db.connector.fingerprints`;
never a path or a branch name), the KV dtype, the block size, a layout
descriptor (platform, attention ISA, spec kind, layers, *total* KV heads,
head size, KV cache dtype, the view the layout adapter is handed where it
is not the default CPU one: :func:`~ucm_db.connector.engine_facts.kv_view`,
a stored draft: :mod:`ucm_db.connector.drafts`)
and the inputs below (:func:`namespace_inputs`, ``Namespace.extra``). It does not depend on the tensor- or pipeline-parallel
size or rank: blocks are stored as units of one KV head and one pipeline
stage's layers (:mod:`ucm_db.keys.units`, ``docs/tp.md``), so a store
written at one TP size serves every other.

Namespace inputs (issue 48), each where it changes K/V for the same tokens
and left out at its default, so a deployment keys only what it changed:
    * ``dtype``: weights and activations are computed in it (a float16 and a
      bfloat16 model differ even into one fp8 KV cache).
    * ``quantization`` (the method vLLM resolved), ``quantization_config``
      (an online quantization's spec), the checkpoint's
      ``quantization_config``: the weights the KV is computed from.
    * ``kv_cache_dtype_skip_layers``: layers a quantized KV cache keeps in
      the model dtype. (The KV cache dtype itself is ``cache_dtype`` in the
      layout and ``Namespace.kv_dtype``.)
    * ``hf_overrides``: a changed config (a dict as given; a function by its
      qualified name, code and bound plain values: callables.py, with a
      digest of the config it left).
    * ``rope``: the effective RoPE parameters (``rope_parameters``, else
      ``rope_scaling``; ``rope_theta`` and ``partial_rotary_factor`` where
      kept apart): K is stored rotated.
    * ``max_model_len``, only where vLLM 0.32's K/V read it: ``long_rope``
      (LongRoPE picks its long factors for every position once
      ``max_model_len`` exceeds ``original_max_position_embeddings``: the
      flag, not the length, is keyed), ``max_model_len`` with dynamic NTK
      (its base reads ``max_position``, which some models take from
      ``max_model_len``), ``attn_temperature_tuning`` for Llama 4 (on by
      default above 32K; it scales the NoPE layers' queries, so every later
      layer's KV); under auto-fit the length the model was built with
      (:func:`built_max_model_len`). YaRN, llama3 and DeepSeek scaling read
      ``original_max_position_embeddings`` (config, in ``rope``), linear and
      default RoPE only size their cos/sin cache: not keyed.
    * ``disable_sliding_window``: attention over the whole context changes
      every later layer's KV. Keyed whenever set: vLLM clears the model's
      window from the config it hands over, so a model whose window was
      disabled cannot be told from one that has none.
    * ``model_class_overrides``, ``code_revision``: another model class or
      remote code (from another repo or revision: keyed by its content,
      :mod:`ucm_db.connector.remote_code`) computes the KV.
    * ``model_weights``: weights streamed from an object store: its URI
      (without ``model_id`` such weights are refused, or keyed by content
      where local: :func:`~ucm_db.connector.weight_loads.weights_elsewhere`).
    * ``additional_config``: a digest, where set (kernels and platform
      plug-ins read keys ucm-db cannot judge).
    * A stored draft's engine options beside its identity (its MoE backend,
      length, code revision, parallel drafting ...:
      :func:`~ucm_db.connector.identity_guards.draft_engine_inputs`), in the layout.
Not keyed: the tokenizer and generation config (token ids are keyed, not
text; sampling never changes KV), ``seed``, ``enforce_eager``, the
attention backend and ``model_impl`` (numerics within kernel tolerance,
unless the model or its KV cache is quantized:
:func:`~ucm_db.connector.numerics.numerics_inputs`; the platform, CPU
attention ISA and the view of the KV cache a backend hands the connector
are in the layout), served names, pooling and runner options,
per-request multimodal options (vLLM's item identifiers carry them), the
LoRA config (keyed per request, with how the engine applies it). Tripwire
tests (``tests/connector/test_identity_inputs.py``, ``test_config_tripwires.py``)
fail on a new field of vLLM's configs.

Invariants:
    * The scheduler process and every worker derive identical namespaces,
      grids and spans from the same ``VllmConfig`` and ``KVCacheConfig``:
      nothing here looks at live tensors or process-local state except the
      ranks a worker passes.
    * At TP=1 and PP=1 the layout string is the one from before units: ``ucm-db
      migrate`` splits those whole blocks (:mod:`ucm_db.maintenance.pre_units`). Blocks
      stored before issue 48 (a model keyed by ``name@revision`` or sampled
      bytes, no namespace inputs) are under other namespaces: misses.
    * Each KV head has one writer rank (the first holding a replicated head);
      MLA's latent (identical on every rank): TP rank 0 writes, all read.
    * A hit counts only if every unit of :func:`reader_spans` (every head of
      every pipeline stage) is loadable.
    * Blocks stored per rank before units (TP>1 or PP>1) are not read (``docs/tp.md``).
    * A request's key chain and its extras: :mod:`ucm_db.connector.request_keys`.
    * The files the model is keyed by are those vLLM loaded: a file whose
      stat moved since vLLM began loading it stops the start
      (:mod:`ucm_db.connector.weight_loads`), and so does a config file
      whose content moved since vLLM parsed it (:mod:`ucm_db.connector.config_parses`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ucm_db.connector.callables import callable_identity
from ucm_db.connector.context_length import max_len_inputs, rope_of
from ucm_db.connector.drafts import draft_load_config, draft_shape, drops_last_block, stored_view
from ucm_db.connector.engine_facts import kv_view
from ucm_db.connector.fingerprints import model_fingerprint
from ucm_db.connector.remote_code import remote_code_inputs
from ucm_db.connector.hybrid.groups import group_described, group_extra, kv_groups
from ucm_db.connector.identity_guards import (additional_inputs, counter_identifiers, device_tag, draft_engine_inputs,
                                              load_inputs, lora_engine_inputs, current_platform, multimodal_inputs,
                                              refuse_unstorable, warn_weight_updates)
from ucm_db.connector.numerics import numerics_inputs
from ucm_db.connector.weight_loads import refuse_changed_since_read
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace
from ucm_db.keys.units import KVGrid, UnitSpan, head_range, writes_heads

@dataclass(frozen=True)
class KVShape:
    """The KV cache facts both roles read from vLLM's configs."""

    model: str
    kv_dtype: str
    block_size: int
    use_mla: bool
    layout: str
    tp_size: int
    pp_size: int
    kv_heads: int = 1  # the model's total KV heads (1 for MLA)
    layers: int = 1    # the model's total attention layers, a stored draft's included (drafts.py)
    draft_layers: int = 0  # of which a speculative-decoding draft's (the last ones)
    drops_last_block: bool = False  # hits give back their last block (drafts.drops_last_block)
    unit_bytes: int = 0  # raw bytes of one KV head's unit over every layer, from vLLM's spec (0: unknown, MLA)
    extra: str = ""  # namespace inputs beside model, layout and block size (namespace_inputs)
    counter_mm_ids: bool = False  # multimodal identifiers are per-process counters (identity_guards.counter_identifiers)
    lora_engine: str = ""  # how this engine applies adapters, in adapter requests' chains (lora_engine_inputs)


def kv_shape(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> KVShape:
    """Reads :class:`KVShape` from vLLM's configs (see module invariants)."""
    if kv_cache_config is None:
        raise ConfigError("vLLM passed no KVCacheConfig to the connector", hint="use vLLM >= 0.11 (this ucm-db targets 0.32)")
    kv_cache_config = stored_view(vllm_config, kv_cache_config)  # draft layers that are not stored: left out
    # Context parallelism, KV that is no prefix function (identity_guards.py), then groups ucm-db cannot lay out
    # (groups.py): before vLLM allocates the KV cache.
    refuse_unstorable(vllm_config, kv_cache_config)
    kv_groups(kv_cache_config, getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None))
    warn_weight_updates(vllm_config)  # weights that change while it serves: a reset must follow each update
    groups = list(kv_cache_config.kv_cache_groups)
    # The first attention group's spec (a hybrid's group 0 may hold SSM state, ssm_state.py).
    spec = next((g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "dtype")), groups[0].kv_cache_spec)
    use_mla = type(spec).__name__.startswith("MLA")
    dtype = str(spec.dtype).removeprefix("torch.")
    model_config = vllm_config.model_config
    layers = int(getattr(model_config.hf_text_config, "num_hidden_layers", len(groups[0].layer_names)))
    # The whole model's KV heads, not this rank's share: equal at TP=1, so
    # TP=1 namespaces are what they were before units (module invariants).
    kv_heads = 1 if use_mla else int(model_config.get_total_num_kv_heads())
    draft_layers, draft = draft_shape(vllm_config, kv_cache_config, model_fingerprint, model_id)
    parts = {
        "platform": _platform_tag(spec, vllm_config),
        "spec": type(spec).__name__,
        "layers": layers + draft_layers,  # a unit's layers
        "kv_heads": kv_heads,
        "head_size": getattr(spec, "head_size", 0),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }
    view = kv_view(spec, current_platform())
    if view is not None:  # the default CPU layout: the layout as before
        parts["kv_view"] = view
    if draft:  # no draft stored: the layout as before
        parts["draft"] = {**draft, **draft_engine_inputs(vllm_config)}
    parallel = vllm_config.parallel_config
    model = model_id or model_fingerprint(model_config, load_config=getattr(vllm_config, "load_config", None))
    extra = namespace_inputs(vllm_config, model_id)
    # After every digest of them (the model's, a stored draft's files): each names what vLLM read.
    refuse_changed_since_read(vllm_config, model_id, draft_load_config(vllm_config) if draft and draft.get("model") else None)
    return KVShape(
        model=model,
        kv_dtype=dtype,
        block_size=int(vllm_config.cache_config.block_size),
        use_mla=use_mla,
        layout=json.dumps(parts, sort_keys=True, separators=(",", ":")),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        kv_heads=kv_heads,
        layers=layers + draft_layers,
        draft_layers=draft_layers, drops_last_block=bool(draft_layers) and drops_last_block(vllm_config),
        unit_bytes=0 if use_mla else _unit_bytes(spec, int(vllm_config.cache_config.block_size), layers + draft_layers),
        extra=extra,
        counter_mm_ids=counter_identifiers(vllm_config),
        lora_engine=lora_engine_inputs(vllm_config),
    )


def stored_groups(vllm_config: Any, kv_cache_config: Any) -> list[Any]:
    """The KV cache groups ucm-db stores (``hybrid/groups.kv_groups``), draft
    layers that are not stored left out (:func:`~ucm_db.connector.drafts.stored_view`)."""
    return kv_groups(stored_view(vllm_config, kv_cache_config), getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None))


def _unit_bytes(spec: Any, block_size: int, layers: int) -> int:
    """One KV head's K and V of a block over ``layers`` layers, in bytes (0: not said)."""
    try:
        head_size = int(spec.head_size)
        head_size_v = int(getattr(spec, "head_size_v", None) or head_size)
        return layers * block_size * (head_size + head_size_v) * int(spec.dtype.itemsize)
    except (AttributeError, TypeError, ValueError):
        return 0


def namespace(shape: KVShape) -> Namespace:
    """The deployment's namespace: the same at every TP/PP size and rank."""
    return Namespace(model=shape.model, kv_dtype=shape.kv_dtype, block_size=shape.block_size, layout=shape.layout,
                     extra=shape.extra)


def grid(shape: KVShape) -> KVGrid:
    """The model's whole KV of one block: KV heads (1 for MLA) by layers."""
    return KVGrid(1 if shape.use_mla else shape.kv_heads, shape.layers)


def stage_layers(shape: KVShape, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, stop)`` of pipeline stage ``pp_rank`` (vLLM's split;
    a draft's layers are stored at one stage only: drafts.py)."""
    if shape.pp_size == 1:
        return 0, shape.layers
    from vllm.distributed.utils import get_pp_indices

    start, stop = get_pp_indices(shape.layers, pp_rank, shape.pp_size)
    return int(start), int(stop)


def rank_spans(shape: KVShape, tp_rank: int, pp_rank: int) -> list[UnitSpan]:
    """The units a worker of ranks (tp_rank, pp_rank) reads, in the order
    of its local KV heads."""
    layers = stage_layers(shape, pp_rank)
    if shape.use_mla:
        return grid(shape).head_spans(layers)
    start, stop = head_range(shape.kv_heads, shape.tp_size, tp_rank)
    return grid(shape).head_spans(layers)[start:stop]


def writes_units(shape: KVShape, tp_rank: int) -> bool:
    """Whether the worker of ``tp_rank`` writes its units (one writer per
    head; MLA: TP rank 0)."""
    if shape.use_mla:
        return tp_rank == 0
    return writes_heads(shape.kv_heads, shape.tp_size, tp_rank)


def reader_spans(shape: KVShape) -> list[UnitSpan]:
    """Every unit of a block a hit needs: every head of every stage."""
    g = grid(shape)
    return [span for pp in range(shape.pp_size) for span in g.head_spans(stage_layers(shape, pp))]


#: Namespace inputs a worker's model constructor may change in its copy of the config after vLLM built it
#: (set_default_rope_theta, a checkpoint's quantization dict): the scheduler's value names the KV computed. Inputs a
#: node's own arguments or files set (max_model_len, a sliding window, another config directory) are not here: a
#: headless node builds its own config from them, so a difference there is other KV.
CONFIG_OBJECT_INPUTS = frozenset({"rope", "checkpoint_quantization_config"})


def schedulers_namespace(ours: Namespace, our_inputs: str, theirs_id: bytes, their_inputs: str) -> Namespace | None:
    """The scheduler's namespace (id ``theirs_id``; ``their_inputs``: its
    :func:`namespace_inputs`, ours ``our_inputs``) where it differs from
    this worker's ``ours`` only in :data:`CONFIG_OBJECT_INPUTS`, or in
    ``hf_config`` where this worker could not read the config's files, or in
    the config an ``hf_overrides`` function of the same name left, or in
    ``remote_code`` entries it found no code for (its node lacks them: it
    computes with the config vLLM pickled from the scheduler's node); None
    where anything else differs."""
    group = group_described(ours.extra, our_inputs)
    extra = their_inputs if group is None else group_extra(their_inputs, group)
    theirs = Namespace.from_dict({**ours.to_dict(), "extra": extra})
    if theirs.id != theirs_id:
        return None
    mine, other = json.loads(our_inputs or "{}"), json.loads(their_inputs or "{}")
    differing = {k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k)}
    if str(mine.get("hf_config", "")).startswith("json-"):  # a fallback: no file to read on this node
        differing.discard("hf_config")
    ours_code, their_code = mine.get("remote_code") or {}, other.get("remote_code") or {}
    if ours_code.keys() == their_code.keys() and all(v in ("unresolved", their_code[k]) for k, v in ours_code.items()):
        differing.discard("remote_code")  # code this node's cache lacks: the scheduler's node named it
    ours_fn, their_fn = mine.get("hf_overrides"), other.get("hf_overrides")
    if isinstance(ours_fn, dict) and isinstance(their_fn, dict) and "function" in ours_fn and ours_fn.get("function") == their_fn.get("function"):
        differing.discard("hf_overrides")  # the same function; the config it left, changed by this worker's model as rope is
    return theirs if differing <= CONFIG_OBJECT_INPUTS else None


def namespace_inputs(vllm_config: Any, model_id: str | None = None) -> str:
    """What besides the model's files, the KV layout and the block size
    changes K/V (the module docstring's list, with reasons; how the weights
    are loaded and engine-wide multimodal options: identity_guards.py), as
    canonical JSON for :attr:`Namespace.extra`; inputs at their defaults are
    left out. Raises ConfigError for inputs no key can name."""
    config, attention = vllm_config.model_config, getattr(vllm_config, "attention_config", None)
    text = config.hf_text_config
    rope = rope_of(text)
    inputs: dict[str, Any] = {
        "dtype": config.dtype,
        "quantization": config.quantization,
        "quantization_config": config.quantization_config,
        "checkpoint_quantization_config": getattr(config.hf_config, "quantization_config", None),
        "kv_cache_dtype_skip_layers": getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None),
        "hf_overrides": _overrides(config),
        "rope": rope,
        "disable_sliding_window": config.disable_sliding_window,
        "model_class_overrides": config.model_class_overrides,
        "code_revision": config.code_revision,
        "model_weights": config.model_weights if config.model_weights not in ("", config.model) else None,
        # Queries quantized to fp8 in attention (or not, where FlashInfer would): every later layer's KV moves.
        "prefill_query_fp8": getattr(attention, "use_prefill_query_quantization", False),
        "flashinfer_query_fp8_off": getattr(attention, "disable_flashinfer_q_quantization", False),
    }
    inputs.update(max_len_inputs(config, text, rope.get("parameters")))
    inputs.update(load_inputs(vllm_config, model_id))
    inputs.update(remote_code_inputs(config))
    inputs.update(multimodal_inputs(vllm_config))
    inputs.update(numerics_inputs(vllm_config, current_platform()))
    inputs.update(additional_inputs(vllm_config))
    plain = {name: _plain(value) for name, value in inputs.items() if value not in (None, False, "", {}, [], ())}
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _overrides(config: Any) -> Any:
    """``hf_overrides`` as keyed: a dict as given; a function by its name
    and a digest of the config it made (two closures, or two lambdas, share
    a name but not what they do; the config they leave prints the same in
    every process). Private fields (the model's path) and the transformers
    version are left out: they differ between nodes with nothing changed."""
    overrides = config.hf_overrides
    if not callable(overrides):
        return overrides
    made = {name: value for name, value in config.hf_config.to_diff_dict().items()
            if not str(name).startswith("_") and name != "transformers_version"}
    text = json.dumps(_plain(made), sort_keys=True, separators=(",", ":")).encode()
    return {"function": _plain(overrides), "config": hashlib.blake2b(text, digest_size=16).hexdigest()}


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data that prints the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    if callable(value):  # e.g. an hf_overrides function: its name and code (callables.py), never an address
        return callable_identity(value)
    return str(value).removeprefix("torch.")  # a torch.dtype and the like


def _platform_tag(spec: Any, vllm_config: Any) -> str:
    """On CPU, the attention ISA (kernel block layouts differ); else device_tag."""
    platform = current_platform()
    if platform is None:
        return "unknown"
    if str(platform.device_type) != "cpu":
        return device_tag(platform, str(vllm_config.cache_config.cache_dtype))
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        # As vLLM's CPUAttentionMetadataBuilder calls it: the model dtype (an fp8 cache's spec dtype is uint8, and
        # the ISA follows the model's), the spec's block and head size, the KV cache dtype.
        isa = _get_attn_isa(vllm_config.model_config.dtype, int(getattr(spec, "block_size", None) or vllm_config.cache_config.block_size),
                            getattr(spec, "head_size", None), str(vllm_config.cache_config.cache_dtype))
    except Exception:  # noqa: BLE001 - private helper; fall back to the CPU feature
        import torch

        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    return f"cpu-{isa}-{os.uname().machine}"
