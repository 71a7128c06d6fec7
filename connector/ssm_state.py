"""State-space groups of a hybrid model (Mamba, linear attention): their
recurrent state, stored at block boundaries.

vLLM keeps an SSM layer's state, not per-token KV. With prefix caching on it
runs the group in ``mamba_cache_mode="align"`` (vllm/model_executor/models/
config.py, ``MambaModelConfig``): the group's block ``p`` of a request holds
the state after exactly ``(p + 1) * block_size`` tokens, only a few such
blocks stay resident (the others are vLLM's null block), and the scheduler
hands each state it keeps at a block boundary to the connector as
``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``
(``{request: [(group, block id, boundary tokens)]}``), in the step whose
forward pass computes it.

Invariants:
    * The state after ``k`` blocks of a request is stored under the group's
      chain key of block ``k - 1`` (the group's namespace names its layers and
      state spec, groups.py) as a chain of one block (no parent): states are
      sparse (vLLM keeps only some boundaries), so no chain runs through
      them, and a state is loadable alone.
    * Saved: exactly the boundary states vLLM offers for this group, at
      whole blocks of known tokens, in the step that offers them (the
      worker copies them out in that step's ``wait_for_save``, after the
      forward pass wrote them); a boundary already stored or loaded for the
      request is not saved again.
    * A hit ends at a block boundary where every state group holds a state
      and every attention group holds the prefix (:func:`ssm_claim`): the
      longest such boundary at or below the attention groups' claim, looked
      for in the local tier at most :data:`MAX_PROBES` boundaries back,
      then (none found) in the remote tier at the claim's end only, one
      probe per group, and never where remote lookups run in the
      background (``remote_lookup: "background"``: the scheduler's thread
      does not wait on the remote).
    * A load of the state at boundary ``k`` writes it into the group's
      block ``k - 1`` (the block vLLM's cache then holds as that state) and
      into the block the request runs in this step (``cdiv(k * block_size +
      scheduled, block_size) - 1``): vLLM copies the state from the first to
      the second before the forward pass and before ``start_load_kv``
      (vllm/v1/worker/mamba_utils.py ``preprocess_mamba``), so only a copy
      loaded into both reaches the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
from ucm_db.connector.scheduler import UcmDbScheduler, logger
from ucm_db.units import unit_keys_of

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: Boundaries a lookup tries, from the attention groups' claim back, for one
#: where every state group holds a state (vLLM keeps about one per prompt).
MAX_PROBES = 8


@dataclass
class _StatePlan:
    """One request's state transfers."""

    done_blocks: set[int] = field(default_factory=set)  # boundaries (in blocks) stored, loaded or planned


