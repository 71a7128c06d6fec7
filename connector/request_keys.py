"""A request's key chain and the extras hashed into it.

Invariants:
    * A request's key chain is hashed once, by ucm-db, from its token ids
      and its extras (:func:`request_extras`: the LoRA adapter's content
      digest, ``cache_salt``; :func:`request_block_extras`: multimodal item
      identities and offsets, a prompt-embedding digest with, in mixed mode,
      which rows are token ids), so keys are stable across restarts and
      vLLM versions; :func:`chain_keys` extends it incrementally as the
      request grows (``Namespace.block_keys(..., parent=last_key)``).
    * Only the scheduler calls these (request keys are hashed there alone).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ucm_db.connector.fingerprints import adapter_key
from ucm_db.connector.identity_guards import item_identity
from ucm_db.keys import BlockKeys, Namespace

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm_db.connector.scheduler.request_state import RequestState


def request_extras(request: Request, lora_engine: str = "") -> dict[str, Any]:
    """What changes all of a request's KV besides its token ids: the root
    extras of its key chain (LoRA adapter by content, with how the engine
    applies adapters: :func:`~ucm_db.connector.identity.lora_engine_inputs`;
    ``cache_salt``)."""
    extras: dict[str, Any] = {}
    if request.lora_request is not None:
        extras["lora"] = adapter_key(request.lora_request)
        if lora_engine:
            extras["lora_engine"] = lora_engine
    if request.cache_salt:
        extras["cache_salt"] = str(request.cache_salt)
    return extras


def request_block_extras(request: Request, block_size: int, counter_mm_ids: bool = False) -> dict[int, bytes]:
    """What changes single blocks' KV besides their token ids, by block index:
    the multimodal items whose placeholder tokens a block holds (identity as
    :attr:`~ucm_db.connector.identity.KVShape.counter_mm_ids` says, offset, length of each), and a digest of
    the block's rows of ``prompt_embeds``. Blocks before the first such block
    keep the keys of a plain prompt, so a shared text prefix still hits."""
    items: dict[int, list[list[Any]]] = {}
    for feature in request.mm_features or []:
        offset, length = int(feature.mm_position.offset), int(feature.mm_position.length)
        for block in range(offset // block_size, (offset + max(length, 1) - 1) // block_size + 1):
            items.setdefault(block, []).append([item_identity(str(feature.identifier), counter_mm_ids), offset, length])
    extras = {block: b"mm" + json.dumps(listed, separators=(",", ":")).encode() for block, listed in items.items()}
    if request.prompt_embeds is not None:
        embeds = request.prompt_embeds.detach().to("cpu")  # one device copy, not one per block
        mask = getattr(request, "prompt_is_token_ids", None)  # mixed mode: which rows the model reads from token ids
        rows_total = int(embeds.shape[0])
        for block in range(-(-rows_total // block_size)):  # the block the prompt ends in too (clipped rows)
            rows = slice(block * block_size, min((block + 1) * block_size, rows_total))
            digest = _tensor_digest(embeds[rows], None if mask is None else bytes(map(bool, mask[rows])))
            extras[block] = extras.get(block, b"") + b"pe" + digest
    return extras


def _tensor_digest(tensor: Any, token_mask: bytes | None) -> bytes:
    """The rows' bytes, shape and dtype, and in mixed mode which rows are
    token ids (a token's row in ``prompt_embeds`` is not what the model reads)."""
    import torch

    cpu = tensor.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(digest_size=32, person=b"ucm-db/embeds")
    digest.update(repr((tuple(cpu.shape), str(cpu.dtype))).encode())
    digest.update(cpu.view(-1).view(torch.uint8).numpy().tobytes())
    if token_mask is not None:
        digest.update(b"tokens" + token_mask)
    return digest.digest()


def chain_keys(namespace: Namespace, block_size: int, state: RequestState, num_blocks: int) -> BlockKeys:
    """The request's block keys, at least ``num_blocks`` long (maybe
    longer: callers slice), hashing only blocks not hashed before (they are
    appended to ``state.keys``, rooted at ``state.epoch``)."""
    have = len(state.keys)
    if have < num_blocks:
        end = num_blocks * block_size
        request = state.request
        prompt = request.prompt_token_ids
        # The prompt list itself when it is long enough, cut by block_keys:
        # slicing 32K ids cost 0.25 ms (a reference to every int) on a 1 ms
        # budget. Past the prompt, all_token_ids (block_keys slices it). Not
        # in mixed mode (prompt_is_token_ids set): vLLM keeps a placeholder id
        # at embedding rows in prompt_token_ids but 0 in all_token_ids, so one
        # prompt would hash two ways as the first lookup reached past it or not
        # (a review: tests/connector/test_review_request_keys_fuzz.py).
        plain = getattr(request, "prompt_is_token_ids", None) is None
        tokens = prompt if plain and isinstance(prompt, list) and len(prompt) >= end else request.all_token_ids
        start = have * block_size
        if have:
            more = namespace.block_keys(tokens, parent=state.keys[-1], start=start, stop=end, block_extras=state.block_extras)
        else:
            more = namespace.block_keys(tokens, state.extras, start=start, stop=end, block_extras=state.block_extras,
                                        epoch=state.epoch or 0)
        state.keys.extend(more)
    return state.keys  # callers slice: copying 1000s of keys per call showed in profiles
