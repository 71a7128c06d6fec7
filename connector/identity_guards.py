"""What else vLLM lets change the KV bytes of a token prefix, beyond the
model config that :func:`ucm_db.connector.identity.namespace_inputs` keys:
how the weights are loaded, engine-wide multimodal options, the platform's
fp8 encoding, multimodal identifiers that name no content, and
configurations whose KV a prefix key cannot name.

Invariants:
    * Nothing here is random or process-local except
      :data:`PROCESS_NONCE`, which only the scheduler uses (request keys are
      hashed there alone): the scheduler and every worker of a deployment
      derive one namespace from one ``VllmConfig``.
    * A config read from ``hf_config_path`` is keyed by the digest of the
      files vLLM read and of the code its ``auto_map`` names (:func:`config_digest`),
      a quantization config file ``hf_overrides`` names by its content
      (``config_files.quantization_file_inputs``). Weights that are not the fingerprinted
      files are never keyed by those files alone: a load format other than :data:`FILE_LOAD_FORMATS` is
      keyed by its name and ``model_loader_extra_config`` and, without the
      connector's ``model_id`` (the operator's word), by what it reads, or
      refused where ucm-db cannot read that (``weight_loads.weights_elsewhere``).
    * In a folder holding vLLM's Mistral layout beside a Hugging Face one, the load and config formats
      are keyed as given (:func:`has_mistral_layout`): they pick which half's weights and config vLLM
      reads, and the fingerprint hashes both halves (a review found ``auto`` and ``safetensors`` engines,
      or ``auto`` and ``hf`` configs, sharing a namespace over different files). Formats that resolve
      alike there are keyed apart: fewer hits, never wrong ones.
    * Engine-wide multimodal options that vLLM's item identifiers do not
      carry (:func:`multimodal_inputs`) are keyed; runtime-calibrated fp8
      scales of the vision encoder, which no key can name, are refused.
    * A multimodal identifier vLLM makes from a per-process counter (its
      prefix cache and processor cache both off) names no content: it is
      made unique to this process (:func:`item_identity`), and under that
      config every identifier is (:func:`counter_identifiers`: one hashed
      with per-request kwargs hides its origin). Otherwise content hashes
      and user-given UUIDs are kept as they are: a user's UUID names its
      content store-wide, across every engine sharing the store.
    * How the engine applies LoRA adapters (:func:`lora_engine_inputs`) is
      keyed into adapter requests' chains, not the namespace.
    * What picks the kernels' numerics (a quantized model's or KV cache's
      scheme, vLLM's environment switches) is :mod:`ucm_db.connector.numerics`'.
    * Off CPU, the platform is vLLM's device name (ROCm is not "cuda"),
      with the fp8 type where a quantized KV cache would use another one
      than CUDA's ``float8_e4m3fn`` (:func:`device_tag`).
    * Refused with a ConfigError naming the fix (:func:`refuse_unstorable`):
      decode or prefill context parallelism (a rank's block holds every
      n-th token of a longer block), non-causal attention (a block's KV
      depends on tokens after it, which its prefix key does not name), and
      every KV cache spec or model whose blocks are no function of their
      prefix (:mod:`ucm_db.connector.kv_specs`: an allow-list).
    * ``additional_config`` (keys kernels and plug-ins read, which ucm-db
      cannot judge) is keyed by digest where set (:func:`additional_inputs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

# Config files and the code they name (config_files.py), imported from here by older callers.
from ucm_db.connector.config_files import (KV_AUTO_MAP_PREFIXES, auto_map_references, config_digest,  # noqa: F401
                                           files_digest, hub_cached_files, module_files, module_finder,
                                           quantization_file_inputs)
from ucm_db.connector.kv_specs import refuse_unkeyable_specs
from ucm_db.connector.weight_files import DEFAULT_IGNORE_PATTERNS, load_format_of
from ucm_db.connector.weight_loads import MODEL_PATH_FORMATS, NAMED_ONLY_FORMATS, weights_elsewhere  # noqa: F401
from ucm_db.errors import ConfigError

#: Load formats that read the weights from the fingerprinted model files
#: (the same bytes, however read): not keyed.
FILE_LOAD_FORMATS = frozenset({"auto", "hf", "pt", "safetensors", "npcache", "mistral", "instanttensor", "fastsafetensors"})
#: Files of vLLM's Mistral layout; a folder holding one beside a Hugging Face layout loads either half, as
#: ``load_format`` (``auto``: ``consolidated*.safetensors`` first) and ``config_format`` (``auto``: ``params.json``) pick.
MISTRAL_FILES = ("params.json", "consolidated.safetensors", "consolidated.safetensors.index.json")
#: Drawn once per process; mixed into multimodal identifiers that name no content.
PROCESS_NONCE = secrets.token_hex(16)
#: vLLM's counter identifiers: ``renderer{api rank}-mm-{n}-{modality}-{i}`` (renderers/base.py).
_COUNTER_IDENTIFIER = re.compile(r"^renderer\d+-mm-\d+-")

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_warned: set[str] = set()  # what was warned about in this process


def load_inputs(vllm_config: Any, model_id: str | None) -> dict[str, Any]:
    """The namespace inputs of how vLLM loads the model (module invariants):
    its load format, weight files it is told to ignore, a config read from ``hf_config_path`` (not among
    the fingerprinted files) by the digest of the config vLLM built, a quantization config file by its content."""
    load = getattr(vllm_config, "load_config", None)
    fmt = load_format_of(load)
    out: dict[str, Any] = {}
    ignored = getattr(load, "ignore_patterns", None) or []
    ignored = [ignored] if isinstance(ignored, str) else list(ignored)
    if ignored and ignored != list(DEFAULT_IGNORE_PATTERNS):  # which of the directory's weight files load
        out["ignore_patterns"] = ignored
    config_path = getattr(vllm_config.model_config, "hf_config_path", None)
    if config_path:
        model_config = vllm_config.model_config
        revision = getattr(model_config, "_hf_config_revision", None) or getattr(model_config, "revision", None)
        out["hf_config"] = config_digest(str(config_path), model_config.hf_config, revision,
                                         getattr(model_config, "code_revision", None))
    out.update(quantization_file_inputs(vllm_config.model_config))
    if fmt in FILE_LOAD_FORMATS:
        if has_mistral_layout(vllm_config.model_config):  # which half of the folder loads: the formats pick
            config_format = getattr(vllm_config.model_config, "config_format", "auto")
            out["formats"] = [fmt, str(getattr(config_format, "value", config_format))]
        return out
    if model_id is None:
        out.update(weights_elsewhere(vllm_config, fmt))
    extra = getattr(load, "model_loader_extra_config", None)
    # A digest, not the options: they may hold credentials, and the namespace record travels (remote manifests).
    digest = hashlib.blake2b(json.dumps(extra, sort_keys=True, default=str).encode(), digest_size=16).hexdigest() if extra else None
    if fmt == "dummy":  # vLLM seeds each shard's random weights alike: another TP or expert-parallel size, other weights
        parallel = vllm_config.parallel_config
        experts = int(parallel.data_parallel_size) if getattr(parallel, "enable_expert_parallel", False) else 1
        out["dummy_shards"] = [int(parallel.tensor_parallel_size), experts]
    return {**out, "load_format": fmt, "model_loader_extra_config": digest}


def has_mistral_layout(model_config: Any) -> bool:
    """Whether the model's folder (a local one, or a hub id's cached
    snapshot) holds vLLM's Mistral layout (:data:`MISTRAL_FILES`, or any
    ``consolidated*.safetensors``): there the load and config formats pick
    which half vLLM reads, the fingerprint hashing both (module invariants)."""
    model = str(getattr(model_config, "model", "") or "")
    if os.path.isdir(model):
        try:
            names = os.listdir(model)
        except OSError:
            return False
        return any(name in MISTRAL_FILES or (name.startswith("consolidated") and name.endswith(".safetensors")) for name in names)
    return bool(model) and bool(hub_cached_files(model, MISTRAL_FILES, getattr(model_config, "revision", None)))


def multimodal_inputs(vllm_config: Any) -> dict[str, Any]:
    """Engine-wide multimodal options that change an item's embeddings (so
    every later layer's KV) and that vLLM's item identifiers leave out."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm is None:
        return {}
    out: dict[str, Any] = {
        "mm_processor_kwargs": getattr(mm, "mm_processor_kwargs", None),
        "media_io_kwargs": getattr(mm, "media_io_kwargs", None),
    }
    if getattr(mm, "video_pruning_rate", None):
        out["video_pruning"] = [mm.video_pruning_rate, str(getattr(mm, "video_pruning_method", ""))]
    attn_dtype = getattr(mm, "mm_encoder_attn_dtype", None)
    if attn_dtype:
        scales = getattr(mm, "mm_encoder_fp8_scale_path", None)
        if not scales:
            raise ConfigError(
                f"the vision encoder's attention runs in {attn_dtype} with scales calibrated at runtime: each engine "
                "computes other image embeddings, so another engine's multimodal KV would be wrong here",
                hint="calibrate once (mm_encoder_fp8_scale_save_path), then serve with mm_encoder_fp8_scale_path set to "
                     "that file, or leave mm_encoder_attn_dtype unset",
            )
        out["mm_encoder_attn"] = [str(attn_dtype), _file_digest(scales)]
    return out


