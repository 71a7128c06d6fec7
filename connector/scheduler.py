"""Scheduler side of the connector: prefix lookups and the per-step plan.

Per request it keeps the chain of block keys, extended incrementally as the
request grows (``Namespace.block_keys(..., parent=last_key)``), hashed by
ucm-db from the token ids and the request's extras (LoRA name,
``cache_salt``, multimodal item hashes and offsets, prompt-embedding
digest), so keys are stable across restarts and vLLM versions.

Invariants:
    * ``get_num_new_matched_tokens`` changes nothing but a memo of the
      request's keys (a pure function of the request); it claims only whole
      blocks that every rank's namespace holds, never the prompt's last
      token, and only beyond what vLLM already computed.
    * A load plan covers blocks ``[local, local + external)`` of the request,
      exactly what vLLM allocated for the external tokens.
    * A save plan covers each block whose KV becomes complete during the
      step, once per request (``saved_blocks`` only grows), and starts after
      the blocks known stored, so every segment's parent is stored or saved
      before it (the writer is FIFO).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db.connector.identity import KVShape, reader_namespaces
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
from ucm_db.connector.metrics import Counters
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import acquire, release
from ucm_db.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: Blocks hashed and looked up first; later segments grow 4x.
_FIRST_SEGMENT_BLOCKS = 16

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


@dataclass
class _RequestState:
    """What the scheduler side remembers about one request."""

    request: Request
    extras: dict[str, Any]        # root extras of the key chain
    block_extras: dict[int, bytes]  # per-block extras, by block index
    chains: list[list[bytes]] = field(default_factory=list)  # one key chain per reader namespace
    stored_blocks: int = 0  # leading blocks known present in the store
    saved_blocks: int = 0   # leading blocks stored or planned for saving
    pending_load_tokens: int = 0
    last_lookup_blocks: int = 0
    last_lookup_s: float = 0.0
    last_local_tokens: int = 0  # vLLM's own prefix-cache hit at the last lookup


def request_extras(request: Request) -> dict[str, Any]:
    """What changes all of a request's KV besides its token ids: the root
    extras of its key chain (LoRA adapter, ``cache_salt``)."""
    extras: dict[str, Any] = {}
    if request.lora_request is not None:
        extras["lora"] = str(request.lora_request.lora_name)
    if request.cache_salt:
        extras["cache_salt"] = str(request.cache_salt)
    return extras


def request_block_extras(request: Request, block_size: int) -> dict[int, bytes]:
    """What changes single blocks' KV besides their token ids, by block index:
    the multimodal items whose placeholder tokens a block holds (identifier,
    offset, length of each), and a digest of the block's rows of
    ``prompt_embeds``. Blocks before the first such block keep the keys of a
    plain prompt, so a shared text prefix still hits."""
    items: dict[int, list[list[Any]]] = {}
    for feature in request.mm_features or []:
        offset, length = int(feature.mm_position.offset), int(feature.mm_position.length)
        for block in range(offset // block_size, (offset + max(length, 1) - 1) // block_size + 1):
            items.setdefault(block, []).append([str(feature.identifier), offset, length])
    extras = {block: b"mm" + json.dumps(listed, separators=(",", ":")).encode() for block, listed in items.items()}
    if request.prompt_embeds is not None:
        embeds = request.prompt_embeds.detach().to("cpu")  # one device copy, not one per block
        for block in range(int(embeds.shape[0]) // block_size):
            digest = _tensor_digest(embeds[block * block_size : (block + 1) * block_size])
            extras[block] = extras.get(block, b"") + b"pe" + digest
    return extras


def _tensor_digest(tensor: Any) -> bytes:
    cpu = tensor.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(digest_size=32, person=b"ucm-db/embeds")
    digest.update(repr((tuple(cpu.shape), str(cpu.dtype))).encode())
    digest.update(cpu.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


class UcmDbScheduler:
    """Scheduler-side half of :class:`~ucm_db.connector.UcmDbConnector`."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape) -> None:
        self._store = acquire(settings)
        self._namespaces: list[Namespace] = reader_namespaces(shape)
        self._block_size = shape.block_size
        self._requests: dict[str, _RequestState] = {}
        self.counters = Counters()
        logger.info("ucm-db connector (scheduler): store %s, %d namespace(s), model %s", settings.path, len(self._namespaces), shape.model)

    # -- keys --------------------------------------------------------------------
    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            state = _RequestState(request, request_extras(request), request_block_extras(request, self._block_size))
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _RequestState, num_blocks: int) -> list[list[bytes]]:
        """Each namespace's key chain, at least ``num_blocks`` long (maybe
        longer: callers slice), hashing only blocks not hashed before."""
        if not state.chains:
            state.chains = [[] for _ in self._namespaces]
        have = len(state.chains[0])
        if have < num_blocks:
            end = num_blocks * self._block_size
            request = state.request
            prompt = request.prompt_token_ids
            # The prompt list itself when it is long enough, cut by block_keys:
            # slicing 32K ids cost 0.25 ms (a reference to every int) on a 1 ms
            # budget. Past the prompt, all_token_ids (block_keys slices it).
            tokens = prompt if isinstance(prompt, list) and len(prompt) >= end else request.all_token_ids
            start = have * self._block_size
            for ns, chain in zip(self._namespaces, state.chains):
                if have:
                    chain.extend(ns.block_keys(tokens, parent=chain[-1], start=start, stop=end, block_extras=state.block_extras))
                else:
                    chain.extend(ns.block_keys(tokens, state.extras, start=start, stop=end, block_extras=state.block_extras))
        return state.chains  # callers slice: copying 1000s of keys per call showed in profiles

    def keys_for(self, request: Request, num_blocks: int) -> list[list[bytes]]:
        """Chain keys of a request's first blocks, per namespace (tests, tools)."""
        return [chain[:num_blocks] for chain in self._keys(self._state(request), num_blocks)]

    # -- vLLM scheduler hooks ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Loadable tokens beyond ``num_computed_tokens`` (see invariants)."""
        started = time.perf_counter()
        state = self._state(request)
        state.last_local_tokens = num_computed_tokens
        max_blocks = (request.num_tokens - 1) // self._block_size
        if max_blocks * self._block_size <= num_computed_tokens:
            state.last_lookup_blocks = 0
            return 0, False
        hit_blocks = self._longest_stored_prefix(state, max_blocks)
        state.last_lookup_blocks = hit_blocks
        state.last_lookup_s = time.perf_counter() - started
        return max(0, hit_blocks * self._block_size - num_computed_tokens), False

    def _longest_stored_prefix(self, state: _RequestState, max_blocks: int) -> int:
        """Leading blocks every namespace holds, hashing no further than
        needed: the first segment is hashed and looked up alone, the rest of
        the prompt only if all of it is stored. A miss costs one small
        segment, not the prompt; a hit costs two lookups (each a binary
        search: the prefix invariant makes a segment's count exact)."""
        found, want = 0, min(max_blocks, _FIRST_SEGMENT_BLOCKS)
        while True:
            chains = self._keys(state, want)
            present = min(self._store.lookup(ns, chain[found:want]) for ns, chain in zip(self._namespaces, chains))
            found += present
            if found < want or want == max_blocks:
                return found
            want = max_blocks

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.pending_load_tokens = num_external_tokens
        state.stored_blocks = max(state.stored_blocks, state.last_lookup_blocks)
        state.saved_blocks = max(state.saved_blocks, state.stored_blocks)
        query = max(0, request.num_prompt_tokens - state.last_local_tokens)
        self.counters.add(lookups=1, lookup_s=state.last_lookup_s, query_tokens=query, hit_tokens=num_external_tokens)
        logger.info(
            "ucm-db: request %s: %d prompt tokens, %d from vLLM's prefix cache, %d hit tokens loaded from ucm-db",
            request.request_id, request.num_prompt_tokens, state.last_local_tokens, num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        meta = UcmDbConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            self._plan_load(meta, new_req.req_id, new_req.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and block_ids is not None:
                self._plan_load(meta, req_id, block_ids[0])
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self._plan_save(meta, scheduler_output, req_id, num_tokens)
        return meta

    def _plan_load(self, meta: UcmDbConnectorMetadata, req_id: str, block_ids: Sequence[int]) -> None:
        state = self._requests.get(req_id)
        if state is None or not state.pending_load_tokens:
            return
        # request.num_computed_tokens = local hit + external hit here.
        end = state.request.num_computed_tokens // self._block_size
        start = end - state.pending_load_tokens // self._block_size
        state.pending_load_tokens = 0
        chains = self._keys(state, end)
        meta.loads.append(BlockTransfer(req_id, tuple(tuple(c[start:end]) for c in chains), tuple(block_ids[start:end])))

    def _plan_save(self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput, req_id: str, num_tokens: int) -> None:
        state = self._requests.get(req_id)
        if state is None:
            return
        request = state.request
        # KV of tokens [num_computed, num_computed + num_tokens) is written
        # this step; only tokens whose ids are known can be keyed.
        done_tokens = min(request.num_computed_tokens + num_tokens, request.num_tokens)
        end = done_tokens // self._block_size
        start = state.saved_blocks
        if end <= start:
            return
        block_ids = self._block_ids(scheduler_output, req_id)
        if block_ids is None or len(block_ids) < end:
            return
        chains = self._keys(state, end)
        parents = tuple(c[start - 1] if start else None for c in chains)
        meta.saves.append(BlockTransfer(req_id, tuple(tuple(c[start:end]) for c in chains), tuple(block_ids[start:end]), parents))
        state.saved_blocks = end

    def _block_ids(self, scheduler_output: SchedulerOutput, req_id: str) -> list[int] | None:
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            groups = block_state.get_block_ids(req_id)
            return list(groups[0]) if groups else None
        if self.kv_cache_manager is not None:
            return list(self.kv_cache_manager.get_block_ids(req_id)[0])
        return None

    kv_cache_manager: Any = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. Saves were copied out during their steps,
        so vLLM may free the blocks at once."""
        self._requests.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        self._requests.clear()
        release(self._store)

    @property
    def store(self) -> ucm_db.Store:
        return self._store
