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
    * A stored state is evented (events.py) as vLLM's prefix cache events
      an align-mode state block (vllm/v1/core/block_pool.py
      ``cache_full_blocks`` ~273-345: null blocks skipped, the cached one's
      hash, its parent the previous block's hash even where that block is
      null): the hash of block ``k - 1``, parent the hash of block ``k - 2``
      (None for ``k = 1``), the block's tokens, this group's index; its
      spec kind (``"mamba"``) is the group's, as for every group.
    * Saved: exactly the boundary states vLLM offers for this group, at
      whole blocks of known tokens, in the step that offers them (the
      worker copies them out in that step's ``wait_for_save``, after the
      forward pass wrote them); a boundary already stored or loaded for the
      request is not saved again. ``save_decode`` and ``admit_after`` do
      not hold a state back: it is offered once, and the attention groups
      may admit its prefix later (a second sighting over vLLM's own cache
      computes only the tail), when a held-back state could never be stored.
    * A hit ends at a block boundary where every state group holds a state
      and every attention group holds the prefix (:func:`ssm_claim`): the
      longest such boundary at or below the attention groups' claim, looked
      for in the local tier at most :data:`MAX_PROBES` boundaries back,
      then (none found) in the remote tier at the claim's end only, one
      probe per group, and never where remote lookups run in the
      background (``remote_lookup: "background"``: the scheduler's thread
      does not wait on the remote).
    * A hybrid model's loads are asynchronous (hybrid.py), and a load of
      the state at boundary ``k`` writes it into the group's block ``k - 1``
      only, planned at allocation (:meth:`SsmStateScheduler.plan_async_load`).
      What vLLM 0.32 does (read there):
      - at allocation of an async hit (``load_kv_async``: no new tokens),
        the group's skipped tokens are all but the hit's last
        (``MambaManager.get_num_skipped_tokens``), so blocks ``0 .. k - 2``
        are null and block ``k - 1`` is allocated for the external tokens
        (vllm/v1/core/single_type_kv_cache_manager.py
        ``allocate_external_computed_blocks`` ~326-367; not zeroed later:
        the scheduler passes the prefix-cacheable groups, this one
        included, as ``skip_zeroing_group_ids``): it is in the block ids
        ``update_state_after_alloc`` gets;
      - once the load is reported, the request is scheduled as a new one
        with ``num_computed_tokens = k * block_size`` (the claim never
        covers the prompt's last token), allocation records block ``k - 1``
        as its last state block (``last_state_block_idx = prev_block_len -
        1``, ~1830) and adds the running block;
      - in that first step the worker's ``preprocess_mamba``
        (vllm/v1/worker/mamba_utils.py ~1446-1530, called before the
        forward by gpu_model_runner.py ~4091, which vLLM-CPU inherits) has
        no state index for the request, takes ``prev_state_idx =
        (num_computed_tokens - 1) // block_size = k - 1`` (~1495) and copies
        block ``k - 1`` to the running block ``curr_state_idx`` (~1512-1530).
      So the state loaded into block ``k - 1`` before the request is
      scheduled is what the forward pass starts from; the running block is
      not loaded (the copy overwrites it). A hit whose block ``k - 1`` is
      missing or null (not what align mode allocates: a vLLM change) loads
      no state, with a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ucm_db.connector.events import save_fields
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
from ucm_db.connector.scheduler.hooks import UcmDbScheduler, logger
from ucm_db.connector.scheduler.request_state import adapter_claim
from ucm_db.keys.units import unit_keys_of

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
        self._async_plans: list[BlockTransfer] = []  # planned at allocation, for the next step's metadata
        self._unloadable: list[str] = []  # claimed hits without a state to load: failed in the next step

    def has_state(self, request: Request, tokens: int, *, remote: bool = False) -> bool:
        """Whether the state after ``tokens`` tokens of ``request`` (a boundary of this group's blocks, or False)
        is stored (in the local tier; ``remote``: or in the remote tier, which then promotes it)."""
        boundary_blocks, rest = divmod(tokens, self._block_size)
        if rest or boundary_blocks <= 0 or self._epochs.current() is None:
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
        self._state(request, renew_epoch=False)
        self._plans.setdefault(request.request_id, _StatePlan())  # the load: plan_async_load

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        meta = UcmDbConnectorMetadata(namespace=self._namespace.id, namespace_inputs=self._inputs)
        self._planner.number_step(meta, scheduler_output)
        meta.async_loads, self._async_plans = self._async_plans, []
        meta.unloadable, self._unloadable = tuple(self._unloadable), []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        if self._role.saves and not self._off:  # off: a worker refused the namespace (scheduler/hooks.py)
            for req_id, entries in offers.items():
                self._plan_state_saves(meta, req_id, entries, scheduler_output)
        meta.epoch = -1 if self._epochs.epoch is None else self._epochs.epoch
        meta.preempted = self._preempted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            self._plans.pop(req_id, None)
        self._epochs.step_done()
        return meta

    def plan_async_load(self, request: Request, blocks: Any, end_tokens: int) -> None:
        """Plans the async load of the state at the hit's end ``end_tokens``
        (a block boundary, ssm_claim) into block ``k - 1`` of this group's
        ``blocks`` (vLLM's KVCacheBlocks), for the next step's metadata."""
        state = self._requests.get(request.request_id)
        plan = self._plans.setdefault(request.request_id, _StatePlan())
        k = end_tokens // self._block_size
        block_ids = blocks.get_block_ids()[self._group]
        if (state is None or end_tokens % self._block_size or k <= 0 or len(block_ids) < k
                or block_ids[k - 1] == 0):  # 0: vLLM's null block
            # Not what align mode allocates for a hit ucm-db claimed (module invariants): a vLLM change to report.
            logger.warning(
                "ucm-db: request %s: KV cache group %d: no state block at the hit's end (%d tokens, %d block ids); "
                "its load fails and vLLM recomputes it",
                request.request_id, self._group, end_tokens, len(block_ids),
            )
            self._unloadable.append(request.request_id)  # the hit without its state would be wrong KV
            return
        key = self._keys(state, k)[k - 1]
        self._async_plans.append(BlockTransfer(request.request_id, (key,), (block_ids[k - 1],)))
        plan.done_blocks.add(k)

    def _plan_state_saves(
        self, meta: UcmDbConnectorMetadata, req_id: str, entries: Sequence[tuple[int, int, int]], scheduler_output: SchedulerOutput,
    ) -> None:
        state = self._requests.get(req_id)
        if state is None or state.epoch is None or state.epoch != self._epochs.epoch or not state.controls.save:
            return  # unknown here, across a reset (its state predates the new epoch), or not to be saved
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
            fields = save_fields(state.request, k - 1, k, self._block_size, state.epoch, self._group)
            meta.saves.append(BlockTransfer(req_id, (key,), (block_id,), None, event_fields=fields, adapter=adapter_claim(state)))
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
    the attention groups' claim ``attention_tokens`` (module invariants);
    boundaries are multiples of ``block_size``, every group's (groups.claim_step)."""
    end_blocks = (num_computed_tokens + attention_tokens) // block_size
    first_blocks = num_computed_tokens // block_size
    for k in range(end_blocks, max(first_blocks, end_blocks - MAX_PROBES), -1):
        if all(part.has_state(request, k * block_size) for part in state_parts):
            return k * block_size - num_computed_tokens
    if end_blocks > first_blocks and all(part.probes_remote for part in state_parts):
        if all(part.has_state(request, end_blocks * block_size, remote=True) for part in state_parts):
            return end_blocks * block_size - num_computed_tokens
    return 0
