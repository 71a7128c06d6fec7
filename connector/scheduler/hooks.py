"""Scheduler side of the connector: vLLM's scheduler hooks, delegating.

:class:`UcmDbScheduler` holds the hooks vLLM calls on the scheduler-side
connector and what they share (the store, the namespace, the requests'
states); the work is done by:

* :mod:`ucm_db.connector.identity` -- each request's key chain (hashed once,
  grown incrementally) and the extras hashed into it;
* :mod:`ucm_db.connector.scheduler.lookups` -- the priced prefix lookups (local tier,
  then the remote as the cost model decides, inline or in the background);
* :mod:`ucm_db.connector.scheduler.planner` -- each step's loads and saves, and the
  cost model's samples of them;
* :mod:`ucm_db.connector.scheduler.settlement` -- saves planned over loads whose
  outcome is not known yet, and their verdicts;
* :mod:`ucm_db.connector.request_controls` -- a request's own controls
  (``save``, ``load``, ``max_load_tokens`` in its ``kv_transfer_params``,
  vLLM's ``skip_reading_prefix_cache``; served as
  :mod:`ucm_db.connector.scheduler.served_controls` says) and the
  admission of computed blocks (``save_decode``, ``admit_after``);
* :mod:`~ucm_db.connector.roles`, :mod:`~ucm_db.connector.scheduler.publications` -- a
  producer's announcements, a consumer's waits; :mod:`~ucm_db.connector.epochs` -- resets.

Invariants:
    * ``get_num_new_matched_tokens`` claims only whole blocks whose every
      unit (every KV head of every pipeline stage) is stored, never the
      prompt's last token, and only beyond what vLLM already computed; with
      a stored EAGLE-style draft, not the last block found (drafts.py); never
      a block of a save this engine voided before its void surely ran
      (settlement.py's fences: nor is such a block counted stored). It
      changes, for the request: its state (made anew where there is none or
      its key chain is of an older epoch), its key chain (grown as far as
      the lookup hashed), the :class:`~ucm_db.connector.scheduler.request_state.LookupRecord`
      only the next ``update_state_after_alloc`` for it reads (a second
      lookup replaces it), what vLLM had computed, its background-lookup
      and publication-wait state; and beyond the request: the namespace's
      epoch as read for the step, the cost model (remote samples from the
      timed lookups, its decisions' skip counts), the store (an inline
      remote lookup promotes the blocks it finds into the local tier; every
      lookup counts its hits and misses), the background lookup jobs
      (submitted, or taken once finished), the remote lookup seconds and
      the counters (``cost_skips``, publication waits). Where vLLM's own
      cache holds every loadable block, it claims nothing and asks the
      local tier alone which of them are stored, so those are not saved
      again. A request whose controls turn loading off (``load: false``,
      or vLLM's ``skip_reading_prefix_cache``) is answered 0 before any
      lookup, local or remote, and before any publication wait; one with
      ``max_load_tokens`` is looked up no further than that many tokens
      past vLLM's own hit (whole blocks), and below one block counts no
      lookup. Malformed controls fail closed (request_controls.py).
    * ``update_state_after_alloc`` turns that record into the request's
      pending load (or, ``load_mode: "async"``, a request's first hit, an
      async load planned at once: vLLM holds the request until a worker
      reports it finished; any later claim for the same request is
      synchronous, so a load that keeps failing is recomputed, not retried;
      a hybrid model's groups are always async and claim nothing after a
      failure instead, hybrid.py). Under vLLM's async scheduling every
      claim is async, whatever ``load_mode`` says (a sync load failing with
      the next step in flight leaves vLLM's tokens and the KV apart), and
      after a failed async load a request claims no further than the block
      that failed (request_state.py).
    * Only units are read and written (one storage generation): a store
      holding this model's blocks of an older generation (whole or per-rank
      blocks, :mod:`ucm_db.maintenance.pre_units`) is refused when the scheduler starts,
      with the ``ucm-db migrate`` command that converts it.
    * Key chains are rooted at the namespace's epoch (epochs.py), read once
      per step before its first lookup; ``reset_cache`` moves it on. A
      waiting request whose chain is of an older epoch gets a new state; a
      running one saves nothing more. The metadata carries the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

import ucm_db
from ucm_db.connector.scheduler.cost_model import CostModel, Decision
from ucm_db.connector.composition import note_ucm_db_load
from ucm_db.connector.epochs import EpochWatch
from ucm_db.connector.identity import KVShape, grid, namespace, reader_spans
from ucm_db.connector.request_keys import chain_keys, request_block_extras, request_extras
from ucm_db.connector.scheduler.lookups import LookupPending, PrefixLookup
from ucm_db.connector.metadata import UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import Counters, StoreGauges
from ucm_db.connector.scheduler.planner import StepPlanner
from ucm_db.connector.admission import Admission
from ucm_db.connector.scheduler.request_state import hit_sources, LookupRecord, RequestState
from ucm_db.connector.scheduler.served_controls import log_not_looked_up, refuse_saves_over_stale_caches, served_controls
from ucm_db.connector.roles import PublicationWaits, RolePolicy, store_fingerprints
from ucm_db.connector.scheduler.publications import Publications
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.scheduler.settlement import SaveSettlement, forget_failed_blocks
from ucm_db.connector.scheduler.stale_blocks import recompute_stale_reads
from ucm_db.connector.stores import acquire, refuse_older_generations, release
from ucm_db.errors import UcmDbError
from ucm_db.keys import BlockKeys, Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: Shortest interval between two compression-ratio reports of the scheduler.

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class UcmDbScheduler:
    """Scheduler-side half of :class:`~ucm_db.connector.UcmDbConnector`."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape, role: RolePolicy = RolePolicy(), group: int = 0,
                 group_namespace: Namespace | None = None, *, generations_checked: bool = False, steps_overlap: bool = False) -> None:
        """``generations_checked``: the caller (the connector's facade) has
        refused a store of an older storage generation already;
        ``steps_overlap``: vLLM plans steps ahead of outputs (every claim async)."""
        # First: a kv_producer's admit_after above 1 is refused before the store is opened (admission.Admission).
        self._admission = Admission(settings.save_decode, settings.admit_after, publishes=role.publishes, store_foreign_loads=settings.store_foreign_loads)
        self._store = acquire(settings)
        try:  # blocks of an older storage generation: converted by `ucm-db migrate`, never read here
            if not generations_checked:
                refuse_older_generations(self._store, settings, shape)
        except UcmDbError:
            release(self._store)
            raise
        self._group = group  # the KV cache group whose block ids it reads (hybrid.py: one scheduler per group)
        self._namespace = group_namespace or namespace(shape)
        self._epochs = EpochWatch(self._store, self._namespace)  # reset and invalidation (epochs.py)
        self._role = role  # prefill/decode role (roles.py)
        self._waits = PublicationWaits(settings.load_deadline_s)
        self._publish_target = settings.publish
        self._grid = grid(shape)
        self._block_size = shape.block_size
        self._hit_margin = int(shape.drops_last_block)  # blocks a hit gives back (drafts.py)
        self._counter_mm_ids, self._inputs = shape.counter_mm_ids, shape.extra  # the step metadata's inputs
        self._lora_engine = shape.lora_engine
        self._off = False  # a worker refused this namespace: nothing claimed or saved (observe_output)
        self._requests: dict[str, RequestState] = {}
        self.counters = Counters()
        self.cost = CostModel(settings.load_policy)  # load or recompute (cost_model.py)
        self._ns_id = self._namespace.id.hex()
        self._store_gauges = StoreGauges(self.counters, self._ns_id)
        self._async, self._async_always = settings.load_mode == "async", steps_overlap  # RequestState.claims_async
        self._spans = reader_spans(shape)  # every unit a hit needs (identity.py)
        self._lookup = PrefixLookup(self._store, self._namespace, self._grid, self._spans, self._block_size, self.cost,
                                    self._keys, background=settings.remote_lookup == "background")
        self._lookups = self._lookup.lookups  # remote_lookup="background"'s jobs (remote_lookups.py), or None
        several_ranks = shape.tp_size * shape.pp_size > 1
        self._settlement = SaveSettlement(several_ranks, publishes=role.publishes)
        self._planner = StepPlanner(self._requests, self._keys, self._block_size, group, self.cost, self._lookup,
                                    self._settlement, lambda: self._epochs.epoch, self._admission)
        self._publications = Publications(self._ns_id, self._block_size, self._hit_margin, self._keys, self._lookup, self._settlement,
                                          self.counters, self._waits, self._publish_target,
                                          store_fingerprints(self._store.path, self._store.config.remote))
        logger.info(
            "ucm-db connector (scheduler): store %s, namespace %s, %d unit(s) per block, model %s",
            settings.path, self._namespace.short_id, len(self._spans), shape.model,
        )

    # -- request state and keys ----------------------------------------------------
    def _state(self, request: Request, *, renew_epoch: bool = True) -> RequestState:
        """The request's state; a new one at the current epoch where there is none, or (``renew_epoch``: a lookup, whose KV is
        computed anew) where its key chain is of an older epoch. One made anew for the same request keeps a ``save: false``
        (within_session) where it is a session's next chunk (``stale_for``), and without a lookup its epoch (no saves after a reset)."""
        state = self._requests.get(request.request_id)
        if (state is None or state.request is not request or state.stale_for(request)
                or (renew_epoch and state.epoch != self._epochs.epoch)):
            same = state if state is not None and state.request is request else None
            extras = request_extras(request, self._lora_engine)
            state = RequestState(request, extras, request_block_extras(request, self._block_size, self._counter_mm_ids),
                                 same.epoch if same is not None and not renew_epoch else self._epochs.epoch,
                                 controls=served_controls(request, extras).within_session(same.controls if same is not None and same.stale_for(request) else None),
                                 prompt_tokens=request.num_prompt_tokens, mm_items=len(request.mm_features or ()))
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: RequestState, num_blocks: int) -> BlockKeys:
        """The request's block keys, at least ``num_blocks`` long (request_keys.chain_keys)."""
        return chain_keys(self._namespace, self._block_size, state, num_blocks)

    def keys_for(self, request: Request, num_blocks: int) -> list[bytes]:
        """Block keys of a request's first blocks (tests, tools)."""
        return list(self._keys(self._state(request), num_blocks)[:num_blocks])

    @property
    def kv_cache_manager(self) -> Any:
        """vLLM's KV cache manager, for block ids a scheduler output does not carry."""
        return self._planner.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, manager: Any) -> None:
        self._planner.kv_cache_manager = manager

    # -- vLLM scheduler hooks ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Loadable tokens beyond ``num_computed_tokens`` (see invariants);
        None while a producer's announced blocks are awaited (roles.py) or
        a background remote lookup runs (vLLM asks again next step)."""
        if self._off or self._waits.too_soon(request.request_id):
            return (0 if self._off else None), False
        started = time.perf_counter()
        epoch = self._epochs.current()  # this step's epoch: an older request state is made anew
        state = self._state(request)
        state.start_lookup(num_computed_tokens)  # what a sibling connector loads is told apart per lookup
        refuse_saves_over_stale_caches(state, num_computed_tokens)  # an adapter reloaded with other files
        if not state.controls.load:  # `load: false` (or vLLM's skip_reading_prefix_cache): no lookup, fetch nor wait
            return self._loads_nothing(state, num_computed_tokens, num_computed_tokens // self._block_size, epoch, False)
        max_blocks = (request.num_tokens - 1) // self._block_size
        claimable = state.claimable_blocks(self._block_size, max_blocks, num_computed_tokens)
        if claimable * self._block_size <= num_computed_tokens or epoch is None:  # capped below a block: no lookup
            return self._loads_nothing(state, num_computed_tokens, claimable, epoch,
                                       not state.controls.loads_nothing(self._block_size))
        skips_before = sum(self.cost.skipped.values())
        state.vllm_computed_tokens = num_computed_tokens
        try:  # a hit that gives its last block back looks one block past a max_load_tokens cap
            found = self._unfenced(state, self._lookup.longest_stored_prefix(state, min(max_blocks, claimable + self._hit_margin)))
        except LookupPending:
            return None, False
        skipped = sum(self.cost.skipped.values()) > skips_before  # a tier judged slower than recomputing was left out
        if self._publications.await_publication(state, max_blocks, found, claimable, skipped):
            return None, False
        hit = min(claimable, max(0, found - self._hit_margin))
        if hit and self.cost.decide(self._ns_id, "local", probe_unmeasured=False, first_position=num_computed_tokens,
                                    tokens=max(0, hit * self._block_size - num_computed_tokens)) is Decision.SKIP:
            hit = 0  # the local tier is judged slower than recomputing (cost_model.py)
        if sum(self.cost.skipped.values()) > skips_before:
            self.counters.add(cost_skips=1)  # once per lookup, however many segments it priced
        state.lookup = LookupRecord(num_computed_tokens, hit, found, time.perf_counter() - started)
        tokens = max(0, hit * self._block_size - num_computed_tokens)
        return tokens, tokens > 0 and state.claims_async(self._async, self._async_always)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The last claim's tokens by tier (:func:`.request_state.hit_sources`)."""
        return hit_sources(self._requests.get(request.request_id), num_external_tokens, self._block_size)

    def _loads_nothing(self, state: RequestState, num_computed_tokens: int, held: int, epoch: int | None,
                       looked_up: bool) -> tuple[int, bool]:
        """A lookup that loads nothing; the local tier still says which of the ``held``
        blocks vLLM's own cache holds are stored (saved once, never copied out again)."""
        stored = 0 if epoch is None or not held else self._unfenced(state, self._lookup.locally_stored_prefix(state, held))
        state.lookup = LookupRecord(num_computed_tokens, 0, stored, 0.0, looked_up=looked_up)
        return 0, False

    def _unfenced(self, state: RequestState, found: int) -> int:
        """``found`` stored blocks cut before one a voided save of this engine may still hold (settlement.py's fences)."""
        if not found or not self._settlement.fenced:  # every lookup asks; fences are rare
            return found
        return self._settlement.unfenced(self._keys(state, found), found)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Takes the lookup's record into the request's pending load (an
        async load is planned at once), stored and saved marks, and the
        lookup counters."""
        # No lookup this step (back from an async load): the KV is of its state's epoch, kept (a reset since saves none).
        state = self._state(request, renew_epoch=False)
        record = state.lookup
        state.lookup, state.claimed = None, record  # vLLM asks the claim's hit sources after this (request_state.py)
        if record is None:
            # No lookup before this allocation: a request back from an async
            # load (its hit is in place) or resumed with its KV. Nothing to load.
            state.pending_load_tokens = 0
            state.async_block_ids = ()
            return
        state.pending_load_tokens = num_external_tokens
        if num_external_tokens:
            note_ucm_db_load(request.request_id)  # another ucm-db child keeps saving it (composition.py)
        if num_external_tokens and state.claims_async(self._async, self._async_always):
            # vLLM computes nothing for it until the load is reported done.
            state.async_tried = True
            end = (record.local_tokens + num_external_tokens) // self._block_size
            state.async_block_ids = self._planner.plan_async_load(state, request.request_id, blocks.get_block_ids()[self._group], end)
        state.stored_blocks = max(state.stored_blocks, record.unit_blocks)
        state.saved_blocks = max(state.saved_blocks, state.stored_blocks)
        if not record.looked_up:  # nothing to load by the request's controls: nothing counted as a lookup
            if self._group == 0:
                log_not_looked_up(state)
            return
        query = max(0, request.num_prompt_tokens - record.local_tokens)
        self.counters.add(lookups=1, lookup_s=record.seconds, query_tokens=query, hit_tokens=num_external_tokens,
                          admit_after=self._admission.admit_after)
        self.counters.observe("lookup", record.seconds)
        self._store_gauges.report(self._store)  # every lookup, hit or not: the gauges describe the store
        if self._group == 0:  # a hybrid model's groups claim the same hit (hybrid.py): one line
            logger.info(
                "ucm-db: request %s: %d prompt tokens, %d from vLLM's prefix cache, %d hit tokens loaded from ucm-db",
                request.request_id, request.num_prompt_tokens, record.local_tokens, num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        """The step's metadata: its loads and saves (planner.py), the saves'
        verdicts (settlement.py), the epoch and the preempted requests."""
        epoch = self._epochs.current()  # once a step, lookups or not: a reset reaches decode-only engines (epochs.py)
        meta = UcmDbConnectorMetadata(namespace=self._namespace.id, namespace_inputs=self._inputs)
        self._planner.plan_step(meta, scheduler_output, saves=self._role.saves and not self._off)
        meta.epoch = -1 if epoch is None else epoch
        meta.preempted = self._preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self._epochs.step_done()
        return meta

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

    def observe_output(self, worker_meta: object, invalid_block_ids: set[int] | None = None) -> None:
        """Takes one step's output (``update_connector_output``): settles
        its loads and the saves over them (settlement.py), then feeds the
        cost model its load timings and prefill sample (planner.py)."""
        step = worker_meta.step if isinstance(worker_meta, UcmDbWorkerMetadata) else None
        verdict = self._planner.stale.output_back(step)  # stale KV the step read: its own reports (stale_blocks.py)
        invalid = invalid_block_ids or set()
        if verdict.stale_reads:
            invalid = invalid.difference(verdict.stale_reads)  # the failed loads
        if invalid:  # an async load that failed: vLLM recomputes from its first invalid block
            for req_id, state in self._requests.items():
                if invalid.intersection(state.async_block_ids):
                    state.async_block_ids = ()
                    self.rewind(req_id, None)
                    if self._async_always:  # its later claims are async too: none reaches the failed block again
                        state.claim_limit = state.request.num_computed_tokens // self._block_size
        # Before settling: the tables recorded for the steps it settles (settlement.py).
        stale = forget_failed_blocks(self.kv_cache_manager, self._settlement.tables(), self._requests, self._group, invalid)
        self._planner.stale.went_stale(stale)
        if verdict.tainted:  # vLLM rewound them, or dropped the step's tokens: saves restart there
            forget_failed_blocks(self.kv_cache_manager, verdict.tables, self._requests, self._group, set(verdict.stale_reads))
            for req_id in verdict.tainted:  # each recomputes from the first stale block it holds
                if (state := self._requests.get(req_id)) is not None:
                    recompute_stale_reads(state.request, self._planner.block_table(req_id), verdict.stale_reads, self._block_size)
                self.rewind(req_id, None)
        self._settlement.settle(step, invalid, self.rewind)  # a voided committed save: its workers count it (voids.py)
        if isinstance(worker_meta, UcmDbWorkerMetadata):
            self._planner.observe_output(worker_meta)
            if worker_meta.refused and not self._off:
                self._off = True  # the workers neither load nor save (worker/hooks.py): claim and save nothing
                logger.error("ucm-db: a worker refused namespace %s (its log says why): ucm-db is off for this "
                             "engine until a restart", self._namespace.short_id)

    def saves_dropped(self, step: int) -> None:
        """Step ``step``'s metadata lost every save after planning (hybrid/hooks.py): SaveSettlement.saves_dropped."""
        self._settlement.saves_dropped(step)

    def rewind(self, req_id: str, save_start: int | None) -> None:
        """Moves a request's stored and saved marks back to the blocks vLLM
        still counts as computed (and before a voided save)."""
        state = self._requests.get(req_id)
        if state is not None:
            state.rewind(self._block_size, save_start)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request. Saves were copied out during their steps,
        so vLLM may free the blocks at once. A ``kv_producer`` returns what
        it published as ``kv_transfer_params``: what its saves committed
        inside their steps (roles.py), whatever a preemption did to its
        save marks since (request_state.py), and its store holds
        (publications.py); None where a sibling ucm-db child published it."""
        state = self._requests.pop(request.request_id, None)
        self._waits.forget(request.request_id)
        self._lookup.forget(request.request_id)
        if not self._role.publishes or state is None or self._off:  # off: a worker refused, nothing was saved
            return False, None
        return False, self._publications.publish(self, state, self._group)  # what its store holds (publications.py)

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
        self._lookup.close()
        release(self._store)

    @property
    def store(self) -> ucm_db.Store:
        return self._store

    @property
    def namespace(self) -> Namespace:
        """The namespace this scheduler's blocks are stored under (a hybrid
        model's group has its own, groups.py)."""
        return self._namespace