class SsmStateScheduler(UcmDbScheduler):
    """The scheduler half of one state-space group (module invariants).

    It shares the ordinary scheduler's keys, store, epoch and bookkeeping;
    it plans loads and saves of single boundary states instead of prefixes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plans: dict[str, _StatePlan] = {}

    def has_state(self, request: Request, boundary_blocks: int, *, remote: bool = False) -> bool:
        """Whether the state after ``boundary_blocks`` blocks of ``request``
        is stored (in the local tier; ``remote``: or in the remote tier,
        which then promotes it)."""
        if boundary_blocks <= 0 or self._epochs.current() is None:
            return False
        key = self._keys(self._state(request), boundary_blocks)[boundary_blocks - 1]
        return all(self.store.lookup(self.namespace, [unit], remote=remote) == 1
                   for unit in unit_keys_of([key], self._spans, self._grid))

    @property
    def probes_remote(self) -> bool:
        """Whether a lookup may wait on the remote tier (module invariants)."""
        return self._lookups is None and self.store.config.remote is not None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        raise TypeError("a state group's hit is claimed with the attention groups' (ssm_claim)")

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request, renew_epoch=False)
        self._plans.setdefault(request.request_id, _StatePlan())
        # The load is planned with the step (build_connector_meta), when
        # vLLM has set num_computed_tokens to the hit's end.
        state.pending_load_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        meta = UcmDbConnectorMetadata()
        self._planner.number_step(meta, scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            self._plan_state_load(meta, new_req.req_id, new_req.block_ids[self._group], scheduled.get(new_req.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and block_ids is not None:
                self._plan_state_load(meta, req_id, block_ids[self._group], scheduled.get(req_id, 0))
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        if self._role.saves:
            for req_id, entries in offers.items():
                self._plan_state_saves(meta, req_id, entries, scheduler_output)
        meta.epoch = -1 if self._epochs.epoch is None else self._epochs.epoch
        meta.preempted = self._preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            self._plans.pop(req_id, None)
        self._epochs.step_done()
        return meta

    def _plan_state_load(self, meta: UcmDbConnectorMetadata, req_id: str, block_ids: Sequence[int], num_scheduled: int) -> None:
        state = self._requests.get(req_id)
        plan = self._plans.get(req_id)
        if state is None or plan is None or not state.pending_load_tokens:
            return
        state.pending_load_tokens = 0
        end_tokens = state.request.num_computed_tokens  # the hit's end: a block boundary (ssm_claim)
        k = end_tokens // self._block_size
        running = -(-(end_tokens + max(num_scheduled, 1)) // self._block_size) - 1
        if end_tokens % self._block_size or k <= 0 or len(block_ids) <= running:
            # Not what align mode allocates for a hit ucm-db claimed (ssm_claim): a vLLM change to report.
            logger.warning(
                "ucm-db: request %s: KV cache group %d: no state block at the hit's end (%d tokens, %d block ids); "
                "its SSM state is not loaded",
                req_id, self._group, end_tokens, len(block_ids),
            )
            return
        key = self._keys(state, k)[k - 1]
        for index in (k - 1, running):
            meta.loads.append(BlockTransfer(req_id, (key,), (block_ids[index],)))
        plan.done_blocks.add(k)

    def _plan_state_saves(
        self, meta: UcmDbConnectorMetadata, req_id: str, entries: Sequence[tuple[int, int, int]], scheduler_output: SchedulerOutput,
    ) -> None:
        state = self._requests.get(req_id)
        if state is None or state.epoch is None or state.epoch != self._epochs.epoch:
            return  # unknown here, or running across a reset: its state predates the new epoch
        if req_id in scheduler_output.finished_req_ids or req_id in (getattr(scheduler_output, "preempted_req_ids", None) or ()):
            return  # its blocks are going back to the pool this step
        plan = self._plans.setdefault(req_id, _StatePlan())
        for group, block_id, boundary_tokens in entries:
            k = boundary_tokens // self._block_size
            if group != self._group or boundary_tokens % self._block_size or k <= 0 or k in plan.done_blocks:
                continue
            if boundary_tokens > state.request.num_tokens:
                continue  # keys need the tokens
            key = self._keys(state, k)[k - 1]
            meta.saves.append(BlockTransfer(req_id, (key,), (block_id,), None))
            plan.done_blocks.add(k)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def rewind(self, req_id: str, save_start: int | None) -> None:
        """A failed load: the request recomputes, and its states are saved again."""
        plan = self._plans.get(req_id)
        if plan is not None:
            plan.done_blocks.clear()
        super().rewind(req_id, save_start)


def ssm_claim(state_parts: Sequence[SsmStateScheduler], request: Request, num_computed_tokens: int, attention_tokens: int,
              block_size: int) -> int:
    """Tokens beyond ``num_computed_tokens`` every group can serve, given
    the attention groups' claim ``attention_tokens`` (module invariants)."""
    end_blocks = (num_computed_tokens + attention_tokens) // block_size
    first_blocks = num_computed_tokens // block_size
    for k in range(end_blocks, max(first_blocks, end_blocks - MAX_PROBES), -1):
        if all(part.has_state(request, k) for part in state_parts):
            return k * block_size - num_computed_tokens
    if end_blocks > first_blocks and all(part.probes_remote for part in state_parts):
        if all(part.has_state(request, end_blocks, remote=True) for part in state_parts):
            return end_blocks * block_size - num_computed_tokens
    return 0
