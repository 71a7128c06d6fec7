"""The scheduler's plan of each step: its loads and saves, and the timings
the cost model learns from.

Invariants:
    * A load plan covers blocks ``[local, local + external)`` of the request,
      exactly what vLLM allocated for the external tokens, and touches
      their units for eviction as it is made (:meth:`PrefixLookup.touch`):
      the workers read them with ``touch=False``, so their processes, whose
      spare moments are the model's, write no recency. With
      ``load_mode: "async"`` a request's first hit is claimed asynchronously
      and its plan is made at allocation (:meth:`StepPlanner.plan_async_load`:
      vLLM holds the request until a worker reports its load finished, and
      never schedules it with a load of its own later).
    * A save plan covers each block whose KV becomes complete during the
      step, once per request (``saved_blocks`` only grows), and starts after
      the blocks whose units are known stored, so every unit chain's parent
      is stored or saved before it (the writer is FIFO). A save planned in a
      step that also loads blocks it depends on (its request's, or shared
      from another request through vLLM's prefix cache) names them
      (``after_loads``, also loads of earlier steps whose output is not
      back) and is settled by :mod:`ucm_db.connector.scheduler.settlement`,
      which also keeps the block tables of the requests a step computes over
      such loads, whatever their role (their blocks go stale if one failed).
    * A request that would compute over stale KV this step (a failed load's
      block it shares, still stale: stale_blocks.py) saves nothing in it, and
      the step's ``stale_reads`` name the stale blocks it reads, for the
      workers to report so vLLM rewinds it.
    * A request whose key chain is of an older epoch than the namespace's
      (a reset since its lookup) saves nothing more; nor does one whose
      controls say ``save: false``. Admission
      (:class:`~ucm_db.connector.admission.Admission`: ``save_decode``,
      ``admit_after``) only cuts a request's saves short, to a prefix of
      its chain, so the parent invariant above holds.
    * The cost model learns from real work only: the local tier's load
      rate from the workers' load timings, the prefill rate from each
      step's round trip (metadata built -> worker output back, less its
      loads and the remote lookups meanwhile), both fed back through
      :meth:`StepPlanner.observe_output` (``update_connector_output``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ucm_db.connector.composition import refuse_saves_over_foreign_load, sibling_loads
from ucm_db.connector.scheduler.cost_model import MIN_PREFILL_TOKENS, CostModel
from ucm_db.connector.events import save_fields
from ucm_db.connector.scheduler.lookups import PrefixLookup
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.admission import Admission
from ucm_db.connector.request_controls import SAVE_ALWAYS
from ucm_db.connector.scheduler.request_state import RequestState, adapter_claim
from ucm_db.connector.scheduler.settlement import MAX_PENDING_STEPS, SaveSettlement
from ucm_db.connector.scheduler.stale_blocks import CLEAN_STEP, Scheduled, StaleBlocks, StepVerdict

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class StepPlanner:
    """Loads and saves of each step, and the cost model's samples of them."""

    def __init__(
        self, requests: dict[str, RequestState], keys: Callable[[RequestState, int], Sequence[bytes]], block_size: int,
        group: int, cost: CostModel, lookup: PrefixLookup, settlement: SaveSettlement, current_epoch: Callable[[], int | None],
        admission: Admission | None = None,
    ) -> None:
        self._requests = requests  # the facade's, shared
        self._keys = keys
        self._block_size = block_size
        self._group = group  # the KV cache group whose block ids it reads (hybrid.py)
        self._cost = cost
        self._lookup = lookup
        self._settlement = settlement
        self._current_epoch = current_epoch
        self._admission = admission or Admission()  # save_decode, admit_after (admission.py)
        self._step = 0  # number of the next step's metadata
        # step -> (planned at, tokens scheduled, remote lookup seconds so far, mean position of those tokens)
        self._pending_steps: dict[int, tuple[float, int, float, float | None]] = {}
        self._async_plans: list[BlockTransfer] = []  # planned at allocation, for the next step's metadata
        #: vLLM's KV cache manager, where the scheduler output carries no block state (set by the connector).
        self.kv_cache_manager: Any = None
        #: Blocks whose KV went stale (a failed load's, shared), until written again: stale_blocks.py.
        self.stale = StaleBlocks(block_size)

    def plan_step(self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput, saves: bool) -> None:
        """Numbers the step and fills ``meta``'s loads, async loads, saves
        (where ``saves``: the role saves), voids and held saves' verdicts."""
        self.number_step(meta, scheduler_output)
        meta.async_loads, self._async_plans = self._async_plans, []
        for new_req in scheduler_output.scheduled_new_reqs:
            self._plan_load(meta, new_req.req_id, new_req.block_ids[self._group])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and block_ids is not None:
                self._plan_load(meta, req_id, block_ids[self._group])
        # Blocks another connector loaded (MultiConnector): saves over them are held like over our own (composition.py).
        others = sibling_loads(scheduler_output, self._requests, self._block_size, {t.req_id for t in meta.loads})
        for req_id, _ in () if self._admission.store_foreign_loads else others:
            refuse_saves_over_foreign_load(req_id, self._requests.get(req_id))  # not another ucm-db's: saved by none
        loaded = self._settlement.record_loads(meta, others)
        if loaded:  # what this step computes over them goes stale if one failed (settlement.forget_failed_blocks)
            tables = [self._block_ids(scheduler_output, req_id) or [] for req_id in scheduler_output.num_scheduled_tokens]
            self._settlement.record_tables(meta.step, [table for table in tables if loaded.intersection(table)])
        tainted = self._stale_reads(meta, scheduler_output, others).tainted
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items() if saves else ():
            if req_id not in tainted:  # one computing over stale KV: its blocks are wrong (stale_blocks.py)
                self._plan_save(meta, scheduler_output, req_id, num_tokens, loaded)
        self._settlement.take_verdicts(meta)

    def _stale_reads(self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput,
                     others: Sequence[tuple[str, tuple[int, ...]]]) -> StepVerdict:
        """The step's verdict over stale KV (stale_blocks.py); puts the
        blocks its tainted requests read in ``meta.stale_reads``. Nothing is
        computed while no block is stale."""
        if self.stale.empty:
            return CLEAN_STEP
        if any(step != meta.step and planned[1] for step, planned in self._pending_steps.items()):
            self.stale.clear()  # a step computes whose output is not back (a batch queue): vLLM's handling alone
            return CLEAN_STEP
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        if pool is not None:  # a freed block, unhashed, is written by its next holder before anyone reads it
            freed = self.stale.forget_freed(lambda block_id: pool.blocks[block_id].ref_cnt == 0)
            if freed:
                self.kv_cache_manager.evict_blocks(freed)
        scheduled = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state, table = self._requests.get(req_id), self._block_ids(scheduler_output, req_id)
            if state is not None and table is not None:
                computed = state.request.num_computed_tokens  # before the step: vLLM advances it after planning
                scheduled.append(Scheduled(req_id, table, computed, min(computed + num_tokens, state.request.num_tokens)))
        # Every write of the step's loads, async ones included: a block an async load fills is not stale (a failed
        # load's blocks go stale again when its failure is reported); vLLM may hand a block freed stale to another
        # request's async load in the very schedule() that freed it, before forget_freed sees it free.
        loaded = [b for transfers in (meta.loads, meta.async_loads) for transfer in transfers for b in transfer.block_ids]
        loaded += [b for _, ids in others for b in ids]
        verdict = self.stale.plan(meta.step, scheduled, loaded)
        meta.stale_reads = verdict.stale_reads
        return verdict

    def plan_async_load(self, state: RequestState, req_id: str, block_ids: Sequence[int], end: int) -> tuple[int, ...]:
        """Plans the request's async load (for the next step's metadata);
        returns its block ids. Its first step names no sibling loads (composition.py)."""
        state.async_claimed = True
        plan = self.load_transfer(state, req_id, block_ids, end)
        self._async_plans.append(plan)
        return plan.block_ids

    def _plan_load(self, meta: UcmDbConnectorMetadata, req_id: str, block_ids: Sequence[int]) -> None:
        state = self._requests.get(req_id)
        if state is None or not state.pending_load_tokens:
            return
        # request.num_computed_tokens = local hit + external hit here.
        meta.loads.append(self.load_transfer(state, req_id, block_ids, state.request.num_computed_tokens // self._block_size))

    def load_transfer(self, state: RequestState, req_id: str, block_ids: Sequence[int], end: int) -> BlockTransfer:
        """The load of the request's pending external tokens, which end at
        block ``end``; clears the pending load."""
        start = end - state.pending_load_tokens // self._block_size
        state.pending_load_tokens = 0
        keys = tuple(self._keys(state, end)[start:end])
        self._lookup.touch(keys)
        return BlockTransfer(req_id, keys, tuple(block_ids[start:end]), touched=True)

    def _plan_save(
        self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput, req_id: str, num_tokens: int, loaded: set[int],
    ) -> None:
        state = self._requests.get(req_id)
        epoch = self._current_epoch()
        if state is None or state.epoch is None or state.epoch != epoch:
            return  # a request running across a reset: its KV predates the new epoch
        request = state.request
        # KV of tokens [num_computed, num_computed + num_tokens) is written
        # this step; only tokens whose ids are known can be keyed.
        done_tokens = min(request.num_computed_tokens + num_tokens, request.num_tokens)
        end = self._admission.savable_end(done_tokens // self._block_size, request.num_prompt_tokens // self._block_size)
        if not state.controls.save:  # the request's own `save: false` (request_controls.py)
            if self._admission.sketch is not None and end > state.sighted_blocks:
                # Still a sighting of each block it computes (admit_after counts requests computing a block); what
                # admission answers is dropped: nothing of this request is stored.
                self._admission.admit(state, self._keys(state, end), end, request.all_token_ids, saving=False)
            return
        start = state.saved_blocks
        admitting = state.controls.save != SAVE_ALWAYS  # `save: "always"` stores whatever admission says
        if end <= start or (admitting and self._admission.decided(state, start, end)):
            return  # nothing new, or admission refused at this end already (no block completed since)
        block_ids = self._block_ids(scheduler_output, req_id)
        if block_ids is None or len(block_ids) < end:
            return
        keys = self._keys(state, end)
        if admitting:
            end = self._admission.admit(state, keys, end, request.all_token_ids)  # admit_after: the prefix seen enough
        if end <= start:
            return
        after_loads, sibling = self._settlement.after_loads(req_id, block_ids[:end], loaded)
        hold_id = self._settlement.hold_id(req_id, after_loads, sibling)
        transfer = BlockTransfer(
            req_id, tuple(keys[start:end]), tuple(block_ids[start:end]), keys[start - 1] if start else None,
            after_loads=after_loads, hold_id=hold_id, voidable=self._settlement.voidable(hold_id, after_loads, sibling),
            event_fields=save_fields(request, start, end, self._block_size, state.epoch or 0, self._group),
            adapter=adapter_claim(state),
        )
        meta.saves.append(transfer)
        self._settlement.track(meta.step, transfer, start, sibling)
        state.saved_blocks = end
        state.committed_blocks = max(state.committed_blocks, end)  # a producer's, committed within the step

    def block_table(self, req_id: str) -> list[int] | None:
        """The request's block table now (vLLM's KV cache manager; None without one)."""
        if self.kv_cache_manager is None:
            return None
        return list(self.kv_cache_manager.get_block_ids(req_id)[self._group])

    def _block_ids(self, scheduler_output: SchedulerOutput, req_id: str) -> list[int] | None:
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            groups = block_state.get_block_ids(req_id)
            return list(groups[self._group]) if groups else None
        return self.block_table(req_id)

    def number_step(self, meta: UcmDbConnectorMetadata, scheduler_output: SchedulerOutput) -> None:
        """Numbers the step and remembers when it was planned, for the
        prefill sample its workers' output completes (:meth:`observe_output`)."""
        meta.step, self._step = self._step, self._step + 1
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        meta.idle = not tokens
        self._lookup.last_step_idle = meta.idle
        mean_position = mean_position_of(scheduler_output) if tokens >= MIN_PREFILL_TOKENS else None  # no sample anyway
        self._pending_steps[meta.step] = (time.perf_counter(), tokens, self._lookup.remote_lookup_s, mean_position)
        if len(self._pending_steps) > MAX_PENDING_STEPS:
            del self._pending_steps[min(self._pending_steps)]

    def observe_output(self, worker_meta: UcmDbWorkerMetadata) -> None:
        """Feeds the cost model one step's output: the local tier's load
        timings and the step's prefill sample (its round trip less those
        loads and the remote lookups made meanwhile, which are the
        connector's time, not the model's)."""
        now = time.perf_counter()
        load_s = 0.0
        for (ns_id, tier), (tokens, seconds) in worker_meta.loads.items():
            self._cost.observe_load(ns_id, tier, tokens, seconds)
            load_s = max(load_s, seconds)
        for (ns_id, tier), (tokens, seconds) in worker_meta.background_loads.items():
            self._cost.observe_load(ns_id, tier, tokens, seconds)  # beside the step: not part of its time
        planned = self._pending_steps.pop(worker_meta.step, None)
        for step in [s for s in self._pending_steps if s < worker_meta.step]:
            del self._pending_steps[step]  # their outputs carried no metadata
        if planned is not None:
            planned_at_s, tokens, lookup_s, mean_position = planned
            remote_s = self._lookup.remote_lookup_s - lookup_s
            self._cost.observe_prefill(tokens, now - planned_at_s - load_s - remote_s, mean_position)


def mean_position_of(scheduler_output: SchedulerOutput) -> float | None:
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