def counter_identifiers(vllm_config: Any) -> bool:
    """True where vLLM gives multimodal items per-process counter
    identifiers instead of content hashes: a multimodal model served with
    both its prefix cache and its processor cache off (renderers/base.py).
    A counter identifier with per-request processor kwargs is hashed with
    them, so it no longer looks like one: under this config every
    identifier is taken as a counter."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True))
    return mm is not None and getattr(mm, "mm_processor_cache_gb", 1) == 0 and not prefix_caching


def item_identity(identifier: str, counters: bool = False) -> str:
    """A multimodal item's identity in block keys (module invariants);
    ``counters``: :func:`counter_identifiers` of the engine's config."""
    if counters or _COUNTER_IDENTIFIER.match(identifier):
        return f"{identifier}@{PROCESS_NONCE}"
    return identifier


def device_tag(current_platform: Any, cache_dtype: str) -> str:
    """The layout's platform off CPU (module invariants); CUDA's tag is
    ``cuda``, as before."""
    name = str(getattr(current_platform, "device_name", None) or current_platform.device_type)
    if name == "cuda" or not cache_dtype.startswith("fp8"):
        return name
    try:
        fp8 = str(current_platform.fp8_dtype()).removeprefix("torch.")
    except Exception:  # noqa: BLE001 - a platform without the method: CUDA's encoding
        fp8 = "float8_e4m3fn"
    return name if fp8 == "float8_e4m3fn" else f"{name}:{fp8}"


