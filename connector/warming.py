"""Connector-side warming: pre-seed a store from an engine, or import KV.

* :func:`warm_engine` runs prefill-only requests (one output token) for a
  list of prompts through a vLLM engine configured with the UcmDbConnector,
  so a system prompt or document set is stored before users arrive
  (``tests/vllm/test_connector_e2e.py`` runs it). What the connector saves goes to
  the store, and through its upload queue to the remote tier if one is set.
* :func:`import_kv` puts blocks computed elsewhere into a store: token ids
  give the chain keys, the KV tensors (in any layout
  :mod:`ucm_db.connector.layouts` knows) give the payloads, gathered into
  units exactly as the connector's worker gathers them, so an engine
  loading the blocks later sees the same bytes it would have saved itself.

Invariants:
    * Keys are derived as the scheduler derives them
      (``Namespace.block_keys(tokens, extras, epoch=store.epoch(namespace))``),
      so imported blocks hit for the same prompt, extras (``cache_salt``,
      LoRA ...) and namespace, at its current epoch (after ``ucm-db
      invalidate`` or a reset too; never for an engine that reset itself,
      which is served only what it stores: docs/connector.md).
    * Only root extras: no per-block extras (a multimodal item's identity,
      a prompt-embedding digest), so the KV of a multimodal or
      prompt-embeds prompt must not be imported: it would be keyed as the
      plain text of its token ids and served to such a text prompt.
    * Only full blocks are imported; a trailing partial block is ignored.
    * Imports keep the store's prefix invariant: the chain is put from its
      first block (or after ``parent``) in one atomic batch.
    * Imports store units (one per KV head of every layer the layout holds,
      :mod:`ucm_db.keys.units`), the one storage generation the connector reads:
      given the deployment's namespace and all the model's heads and layers
      (a TP=1, PP=1 cache), an engine at any TP size reads them.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


import ucm_db
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace
from ucm_db.keys.units import KVGrid, UnitKeys

from ucm_db.connector.layouts import KVLayout
from ucm_db.connector.request_controls import SAVE_ALWAYS
from ucm_db.connector.roles import PARAMS_KEY


@dataclass(frozen=True, slots=True)
class EngineWarmReport:
    """Outcome of :func:`warm_engine`.

    Attributes:
        prompts: prompts run.
        prompt_tokens: tokens prefilled in total.
        cached_tokens: tokens vLLM reported as not computed (already stored).
        seconds: wall time.
    """

    prompts: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float


def warming_params() -> Any:
    """:func:`warm_engine`'s ``SamplingParams``: one greedy token, and the
    ``save: "always"`` control, so every prompt is stored whatever the
    connector's ``admit_after`` says (admission.py)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {PARAMS_KEY: {"save": SAVE_ALWAYS}}})


def warm_engine(llm: Any, prompts: Sequence[Sequence[int] | Mapping[str, Any]]) -> EngineWarmReport:
    """Runs each prompt through ``llm`` with one output token, each sent
    with the ``save: "always"`` control, so every prompt is stored whatever
    the connector's ``admit_after`` says.

    Args:
        llm: a ``vllm.LLM`` whose ``kv_transfer_config`` uses the
            UcmDbConnector.
        prompts: token id lists, or dicts ``{"ids": [...], "cache_salt": s}``.

    Returns:
        An :class:`EngineWarmReport`. The connector commits saves from a
        background thread: flush the store (or wait) before relying on them
        from another process.
    """
    checked = [_prompt_parts(prompt, i) for i, prompt in enumerate(prompts)]  # all before the first runs
    from vllm.inputs import TokensPrompt

    params = warming_params()
    started = time.perf_counter()
    total = cached = 0
    for ids, salt in checked:
        tokens_prompt = TokensPrompt(prompt_token_ids=ids)
        if salt:
            tokens_prompt["cache_salt"] = salt
        out = llm.generate([tokens_prompt], params, use_tqdm=False)[0]
        total += len(ids)
        cached += int(out.num_cached_tokens or 0)
    return EngineWarmReport(len(checked), total, cached, time.perf_counter() - started)


