"""What picks the numerics a deployment's kernels compute with, beyond the
model config: keyed in the namespace (:func:`numerics_inputs`).

The rule (``docs/connector.md``, "Identity"): kernel choices that change
only rounding (attention backend, eager mode, ``model_impl``) are not keyed;
a choice that changes what is computed (weights or activations quantized
another way, queries quantized to fp8) is.

Invariants:
    * A quantized model carries its kernels' scheme: on an accelerator the
      device's compute capability (fp8 weights run weight-only W8A16 Marlin
      kernels on some GPU generations and W8A8 on others; FP4 likewise),
      the linear and MoE kernel backends where named, and
      :data:`QUANT_ENV_VARS` where set.
    * A quantized KV cache (fp8, nvfp4) carries the attention's choices
      that decide whether queries are quantized with it: the device's
      compute capability (an automatic choice is the device's) and the
      attention backend, per-kind backends, FlashAttention version,
      TRT-LLM switch and MLA prefill backend where named.
    * Any model carries :data:`NUMERICS_ENV_DEFAULTS` where not at their
      defaults; a hybrid model the SSM state's dtypes where not ``auto`` (its
      attention layers compute from what its SSM layers kept, so every
      group's KV depends on them, not only the SSM group's).
    * Nothing else: a model neither quantized nor with a quantized KV cache
      has one namespace across GPU generations and kernel choices.
"""

from __future__ import annotations

import os
from typing import Any

#: Environment variables with which vLLM changes what a quantized model
#: computes (activation quantization in Marlin kernels; an online weight
#: quantization's own config; FP4 MoE forced to 16-bit activations), keyed as set.
QUANT_ENV_VARS = ("VLLM_MARLIN_INPUT_DTYPE", "VLLM_HUMMING_ONLINE_QUANT_CONFIG", "VLLM_B12X_MOE_FP4_FORCE_A16")
#: Environment switches with which vLLM quantizes or repacks what any model
#: computes or stores (TP all-reduce on ROCm, expert-parallel dispatch and
#: combine, float32 matmuls as TF32, ROCm's shuffled KV page layout): keyed
#: where set to other than vLLM's default (their values as vLLM reads them).
NUMERICS_ENV_DEFAULTS = {"VLLM_ROCM_QUICK_REDUCE_QUANTIZATION": ("none",), "VLLM_FLOAT32_MATMUL_PRECISION": ("highest",),
                         "VLLM_DEEPEPLL_NVFP4_DISPATCH": ("0",),
                         "VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE": ("0",),
                         "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": ("0", "false")}
#: KV cache dtypes that keep the model's precision (others are quantized).
UNQUANTIZED_KV = frozenset({"auto", "bfloat16", "float16", "half", "float32", "float"})
#: AttentionConfig fields that decide, under a quantized KV cache, whether queries are quantized too.
ATTENTION_CHOICES = ("backend", "backend_per_kind", "flash_attn_version", "use_trtllm_attention", "mla_prefill_backend")


def numerics_inputs(vllm_config: Any, current_platform: Any) -> dict[str, Any]:
    """The namespace inputs of the module invariants (empty where none applies)."""
    inputs: dict[str, Any] = {}
    numerics = {name: os.environ[name].strip().lower() for name, default in NUMERICS_ENV_DEFAULTS.items()
                if os.environ.get(name, "").strip().lower() not in ("", *default)}
    if numerics:
        inputs["numerics_env"] = numerics
    cache = vllm_config.cache_config
    if _hybrid(vllm_config.model_config):  # vLLM sets these on other models too, where nothing reads them
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if str(getattr(cache, name, "auto")) != "auto":
                inputs[name] = str(getattr(cache, name))
    quantized_kv = str(getattr(cache, "cache_dtype", "auto")) not in UNQUANTIZED_KV
    if quantized_kv:
        attention = getattr(vllm_config, "attention_config", None)
        named = {name: getattr(attention, name, None) for name in ATTENTION_CHOICES}  # enums: identity._plain
        named = {name: value for name, value in named.items() if value not in (None, {}, "auto")}
        if named:
            inputs["kv_quant_attention"] = named
    quantized = bool(getattr(vllm_config.model_config, "quantization", None))
    if (quantized or quantized_kv) and str(getattr(current_platform, "device_type", "cpu")) != "cpu":
        inputs["device_capability"] = _capability(current_platform)
    if quantized:
        inputs.update(_quantized_kernels(vllm_config))
    return inputs


def _hybrid(model_config: Any) -> bool:
    """Whether the model has SSM layers beside its attention (vLLM's word)."""
    try:
        return bool(model_config.is_hybrid)
    except Exception:  # noqa: BLE001 - a config vLLM cannot inspect: it has no SSM state group either
        return False


def _capability(current_platform: Any) -> str:
    try:
        capability = current_platform.get_device_capability()
    except Exception:  # noqa: BLE001 - a platform that cannot say: keyed as unknown
        capability = None
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"


def _quantized_kernels(vllm_config: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    kernels = getattr(vllm_config, "kernel_config", None)
    for name in ("linear_backend", "moe_backend"):
        backend = str(getattr(kernels, name, "auto") or "auto")
        if backend != "auto":
            inputs[name] = backend
    per_quant = getattr(kernels, "linear_backend_per_quant", None)
    if per_quant:
        inputs["linear_backend_per_quant"] = {str(k): str(v) for k, v in dict(per_quant).items()}
    env = {name: os.environ[name] for name in QUANT_ENV_VARS if os.environ.get(name)}
    if env:
        inputs["quant_env"] = env
    return inputs
