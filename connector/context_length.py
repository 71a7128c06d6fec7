"""Where ``max_model_len`` changes K/V, in vLLM 0.32 (from an audit of every
read of it in ``model_executor/models``), and what of it
:func:`~ucm_db.connector.identity.namespace_inputs` keys.

Invariants:
    * LongRoPE picks its long factors for every position once the length
      exceeds ``original_max_position_embeddings``: the flag is keyed, not
      the length. Dynamic NTK's base reads ``max_position``, which some
      models take from ``max_model_len``: the length is keyed. Llama 4's
      ``attn_temperature_tuning`` (on by default above 32K) scales the NoPE
      layers' queries: the flag is keyed.
    * The length is the one the model was built with: under vLLM's
      auto-fit (:func:`built_max_model_len`), not the one it lowered to.
    * YaRN, llama3 and DeepSeek scaling read ``original_max_position_embeddings``
      (config, keyed with RoPE); linear and default RoPE only size their
      cos/sin cache: nothing is keyed for them.
"""

from __future__ import annotations

from typing import Any

from ucm_db.errors import ConfigError


#: RoPE types whose rotation reads ``max_model_len`` (:func:`max_len_inputs`).
LENGTH_READING_ROPES = frozenset({"longrope", "su", "dynamic"})


def max_len_inputs(config: Any, text: Any, params: Any) -> dict[str, Any]:
    """Where ``max_model_len`` changes K/V, what of it does."""
    layers: list[dict[str, Any]] = []
    if isinstance(params, dict):  # one dict, or one per layer type
        layers = [p for p in params.values() if isinstance(p, dict)] or [params]
    types = {str(p.get("rope_type", p.get("type", ""))) for p in layers}
    out: dict[str, Any] = {}
    built = built_max_model_len(config)  # once: under auto-fit it re-runs vLLM's check, which logs
    if types & {"longrope", "su"}:
        original = next((p["original_max_position_embeddings"] for p in layers if "original_max_position_embeddings" in p),
                        getattr(text, "original_max_position_embeddings", None))
        out["long_rope"] = original is not None and built > int(original)
    if "dynamic" in types:
        out["max_model_len"] = built
    if getattr(text, "model_type", "") in ("llama4", "llama4_text"):
        out["attn_temperature_tuning"] = _llama4_temperature_tuning(config, built)
    return out


def built_max_model_len(config: Any) -> int:
    """The ``max_model_len`` the model was built with, which its RoPE and
    attention modules read then and keep. Under vLLM's auto-fit
    (``--max-model-len auto``/-1) the model is built at the length derived
    from its config, and ``max_model_len`` is lowered afterwards to what the
    KV cache memory holds: the derived length, not the lowered one, is the
    model's (an engine given the lowered length builds other K/V)."""
    if getattr(config, "original_max_model_len", None) != -1:
        return int(config.max_model_len)
    try:
        return int(config.get_and_verify_max_len(-1))
    except Exception as exc:  # noqa: BLE001 - vLLM's own check, re-run: any failure is this one
        raise ConfigError(f"ucm-db cannot tell the length the model was built with under --max-model-len auto ({exc})",
                          hint="pass an explicit --max-model-len") from exc


def _llama4_temperature_tuning(config: Any, built_len: int) -> bool:
    """As vLLM's Llama4ForCausalLM decides it: the generation config's
    value, else on above 32K tokens (of the length it was built with)."""
    try:
        generation = dict(config.try_get_generation_config())
    except Exception:  # noqa: BLE001 - no generation config: vLLM's default below
        generation = {}
    generation.update(config.override_generation_config or {})
    return bool(generation.get("attn_temperature_tuning", built_len > 32768))


def rope_of(text: Any) -> dict[str, Any]:
    """The effective RoPE parameters of a text config (vLLM patches them into
    ``rope_parameters``; older configs keep ``rope_scaling`` and
    ``rope_theta`` apart)."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    rope: dict[str, Any] = {"parameters": params} if params else {}
    for name in ("rope_theta", "partial_rotary_factor"):
        value = getattr(text, name, None)
        if value is not None and not (isinstance(params, dict) and params.get(name) == value):
            rope[name] = value
    return rope