def _prompt_parts(prompt: Any, index: int) -> tuple[list[int], str | None]:
    """``(token ids, cache_salt)`` of one :func:`warm_engine` prompt.

    Raises:
        ConfigError: not a non-empty list of token ids, nor a dict of
            ``ids`` and an optional string ``cache_salt`` (a string's
            characters, or a dict without ``ids``, used to run as tokens or
            fail with a bare KeyError after the prompts before it ran).
    """
    hint = 'pass token id lists, or dicts {"ids": [...], "cache_salt": "..."}'
    salt = None
    ids = prompt
    if isinstance(prompt, Mapping):
        unknown = sorted(map(str, set(prompt) - {"ids", "cache_salt"}))
        if "ids" not in prompt or unknown:
            raise ConfigError(f"warm_engine prompt {index} " + (f"has unknown key(s) {', '.join(unknown)}" if unknown
                                                                 else "has no 'ids'"), hint=hint)
        ids, salt = prompt["ids"], prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError(f"warm_engine prompt {index}: cache_salt is {type(salt).__name__}, not a string", hint=hint)
    tokens = [] if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable) else list(ids)
    if not tokens or not all(_is_token_id(t) for t in tokens):
        raise ConfigError(f"warm_engine prompt {index} is not a non-empty list of token ids (ints >= 0)", hint=hint)
    return [operator.index(t) for t in tokens], salt


def _is_token_id(value: Any) -> bool:
    """True for an int >= 0 as :func:`operator.index` takes one: an int, a
    numpy integer, a one-element integer tensor (an element of a tensor of
    block ids: vLLM holds block tables as tensors). Never a bool nor a bool
    tensor (True imported block 1), a float nor a float tensor (1.5 too)."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool"):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


def import_kv(
    store: ucm_db.Store,
    namespace: Namespace,
    layout: KVLayout,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    *,
    extras: Mapping[str, Any] | None = None,
) -> ucm_db.PutResult:
    """Stores the KV of ``token_ids`` held in ``layout``'s tensors.

    Args:
        store: the destination store.
        namespace: the engine's namespace (model, dtype, layout ...).
        layout: the KV caches holding the computed blocks, every KV head
            of every layer
            (:func:`~ucm_db.connector.layouts.detect_layout` over tensors
            shaped like the engine's).
        token_ids: the prompt's token ids.
        block_ids: for each full block of ``token_ids``, the index of the
            block in ``layout``'s tensors (ints, numpy ints, or an integer
            tensor such as a row of vLLM's block table).
        extras: request extras (``cache_salt``, ``lora`` ...), as the
            connector's scheduler derives them. There are no per-block
            extras: import only KV of plain token prompts, never of a
            prompt with multimodal items or prompt embeddings (keyed here
            as the text of its token ids, it would be served to that text).

    Returns:
        The puts' totals, counted in units (``layout.heads`` per block),
        keyed at the namespace's current epoch (:meth:`ucm_db.Store.epoch`).

    Raises:
        ConfigError: ``block_ids`` does not match the number of full blocks,
            or holds something other than ints >= 0 (nothing is imported).
        EpochUnknownError: the namespace's epoch cannot be established
            (:meth:`ucm_db.Store.epoch`): nothing is imported.
    """
    keys = namespace.block_keys(token_ids, dict(extras or {}), epoch=store.epoch(namespace))
    if not all(_is_token_id(b) for b in block_ids):  # 1.5 or True imported block 1's KV under these keys
        raise ConfigError(f"import_kv block ids must be ints >= 0, got {list(block_ids)[:8]}",
                          hint="pass the block indices of the KV cache tensors, one per full block")
    if len(block_ids) != len(keys):
        raise ConfigError(
            f"import_kv got {len(block_ids)} block ids for {len(keys)} full blocks of {len(token_ids)} tokens",
            hint=f"pass one block id per full block of {namespace.block_size} tokens",
        )
    if not keys:
        return ucm_db.PutResult()
    staging = layout.new_unit_staging(len(keys))
    layout.gather_units([operator.index(b) for b in block_ids], staging)
    rows = staging.numpy()
    grid = KVGrid(layout.heads, len(layout.layers))
    total = ucm_db.PutResult()
    for head, span in enumerate(grid.head_spans()):  # each head's units form their own chain
        payloads = [layout.unit_frames(rows[i, head]) for i in range(len(keys))]
        result = store.put(namespace, list(UnitKeys(keys, grid, span)), payloads, parent=None)
        total.stored += result.stored
        total.already_present += result.already_present
        total.evicted += result.evicted
    return total