def refuse_unstorable(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raises ConfigError for a deployment whose KV a block key cannot name
    (module invariants)."""
    refuse_unkeyable_specs(vllm_config, kv_cache_config)
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ConfigError(
                f"vLLM runs with {name}={size}: each rank's KV block then holds every {size}-th token of the "
                "scheduler's block, which ucm-db's units do not describe",
                hint=f"serve without ucm-db, or with {name}=1",
            )
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        if getattr(group.kv_cache_spec, "non_causal", False):
            raise ConfigError(
                f"KV cache group {index} attends non-causally (prefix-LM): a block's KV depends on the tokens after "
                "it, and ucm-db keys a block by the tokens up to its end",
                hint="serve this model without ucm-db",
            )


def warn_weight_updates(vllm_config: Any) -> None:
    """Warns (once a process) where vLLM is set up to take new weights while
    it serves (``weight_transfer_config``: RL weight sync): the weights
    change under the model's namespace, and only a connector reset moves
    its epoch on (``docs/connector.md``, "Reset and invalidation")."""
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    if transfer is None or "weight_updates" in _warned:
        return
    _warned.add("weight_updates")
    logger.warning("ucm-db: this engine takes weight updates (weight_transfer_config, backend %s): after each, call "
                   "reset_prefix_cache(reset_connector=True) (or `ucm-db invalidate`), or ucm-db keeps serving KV of "
                   "the weights before it under the model's namespace", getattr(transfer, "backend", "?"))


def additional_inputs(vllm_config: Any) -> dict[str, Any]:
    """``additional_config`` where set, as a digest (module invariants; it
    may hold credentials): the JSON vLLM's own config hash reads, or the
    object's ``compute_hash()``."""
    extra = getattr(vllm_config, "additional_config", None)
    if not extra:
        return {}
    text = json.dumps(extra, sort_keys=True, default=str) if isinstance(extra, dict) else str(extra.compute_hash())
    return {"additional_config": hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}


#: SpeculativeConfig fields that change a stored draft's K/V beside what ``drafts.draft_shape`` names (the draft's
#: MoE kernels, its length, remote code, token ids, how many of its layers run), keyed where set.
DRAFT_KV_FIELDS = ("moe_backend", "max_model_len", "code_revision", "use_heterogeneous_vocab",
                   "num_speculative_tokens_per_batch_size")


def draft_engine_inputs(vllm_config: Any) -> dict[str, Any]:
    """For a namespace whose blocks hold draft layers: :data:`DRAFT_KV_FIELDS`
    where set, and parallel drafting where its method does not imply it
    (DFlash and DSpark always draft in parallel); empty by default."""
    spec = getattr(vllm_config, "speculative_config", None)
    out: dict[str, Any] = {}
    for name in DRAFT_KV_FIELDS:
        value = getattr(spec, name, None)
        if value not in (None, False, "", [], ()):  # as plain JSON: an enum by its value, tuples as lists
            out[name] = json.loads(json.dumps(getattr(value, "value", value), default=str))
    if getattr(spec, "parallel_drafting", False) and str(getattr(spec, "method", "")) not in ("dflash", "dspark"):
        out["parallel_drafting"] = True
    return out


def _file_digest(path: str) -> str:
    """BLAKE2b of a small file's content (a scale table), or the path where
    it cannot be read (vLLM then fails to start anyway)."""
    try:
        return "blake2b:" + hashlib.blake2b(Path(path).expanduser().read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return f"path:{path}"


def lora_engine_inputs(vllm_config: Any) -> str:
    """What of the engine's LoRA config changes an adapter's K/V, as
    canonical JSON (empty: nothing set, or no LoRA): ``target_modules``
    (modules outside it drop the adapter's weights there), ``lora_dtype``
    where not ``auto`` (the adapter's deltas in another precision), and
    how MoE adapters are read. Keyed into adapter requests' chains only
    (:func:`ucm_db.connector.request_keys.request_extras`), so requests
    without an adapter share blocks across engines whatever these say."""
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        return ""
    dtype = getattr(lora, "lora_dtype", "auto")
    inputs = {
        "target_modules": sorted(getattr(lora, "target_modules", None) or ()),
        "lora_dtype": None if dtype in (None, "auto") else str(dtype).removeprefix("torch."),
        "mixed_moe_format": getattr(lora, "enable_mixed_moe_lora_format", False),
        "moe_shared": getattr(lora, "enable_moe_shared_loras", False),
    }
    plain = {name: value for name, value in inputs.items() if value not in (None, False, [])}
    return json.dumps(plain, sort_keys=True, separators=(",", ":")) if plain else ""


def current_platform() -> Any:
    """vLLM's platform object (None where there is none: tests without one)."""
    try:
        from vllm.platforms import current_platform as platform

        platform.device_type  # noqa: B018 - resolving it may fail where no platform is found
    except Exception:  # noqa: BLE001
        return None
    return platform
