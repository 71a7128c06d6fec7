"""Which of vLLM's KV cache specs hold what a ucm-db key names: content that
is a pure causal function of the tokens up to the block's end.

A block key chains the tokens of a prefix, so a block may be stored only
where its K/V (or SSM state) are fixed by those tokens alone: not by tokens
after it, not by where the prompt ended, not by a ring that wraps. vLLM's
own prefix cache rests on the same property and says so per spec
(``KVCacheSpec.prefix_cacheable``), or per model where a config hook turns
prefix caching off for it.

Invariants:
    * An allow-list: a spec class is stored only where
      :data:`SPEC_VERDICTS` judges it ``prefix``; a class it does not name
      (one vLLM or a platform plug-in adds) is refused until judged
      (``tests/connector/test_identity_guards_audit.py`` fails on every
      subclass of vLLM's ``KVCacheSpec`` not named here). Judged by exact
      class name: a subclass does not inherit its parent's verdict (R-SWA
      is a ``FullAttentionSpec``).
    * Beside the class, a spec is refused where vLLM says it is not prefix
      cacheable (``prefix_cacheable`` False: bounded replay, hot caches) or
      it flattens non-causal query blocks into decode
      (``non_causal_multi_token_decode``); a container of specs
      (``UniformTypeKVCacheSpecs``) by each of its members.
    * A model whose vLLM config hook turns prefix caching off because its
      KV is not a prefix function (:data:`NOT_PREFIX_ARCHITECTURES`) is
      refused whatever its specs say.
    * Whether a group of an accepted spec can be laid out (several groups,
      SSM state modes) is ``hybrid/groups.py``'s to decide, after this.
"""

from __future__ import annotations

from typing import Any

from ucm_db.errors import ConfigError

PREFIX = "prefix"

#: Every ``KVCacheSpec`` class of vLLM 0.32 (``vllm/v1/kv_cache_interface.py``): ``prefix`` where a block's
#: content is a function of the tokens up to its end, else why no prefix key names it (the refusal's reason).
SPEC_VERDICTS: dict[str, str] = {
    "FullAttentionSpec": PREFIX,
    "SlidingWindowSpec": PREFIX,  # each token attends the window before it
    "ChunkedLocalAttentionSpec": PREFIX,  # chunks start at fixed positions; a token attends its chunk up to itself
    "MLAAttentionSpec": PREFIX,
    "SlidingWindowMLASpec": PREFIX,  # with bounded replay vLLM says it is not prefix cacheable: refused by that
    "SinkFullAttentionSpec": PREFIX,  # static sink K/V from the weights, in blocks vLLM keeps out of requests' tables
    "HiddenStateCacheSpec": PREFIX,  # a token's hidden states at some layers: causal like its K/V
    "MambaSpec": PREFIX,  # the state after each block's last token (align mode only: hybrid/groups.py)
    "UniformTypeKVCacheSpecs": PREFIX,  # a container: judged by its members
    "RSWASpec": "R-SWA keeps only the last generated tokens beside the prompt: a decode block's K/V depend on where "
                "the prompt ended, not only on the tokens before it",
    "CircularBufferSpec": "a ring of one block per request that wraps: no block holds a fixed span of the prefix",
    "HiSparseHotSpec": "an ephemeral per-request hot cache of a sparse attention, not the prefix's K/V",
    "HiSparseResidentSpec": "reclaimable pages of a host-backed sparse attention, not the prefix's K/V",
    "EncoderOnlyAttentionSpec": "bidirectional attention: a block's K/V depend on the tokens after it",
    "CrossAttentionSpec": "cross-attention K/V are the encoder's output, not a function of the decoder's tokens",
    "AttentionSpec": "a base class: no kind of attention named",
    "KVCacheSpec": "a base class: no kind of cache named",
}

#: Architectures whose vLLM config hook (``vllm/model_executor/models/config.py``) turns prefix caching off, each
#: judged: ``prefix`` where the hook's reason is not the KV's, else why the KV is not a prefix function.
NOT_PREFIX_ARCHITECTURES: dict[str, str] = {
    "UnlimitedOCRForCausalLM": "Unlimited-OCR windows its generated tokens (R-SWA): a decode token's K/V is not a "
                               "pure causal function of the prefix, so vLLM turns prefix caching off for it",
}


def refuse_unkeyable_specs(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raises ConfigError where a KV cache group's spec, or the model, holds
    KV that no prefix key names (module invariants)."""
    model_config = getattr(vllm_config, "model_config", None)
    architectures = {*(getattr(model_config, "architectures", None) or ()),  # vLLM's resolved ones, and the config's
                     *(getattr(getattr(model_config, "hf_config", None), "architectures", None) or ())}
    for architecture in sorted(map(str, architectures)):
        why = NOT_PREFIX_ARCHITECTURES.get(architecture, PREFIX)
        if why != PREFIX:
            raise ConfigError(f"ucm-db cannot key {architecture}'s KV by its token prefix: {why}",
                              hint="serve this model without ucm-db")
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        for spec in _members(group.kv_cache_spec):
            why = _verdict(spec)
            if why != PREFIX:
                raise ConfigError(
                    f"KV cache group {index} ({len(group.layer_names)} layers) has a {type(spec).__name__}, whose "
                    f"blocks ucm-db cannot key by their token prefix: {why}",
                    hint="serve this model without ucm-db",
                )


def _members(spec: Any) -> list[Any]:
    """A container's specs (vLLM's ``UniformTypeKVCacheSpecs``), else the spec itself."""
    members = getattr(spec, "kv_cache_specs", None)
    return [spec, *members.values()] if isinstance(members, dict) else [spec]


def _verdict(spec: Any) -> str:
    """``prefix``, or why ``spec``'s blocks are no function of their prefix."""
    name = type(spec).__name__
    why = SPEC_VERDICTS.get(name, f"ucm-db does not know {name} (a KV cache spec newer than this ucm-db, or a "
                                  "platform's own), so it cannot tell whether its blocks are a function of their prefix")
    if why != PREFIX:
        return why
    if getattr(spec, "prefix_cacheable", True) is False:
        return "vLLM marks it not prefix cacheable (its blocks are replayed or ephemeral, not the prefix's K/V)"
    if getattr(spec, "non_causal_multi_token_decode", False):
        return "it flattens non-causal query blocks into decode rows: a block's K/V may depend on tokens after it"
    return PREFIX
