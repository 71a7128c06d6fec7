"""Scheduler side of the connector: prefix lookups and the per-step plan.

Per request it keeps one chain of block keys (the namespace does not depend
on the TP size or rank, so every rank shares it), extended incrementally as
the request grows (``Namespace.block_keys(..., parent=last_key)``) and
hashed once per request, by ucm-db, from the token ids and the request's
extras (LoRA name, ``cache_salt``, multimodal item hashes and offsets,
prompt-embedding digest), so keys are stable across restarts and vLLM
versions. Workers derive their units' keys from these block keys
(:mod:`ucm_db.units`).

Invariants:
    * ``get_num_new_matched_tokens`` changes two things, both per request:
      the memo of its block keys (a pure function of the request) and a
      :class:`LookupRecord` of this call's result, which only the
      ``update_state_after_alloc`` vLLM calls next for the request reads (a
      second lookup replaces it). It claims only whole blocks whose every
      unit (every KV head of every pipeline stage) is stored, never the
      prompt's last token, and only beyond what vLLM already computed.
    * A load plan covers blocks ``[local, local + external)`` of the request,
      exactly what vLLM allocated for the external tokens. With
      ``load_mode: "async"`` a request's first hit is claimed asynchronously
      and its plan is made at allocation (vLLM holds the request until a
      worker reports its load finished, and never schedules it with a load
      of its own later); any later claim for the same request is
      synchronous, so a load that keeps failing is recomputed, not retried.
    * A save plan covers each block whose KV becomes complete during the
      step, once per request (``saved_blocks`` only grows), and starts after
      the blocks whose units are known stored, so every unit chain's parent
      is stored or saved before it (the writer is FIFO). A save planned in a
      step that also loads blocks it depends on (its request's, or shared
      from another request through vLLM's prefix cache) names them
      (``after_loads``, also loads of earlier steps whose output is not
      back). A worker drops such a save over its own failed load; with
      several ranks it holds the save until the scheduler's verdict, given
      once every rank's output is back (metadata.py). The requests affected
      are rewound to the block vLLM recomputes from, so what they compute
      again is saved again.
    * Only units are read and written (one storage generation): a store
      holding this model's blocks of an older generation (whole or per-rank
      blocks, :mod:`ucm_db.pre_units`) is refused when the scheduler starts,
      with the ``ucm-db migrate`` command that converts it.
    * Load or recompute (cost_model.py, ``load_policy``): the remote tier is
      asked only as the cost model decides (all of the prefix, a probe of
      :data:`_PROBE_BLOCKS` blocks, or nothing), and a local hit is not
      claimed while the local tier is judged slower than recomputing. The
      model learns from real work only: the remote's rate from the timed
      lookups that promote remote blocks, the local tier's from the
      workers' load timings, the prefill rate from each step's round trip
      (metadata built -> worker output back, less its loads and the remote
      lookups meanwhile), the last two fed back through ``update_connector_output``.
    * Key chains are rooted at the namespace's epoch (epochs.py), read once
      per step before its first lookup; ``reset_cache`` moves it on. A
      waiting request whose chain is of an older epoch gets a new state; a
      running one saves nothing more. The metadata carries the epoch.
    * ``remote_lookup: "background"`` (remote_lookups.py): a priced remote
      lookup submits one background job per request instead, for the whole
      claim, and answers None (vLLM asks
      again next step) until it has finished; the remote is then not asked
      again for that request, whose hit is found in the local tier. A
      probe job is followed by one more decision for the rest of the
      prompt, now measured. A job's time is a remote sample but not part of
      any step's time.
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
from ucm_db.connector.cost_model import MIN_PREFILL_TOKENS, CostModel, Decision
from ucm_db.connector.epochs import EpochWatch
from ucm_db.connector.events import save_fields
from ucm_db.connector.identity import KVShape, grid, namespace, reader_spans
from ucm_db.connector.metadata import IDLE_WAIT_S, BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import Counters
from ucm_db.connector.remote_lookups import BACKGROUND_DEADLINE_S, RemoteLookups
from ucm_db.connector.roles import Publication, PublicationWaits, RolePolicy
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import acquire, release
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.maintenance import pre_unit_namespaces, pre_unit_refusal
from ucm_db.units import stored_prefix

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: Blocks hashed and looked up first; later segments grow 4x.
_FIRST_SEGMENT_BLOCKS = 16
#: Blocks a probe of a tier the cost model cannot judge asks for: one first
#: lookup segment. A probe's time is mostly the lookup's fixed cost (fetch
#: round trips, promotion commit); 4 blocks measured a 2 GB/s link below a
#: small model's prefill rate on a fast host, so a fast remote was never loaded.
_PROBE_BLOCKS = _FIRST_SEGMENT_BLOCKS
#: Steps awaiting their workers' output at most (older ones are dropped:
#: an output that carried no metadata never comes).
_MAX_PENDING_STEPS = 64


@dataclass
class _StepLoads:
    """A step's synchronous loads, and the saves it commits at once over
    unsettled loads (a ``kv_producer``'s), until the step's output says
    whether every load held."""

    loads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (request id, block ids)
    saves: list[tuple[BlockTransfer, int]] = field(default_factory=list)  # (save, its first block's index)


@dataclass(frozen=True)
class _HeldSave:
    """A save the workers keep until the outputs of the steps it depends on are back."""

    step: int
    transfer: BlockTransfer
    start: int  # its first block's index in the request


#: Shortest interval between two compression-ratio reports of the scheduler.
_RATIO_INTERVAL_S = 2.0

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


@dataclass(frozen=True, slots=True)
class LookupRecord:
    """The result of the last lookup of a request, for the
    ``update_state_after_alloc`` that follows it."""

    local_tokens: int   # vLLM's own prefix-cache hit the lookup was given
    hit_blocks: int     # leading blocks loadable
    unit_blocks: int    # leading blocks stored (>= hit_blocks: a hit the cost model skips is not claimed)
    seconds: float


@dataclass
class _RequestState:
    """What the scheduler side remembers about one request."""

    request: Request
    extras: dict[str, Any]        # root extras of the key chain
    block_extras: dict[int, bytes]  # per-block extras, by block index
    epoch: int | None = 0         # the namespace epoch the key chain is rooted at (epochs.py)
    keys: BlockKeys = field(default_factory=BlockKeys)  # the request's block keys, grown on demand
    stored_blocks: int = 0  # leading blocks whose units are known stored
    saved_blocks: int = 0   # leading blocks stored or planned for saving
    pending_load_tokens: int = 0
    lookup: LookupRecord | None = None
    async_tried: bool = False  # an async load was planned: later lookups claim synchronously
    async_block_ids: tuple[int, ...] = ()  # the blocks of its async load, until vLLM schedules it
    vllm_computed_tokens: int = 0  # what vLLM's own prefix cache held at the last lookup: no claim prices it
    remote_asked: bool = False    # its background remote lookup finished
    remote_probing: bool = False  # its background job is a probe
    remote_probed: bool = False   # its background probe finished


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

    def __init__(self, settings: ConnectorSettings, shape: KVShape, role: RolePolicy = RolePolicy(), group: int = 0,
                 group_namespace: Namespace | None = None) -> None:
        self._store = acquire(settings)
        self._group = group  # the KV cache group whose block ids it reads (hybrid.py: one scheduler per group)
        self._namespace = group_namespace or namespace(shape)
        self._epochs = EpochWatch(self._store, self._namespace)  # reset and invalidation (epochs.py)
        self._role = role  # prefill/decode role (roles.py)
        self._waits = PublicationWaits(settings.load_deadline_s)
        self._publish_target = settings.publish
        self._ratio_at_s = float("-inf")
        self._grid = grid(shape)
        self._spans = reader_spans(shape)
        older = pre_unit_namespaces(self._store.stats().namespaces, model=shape.model)
        if older:  # blocks of an older storage generation: converted by `ucm-db migrate`, never read here
            release(self._store)
            raise pre_unit_refusal(settings.path, older)
        self._block_size = shape.block_size
        self._requests: dict[str, _RequestState] = {}
        self.counters = Counters()
        self.cost = CostModel(settings.load_policy)  # load or recompute (cost_model.py)
        self._ns_id = self._namespace.digest[:16].hex()
        self._step = 0  # number of the next step's metadata
        # step -> (planned at, tokens scheduled, remote lookup seconds so far, mean position of those tokens)
        self._pending_steps: dict[int, tuple[float, int, float, float | None]] = {}
        self._remote_lookup_s = 0.0  # total seconds of timed remote lookups
        self._async = settings.load_mode == "async"
        self._async_plans: list[BlockTransfer] = []  # planned at allocation, for the next step's metadata
        self._step_loads: dict[int, _StepLoads] = {}  # steps with sync loads whose output has not come back
        self._voids: list[BlockTransfer] = []  # committed saves to delete, for the next step's metadata
        # With several ranks a save over a load waits for the verdict of every
        # rank (a rank sees only its own failures); one rank sees all of its own.
        self._several_ranks = shape.tp_size * shape.pp_size > 1
        self._hold_saves = self._several_ranks and not role.publishes
        self._held: dict[int, _HeldSave] = {}  # by hold id (ascending = planning order)
        self._next_hold_id = 0
        self._held_verdicts: tuple[list[int], list[int]] = ([], [])  # (commit, drop), for the next metadata
        # Failed block ids by settled step, while saves planned at or after that step may depend on them.
        self._recent_bad: dict[int, set[int]] = {}
        # remote_lookup="background": remote fetches off the scheduler's thread (remote_lookups.py)
        self._lookups = RemoteLookups() if settings.remote_lookup == "background" and self._store.config.remote is not None else None
        self._last_step_idle = False
        logger.info(
            "ucm-db connector (scheduler): store %s, namespace %s, %d unit(s) per block, model %s",
            settings.path, self._namespace.short_id, len(self._spans), shape.model,
        )

    # -- keys --------------------------------------------------------------------
    def _state(self, request: Request, *, renew_epoch: bool = True) -> _RequestState:
        """The request's state; a new one at the current epoch where there is
        none, or (``renew_epoch``: a lookup, whose KV is computed anew) where
        its key chain is of an older epoch."""
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request or (renew_epoch and state.epoch != self._epochs.epoch):
            state = _RequestState(request, request_extras(request), request_block_extras(request, self._block_size), self._epochs.epoch)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _RequestState, num_blocks: int) -> BlockKeys:
        """The request's block keys, at least ``num_blocks`` long (maybe
        longer: callers slice), hashing only blocks not hashed before."""
        have = len(state.keys)
        if have < num_blocks:
            end = num_blocks * self._block_size
            request = state.request
            prompt = request.prompt_token_ids
            # The prompt list itself when it is long enough, cut by block_keys:
            # slicing 32K ids cost 0.25 ms (a reference to every int) on a 1 ms
            # budget. Past the prompt, all_token_ids (block_keys slices it).
            tokens = prompt if isinstance(prompt, list) and len(prompt) >= end else request.all_token_ids
            start = have * self._block_size
            if have:
                more = self._namespace.block_keys(tokens, parent=state.keys[-1], start=start, stop=end, block_extras=state.block_extras)
            else:
                more = self._namespace.block_keys(tokens, state.extras, start=start, stop=end, block_extras=state.block_extras,
                                                  epoch=state.epoch or 0)
            state.keys.extend(more)
        return state.keys  # callers slice: copying 1000s of keys per call showed in profiles

    def keys_for(self, request: Request, num_blocks: int) -> list[bytes]:
        """Block keys of a request's first blocks (tests, tools)."""
        return list(self._keys(self._state(request), num_blocks)[:num_blocks])

    # -- vLLM scheduler hooks ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Loadable tokens beyond ``num_computed_tokens`` (see invariants);
        None while a producer's announced blocks are awaited (roles.py)."""
        if self._waits.too_soon(request.request_id):
            return None, False
        started = time.perf_counter()
        epoch = self._epochs.current()  # this step's epoch: an older request state is made anew
        state = self._state(request)
        max_blocks = (request.num_tokens - 1) // self._block_size
        if max_blocks * self._block_size <= num_computed_tokens or epoch is None:
            state.lookup = LookupRecord(num_computed_tokens, 0, 0, 0.0)
            return 0, False
        skips_before = sum(self.cost.skipped.values())
        state.vllm_computed_tokens = num_computed_tokens
        try:
            found = self._longest_stored_prefix(state, max_blocks)
        except _LookupPending:
            return None, False  # a background remote lookup is running: vLLM asks again next step
        hit = found
        if self._await_publication(state, max_blocks, hit):
            return None, False
        if hit and self.cost.decide(
            self._ns_id, "local", probe_unmeasured=False, tokens=max(0, hit * self._block_size - num_computed_tokens),
            first_position=num_computed_tokens,
        ) is Decision.SKIP:
            hit = 0  # the local tier is judged slower than recomputing (cost_model.py)
        if sum(self.cost.skipped.values()) > skips_before:
            self.counters.add(cost_skips=1)  # once per lookup, however many segments or sources it priced
        state.lookup = LookupRecord(num_computed_tokens, hit, found, time.perf_counter() - started)
        tokens = max(0, hit * self._block_size - num_computed_tokens)
        # Once per request: a failed async load sends the request back with
        # nothing computed, and vLLM asks again; an async claim of the same
        # blocks could fail the same way forever. A sync claim that fails is
        # recomputed.
        return tokens, self._async and tokens > 0 and not state.async_tried

    def _longest_stored_prefix(self, state: _RequestState, max_blocks: int) -> int:
        """Leading blocks with every unit stored, hashing no
        further than needed: the first segment is hashed and looked up
        alone, the rest of the prompt only if all of it is stored. A miss
        costs one small segment, not the prompt; a hit costs two lookups
        (each a binary search plus a probe per further unit: the prefix
        invariant makes a segment's count exact)."""
        found, want = 0, min(max_blocks, _FIRST_SEGMENT_BLOCKS)
        while True:
            keys = self._keys(state, want)
            found += self._priced_prefix(state, keys, found, want, max_blocks)
            if found < want or want == max_blocks:
                return found
            want = max_blocks

    def _priced_prefix(
        self, state: _RequestState, keys: Sequence[bytes], start: int, stop: int, max_blocks: int,
    ) -> int:
        """:func:`stored_prefix` from the local tier, continued from the
        remote as far as the cost model decides (all, a probe of
        :data:`_PROBE_BLOCKS` blocks, or nothing); the remote lookup (which
        promotes what it finds) is timed to measure the remote's rate. The
        claim priced is what the remote could supply of the prompt's
        ``max_blocks``: the rest of the prompt past what vLLM's own prefix
        cache and the local tier hold, in this lookup and, for a first
        segment, the next one. With background lookups the remote is
        asked once per request, for the whole claim, and
        :class:`_LookupPending` is raised until it has finished."""
        if self._lookups is not None:
            self._harvest(state)
        spans = self._spans
        local = stored_prefix(_LocalTier(self._store), self._namespace, self._grid, spans, keys, start, stop)
        if self._store.config.remote is None or start + local >= stop or state.remote_asked:
            return local
        # The claim: the rest of the prompt past what vLLM and the local tier hold.
        first_token = max((start + local) * self._block_size, state.vllm_computed_tokens)
        claim_tokens = max(0, max_blocks * self._block_size - first_token)
        # One lookup brings the claim in the background (it covers the rest of
        # the prompt) or for a last segment; a first segment's claim takes two.
        lookups = 1 if self._lookups is not None or stop >= max_blocks else 2
        decision = self.cost.decide(self._ns_id, "remote", tokens=claim_tokens, lookups=lookups, first_position=first_token)
        if decision is Decision.SKIP:
            return local
        if decision is Decision.PROBE:
            stop = min(stop, start + local + _PROBE_BLOCKS)
        if self._lookups is not None:
            if decision is Decision.PROBE:
                if state.remote_probed:  # one probe per request: then decided, or left alone
                    state.remote_asked = True
                    return local
                state.remote_probing = True
            job_stop = stop if decision is Decision.PROBE else max_blocks
            chain = self._keys(state, job_stop)[:job_stop]  # a snapshot: the scheduler grows state.keys meanwhile
            first = start + local
            store = _BackgroundStore(self._store)
            self._lookups.submit(
                state.request.request_id, lambda: stored_prefix(store, self._namespace, self._grid, spans, chain, first, job_stop),
            )
            raise _LookupPending
        started = time.perf_counter()
        found = stored_prefix(self._store, self._namespace, self._grid, spans, keys, start + local, stop)
        elapsed_s = time.perf_counter() - started
        self._remote_lookup_s += elapsed_s
        self.cost.observe_load(self._ns_id, "remote", found * self._block_size, elapsed_s)
        return local + found

    def _harvest(self, state: _RequestState) -> None:
        """Takes a finished background lookup's result into the cost model
        (its time is the request's wait, not a step's); raises
        :class:`_LookupPending` while it runs, after waiting up to
        :data:`~ucm_db.connector.metadata.IDLE_WAIT_S` for it when the last
        step had nothing to run (the engine would only spin meanwhile)."""
        assert self._lookups is not None
        job_key = state.request.request_id
        if self._lookups.pending(job_key):
            if self._last_step_idle:
                self._last_step_idle = False  # one wait per idle step, not one per waiting request
                self._lookups.wait(job_key, IDLE_WAIT_S)
            if self._lookups.pending(job_key):
                raise _LookupPending
        result = self._lookups.take(job_key)
        if result is not None:
            self.cost.observe_load(self._ns_id, "remote", result.found_blocks * self._block_size, result.elapsed_s)
            if state.remote_probing:  # a probe measured the link: the rest is decided again
                state.remote_probing = False
                state.remote_probed = True
            else:
                state.remote_asked = True

    def _number_step(self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput) -> None:
        """Numbers the step and remembers when it was planned, for the
        prefill sample its workers' output completes (:meth:`observe_output`)."""
        meta.step, self._step = self._step, self._step + 1
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        meta.idle = not tokens
        self._last_step_idle = meta.idle
        mean_position = _mean_position(scheduler_output) if tokens >= MIN_PREFILL_TOKENS else None  # no sample anyway
        self._pending_steps[meta.step] = (time.perf_counter(), tokens, self._remote_lookup_s, mean_position)
        if len(self._pending_steps) > _MAX_PENDING_STEPS:
            del self._pending_steps[min(self._pending_steps)]

    def observe_output(self, worker_meta: object, invalid_block_ids: set[int] | None = None) -> None:
        """Takes one step's output: voids the saves computed over blocks it
        reports invalid (failed loads), then feeds the cost model the local
        tier's load timings and the step's prefill sample (its round trip
        less those loads and the remote lookups made meanwhile, which are
        the connector's time, not the model's)."""
        step = worker_meta.step if isinstance(worker_meta, UcmDbWorkerMetadata) else None
        self._settle_loads(step, invalid_block_ids or set())
        if not isinstance(worker_meta, UcmDbWorkerMetadata):
            return
        now = time.perf_counter()
        load_s = 0.0
        for (ns_id, tier), (tokens, seconds) in worker_meta.loads.items():
            self.cost.observe_load(ns_id, tier, tokens, seconds)
            load_s = max(load_s, seconds)
        for (ns_id, tier), (tokens, seconds) in worker_meta.background_loads.items():
            self.cost.observe_load(ns_id, tier, tokens, seconds)  # beside the step: not part of its time
        planned = self._pending_steps.pop(worker_meta.step, None)
        for step in [s for s in self._pending_steps if s < worker_meta.step]:
            del self._pending_steps[step]  # their outputs carried no metadata
        if planned is not None:
            planned_at_s, tokens, lookup_s, mean_position = planned
            self.cost.observe_prefill(tokens, now - planned_at_s - load_s - (self._remote_lookup_s - lookup_s), mean_position)

    def _settle_loads(self, step: int | None, invalid: set[int]) -> None:
        """Settles the sync loads of steps up to ``step`` (every step's, if
        the output named none but reports invalid blocks): each request
        that loaded an invalid block is rewound to where vLLM recomputes it
        (vLLM has already moved its computed tokens back to that block); a
        save computed over one is voided (deleted if committed, dropped if
        held) and its request rewound too. Held saves planned up to
        ``step`` get their verdict, in planning order, for the next step's
        metadata: after a dropped one, a request's later ones drop too."""
        if step is None and not invalid:
            return
        if invalid:  # an async load that failed: vLLM recomputes from its first invalid block
            for req_id, state in self._requests.items():
                if invalid.intersection(state.async_block_ids):
                    state.async_block_ids = ()
                    self.rewind(req_id, None)
        settled = [(s, self._step_loads.pop(s)) for s in sorted(self._step_loads) if step is None or s <= step]
        for number, record in settled:
            bad = invalid.intersection(b for _, ids in record.loads for b in ids)
            if bad:
                self._recent_bad[number] = bad
            for req_id, block_ids in record.loads:
                if bad.intersection(block_ids):
                    self.rewind(req_id, None)
        recent_bad = set().union(*self._recent_bad.values())
        for _, record in settled:
            for transfer, start in record.saves:
                if recent_bad.intersection(transfer.after_loads):
                    self._voids.append(transfer)
                    self.rewind(transfer.req_id, start)
                    logger.warning("ucm-db: request %s: %d blocks saved over a block that failed to load are voided",
                                   transfer.req_id, len(transfer.block_ids))
        if step is not None:
            dropped: set[str] = set()
            commits, drops = self._held_verdicts
            for hold_id in sorted(self._held):
                held = self._held[hold_id]
                if held.step > step:
                    break
                del self._held[hold_id]
                req_id = held.transfer.req_id
                if req_id in dropped or recent_bad.intersection(held.transfer.after_loads):
                    dropped.add(req_id)
                    drops.append(hold_id)
                    self.rewind(req_id, held.start)
                else:
                    commits.append(hold_id)
        # A pending save depends only on loads of steps up to its own.
        oldest = min([h.step for h in self._held.values()] + list(self._step_loads), default=None)
        for settled in [s for s in self._recent_bad if oldest is None or s < oldest - _MAX_PENDING_STEPS]:
            del self._recent_bad[settled]

    def _preempted(self, req_ids: Sequence[str] | set[str]) -> tuple[str, ...]:
        """Requests vLLM preempted (their blocks freed): workers drop their
        saves not yet copied (preemptions.py), so their saved marks go back
        to the blocks known stored; a resumed request's lookup moves them on."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None:
                state.saved_blocks = state.stored_blocks
        if req_ids:
            self.counters.add(preempted_requests=len(req_ids))
            logger.info("ucm-db: %d request(s) preempted (their blocks freed); their saves restart at their stored prefix", len(req_ids))
        return tuple(sorted(req_ids))

    def rewind(self, req_id: str, save_start: int | None) -> None:
        """Moves a request's stored and saved marks back to the blocks vLLM
        still counts as computed (and before a voided save)."""
        state = self._requests.get(req_id)
        if state is None:
            return
        computed = state.request.num_computed_tokens // self._block_size
        state.stored_blocks = min(state.stored_blocks, computed)
        state.saved_blocks = min(state.saved_blocks, computed, computed if save_start is None else save_start)

    def _report_ratio(self) -> None:
        """The stored namespace's compression ratio, at most every
        :data:`_RATIO_INTERVAL_S`: a server that only loads (a kv_consumer)
        has no writer to report it."""
        now = time.monotonic()
        if now - self._ratio_at_s < _RATIO_INTERVAL_S:
            return
        self._ratio_at_s = now
        stats = self._store.stats().namespaces.get(self._namespace.digest[:16].hex())
        if stats is not None and stats.stored_bytes:
            self.counters.add(compression_ratio=stats.raw_bytes / stats.stored_bytes)

    def _await_publication(self, state: _RequestState, max_blocks: int, hit: int) -> bool:
        """True: defer the request, a producer announced blocks that are not
        visible yet and its deadline is ahead (:mod:`ucm_db.connector.roles`)."""
        request = state.request
        publication = Publication.from_params(getattr(request, "kv_transfer_params", None))
        if publication is None:
            return False
        expected = publication.expected_blocks(
            self._namespace.digest[:16].hex(), self._block_size, lambda n: self._keys(state, n), max_blocks,
        )
        if self._waits.decide(request.request_id, expected, hit):
            return True
        waited_s = self._waits.waited_s(request.request_id)
        self._waits.forget(request.request_id)
        self.counters.add(publication_wait_s=waited_s, publication_misses=max(0, expected - hit))
        if expected > hit:
            logger.warning(
                "ucm-db: request %s: %d of %d announced blocks not visible after %.2f s; the rest is recomputed",
                request.request_id, expected - hit, expected, waited_s,
            )
        return False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # Without a lookup this step (back from an async load) the request holds
        # KV of the epoch its state was made at: kept, so a reset since saves none of it.
        state = self._state(request, renew_epoch=False)
        record = state.lookup
        state.lookup = None
        if record is None:
            # No lookup before this allocation: a request back from an async
            # load (its hit is in place) or resumed with its KV. Nothing to load.
            state.pending_load_tokens = 0
            state.async_block_ids = ()
            return
        state.pending_load_tokens = num_external_tokens
        if self._async and num_external_tokens and not state.async_tried:
            # vLLM computes nothing for it until the load is reported done.
            state.async_tried = True
            end = (record.local_tokens + num_external_tokens) // self._block_size
            plan = self._load_transfer(state, request.request_id, blocks.get_block_ids()[self._group], end)
            state.async_block_ids = plan.block_ids
            self._async_plans.append(plan)
        state.stored_blocks = max(state.stored_blocks, record.unit_blocks)
        state.saved_blocks = max(state.saved_blocks, state.stored_blocks)
        query = max(0, request.num_prompt_tokens - record.local_tokens)
        self.counters.add(lookups=1, lookup_s=record.seconds, query_tokens=query, hit_tokens=num_external_tokens)
        self._report_ratio()  # every lookup, hit or not: the gauge describes the store, not this request
        if self._group == 0:  # a hybrid model's groups claim the same hit (hybrid.py): one line
            logger.info(
                "ucm-db: request %s: %d prompt tokens, %d from vLLM's prefix cache, %d hit tokens loaded from ucm-db",
                request.request_id, request.num_prompt_tokens, record.local_tokens, num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        meta = UcmDbConnectorMetadata()
        self._number_step(meta, scheduler_output)
        meta.async_loads, self._async_plans = self._async_plans, []
        for new_req in scheduler_output.scheduled_new_reqs:
            self._plan_load(meta, new_req.req_id, new_req.block_ids[self._group])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and block_ids is not None:
                self._plan_load(meta, req_id, block_ids[self._group])
        if meta.loads:
            self._step_loads[meta.step] = _StepLoads([(t.req_id, t.block_ids) for t in meta.loads])
            if len(self._step_loads) > _MAX_PENDING_STEPS:
                del self._step_loads[min(self._step_loads)]
        # This step's KV may attend to blocks loaded by this step or by an
        # earlier one whose output is not back (async scheduling plans a
        # step before the last one's output has come back).
        loaded = {b for record in self._step_loads.values() for _, ids in record.loads for b in ids}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items() if self._role.saves else ():
            self._plan_save(meta, scheduler_output, req_id, num_tokens, loaded)
        meta.void_saves, self._voids = self._voids, []
        (meta.held_commits, meta.held_drops), self._held_verdicts = self._held_verdicts, ([], [])
        meta.epoch = -1 if self._epochs.epoch is None else self._epochs.epoch
        meta.preempted = self._preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self._epochs.step_done()
        return meta

    def _plan_load(self, meta: UcmDbConnectorMetadata, req_id: str, block_ids: Sequence[int]) -> None:
        state = self._requests.get(req_id)
        if state is None or not state.pending_load_tokens:
            return
        # request.num_computed_tokens = local hit + external hit here.
        meta.loads.append(self._load_transfer(state, req_id, block_ids, state.request.num_computed_tokens // self._block_size))

    def _load_transfer(self, state: _RequestState, req_id: str, block_ids: Sequence[int], end: int) -> BlockTransfer:
        """The load of the request's pending external tokens, which end at
        block ``end``; clears the pending load."""
        start = end - state.pending_load_tokens // self._block_size
        state.pending_load_tokens = 0
        keys = self._keys(state, end)
        return BlockTransfer(req_id, tuple(keys[start:end]), tuple(block_ids[start:end]))

    def _plan_save(
        self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput, req_id: str, num_tokens: int, loaded: set[int],
    ) -> None:
        state = self._requests.get(req_id)
        if state is None or state.epoch is None or state.epoch != self._epochs.epoch:
            return  # a request running across a reset: its KV predates the new epoch
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
        keys = self._keys(state, end)
        after_loads = tuple(b for b in block_ids[:end] if b in loaded) if loaded else ()
        # A save after a held one of the same request is held too: it must commit after it, or not at all.
        hold = self._hold_saves and (bool(after_loads) or any(h.transfer.req_id == req_id for h in self._held.values()))
        hold_id = self._next_hold_id if hold else -1
        transfer = BlockTransfer(
            req_id, tuple(keys[start:end]), tuple(block_ids[start:end]), keys[start - 1] if start else None,
            after_loads=after_loads, hold_id=hold_id, event_fields=save_fields(request, start, end, self._block_size, state.epoch or 0, self._group),
        )
        meta.saves.append(transfer)
        if hold:
            self._next_hold_id += 1
            self._held[hold_id] = _HeldSave(meta.step, transfer, start)
        elif after_loads and self._several_ranks:  # a producer's: committed at once, deleted if another rank failed
            self._step_loads.setdefault(meta.step, _StepLoads()).saves.append((transfer, start))
        state.saved_blocks = end

    def _block_ids(self, scheduler_output: SchedulerOutput, req_id: str) -> list[int] | None:
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            groups = block_state.get_block_ids(req_id)
            return list(groups[self._group]) if groups else None
        if self.kv_cache_manager is not None:
            return list(self.kv_cache_manager.get_block_ids(req_id)[self._group])
        return None

    kv_cache_manager: Any = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. Saves were copied out during their steps,
        so vLLM may free the blocks at once. A ``kv_producer`` returns what
        it published as ``kv_transfer_params``: its saves were committed
        inside their steps (roles.py)."""
        state = self._requests.pop(request.request_id, None)
        self._waits.forget(request.request_id)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        if not self._role.publishes or state is None:
            return False, None
        blocks = min(state.saved_blocks, request.num_prompt_tokens // self._block_size)
        last_key = self._keys(state, blocks)[blocks - 1].hex() if blocks else ""
        self.counters.add(published_blocks=blocks)
        publication = Publication(self._namespace.digest[:16].hex(), blocks, self._block_size, last_key, self._publish_target)
        return False, publication.to_params()

    @property
    def epoch(self) -> int | None:
        """The namespace epoch this engine serves (None: unreadable), as
        last read for a step's lookups or moved on by ``reset_cache``
        (reads nothing: the once-per-step read stays before the lookups)."""
        return self._epochs.epoch

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: moves the
        namespace's epoch on in the store, for every engine of the model
        (epochs.py); False where the store refuses (read-only)."""
        return self._epochs.bump()

    def shutdown(self) -> None:
        self._requests.clear()
        if self._lookups is not None:
            self._lookups.close()
        release(self._store)

    @property
    def store(self) -> ucm_db.Store:
        return self._store

    @property
    def namespace(self) -> Namespace:
        """The namespace this scheduler's blocks are stored under (a hybrid
        model's group has its own, groups.py)."""
        return self._namespace


def _mean_position(scheduler_output: SchedulerOutput) -> float | None:
    """The mean position in its sequence of every token the step computes
    (a request computing ``n`` tokens after ``c`` computed ones adds
    positions ``c .. c + n - 1``); None where the output does not say."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    new_reqs = getattr(scheduler_output, "scheduled_new_reqs", None)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if not isinstance(scheduled, dict) or new_reqs is None or cached is None:
        return None
    computed = {getattr(req, "req_id", None): getattr(req, "num_computed_tokens", None) for req in new_reqs}
    computed.update(zip(getattr(cached, "req_ids", ()), getattr(cached, "num_computed_tokens", ())))
    tokens = position_sum = 0.0
    for req_id, n in scheduled.items():
        if not isinstance(computed.get(req_id), int):
            return None  # a request the output does not describe (another vLLM's layout): no sample
        tokens += n
        position_sum += n * (computed[req_id] + (n - 1) / 2)
    return position_sum / tokens if tokens else None


class _LookupPending(Exception):
    """A background remote lookup of the request is still running."""


class _BackgroundStore:
    """A store whose ``lookup`` waits up to
    :data:`~ucm_db.connector.remote_lookups.BACKGROUND_DEADLINE_S` on the
    remote: off the serving path, a lookup need not be cut at the store's
    ``remote_deadline_s`` (made short so an inline lookup never holds the
    engine up)."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store

    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        return self._store.lookup(namespace, keys, remote_deadline_s=BACKGROUND_DEADLINE_S)


class _LocalTier:
    """A store whose ``lookup`` looks at the local tier only."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store

    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        return self._store.lookup(namespace, keys, remote=False)

