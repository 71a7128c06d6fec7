"""Hybrid models (vLLM's hybrid KV cache manager, ``SupportsHMA``): one
scheduler half and one worker half per KV cache group.

vLLM gives a hybrid model (sliding-window layers beside full-attention ones,
e.g. Gemma 2) one KV cache group per kind of layer; each group has its own
block table, drawn from one shared block pool, and each group's block ``b``
is block ``b`` of that group's layers only.

Invariants:
    * A model with one KV cache group never comes here: the connector uses
      :class:`~ucm_db.connector.scheduler.hooks.UcmDbScheduler` and
      :class:`~ucm_db.connector.worker.hooks.UcmDbWorker` directly (same keys, same
      namespace as before ``SupportsHMA``).
    * Group ``g``'s halves are an ordinary scheduler and worker over that
      group's layers (:func:`group_shape`), reading group ``g``'s block ids
      and storing under the group's namespace (:func:`~ucm_db.connector.hybrid.groups.group_namespace`,
      naming its layers and spec): every group keeps its own key chain of the
      same tokens, with the prefix invariant of any chain, at the group's
      own block size (groups.py: vLLM may enlarge some groups'), whose
      blocks its block ids are.
    * Every group stores every block of a request: a sliding-window block is
      still inside the window in the step it becomes complete, when the
      worker copies it out. A hit is the shortest of the groups' stored
      prefixes (what every group can serve), cut to a multiple of every
      group's block size (:func:`~ucm_db.connector.hybrid.groups.claim_step`);
      a lookup any group defers (None) is deferred.
    * vLLM's null block (:data:`NULL_BLOCK_ID`: a sliding-window group's
      blocks outside its window) is never read nor written: a load skips
      it (no attention reads it); a save that would read one is dropped,
      with the rest of its request's saves in that group (no chain has a
      gap), so that group's stored prefix ends there.
    * Every load is asynchronous, whatever ``load_mode`` says (logged once
      at start): vLLM 0.32 stops the engine on a block-level load failure
      of a model with several groups (``Scheduler._handle_invalid_blocks``)
      and hears of a failed load of one only per request, through an async
      load's ``failed_recving``. So every claim is async
      (``load_kv_async``); each group plans its part of the load at
      allocation (its scheduler's ``update_state_after_alloc``); vLLM
      schedules the request once every group's part has ended
      (hybrid_loads.py), and a request any group failed is reported in
      ``failed_recving`` (and ``finished_recving``), never as block ids:
      vLLM recomputes it from its first token (``kv_load_failure_policy:
      "recompute"``), every group is rewound to nothing stored or saved,
      and a later lookup of it claims nothing (a sync claim has no failure
      route; an async one could fail the same way again), so its KV is
      computed and saved again. Nothing is computed over an async load
      before it ends (vLLM holds the request, and caches its blocks only
      after a load that held), so no save depends on one.
    * Only TP=1 and PP=1 (refused at start otherwise, :func:`check_hybrid`),
      with at least one attention group (groups.py).
    * An SSM state group (ssm_state.py) stores one state per block
      boundary, not a prefix: its halves are a
      :class:`~ucm_db.connector.hybrid.ssm_state.SsmStateScheduler` and an
      ordinary worker over its layers' state pages (one unit per block), and
      a hit is cut back to a boundary where every state group holds a state
      (:func:`~ucm_db.connector.hybrid.ssm_state.ssm_claim`). Its async load is
      planned with the attention groups' (ssm_state.py says which block).
    * A group's save of a request whose save in another group is held or
      voidable this step (over another connector's loads) is voidable too,
      so its units are provisional (worker/provisional.py): a state save,
      planned outside the save settlement (settlement.py), is neither held nor voided
      itself, but vLLM stops the engine when a load fails with several KV
      cache groups, and the store's sweep then deletes what the dead worker
      stored provisionally (a review: tests/connector/test_review_voidable_fuzz.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ucm_db.connector.hybrid.groups import KVGroup, claim_step, group_namespace
from ucm_db.connector.hybrid.loads import GroupLoads
from ucm_db.connector.hybrid.null_blocks import NULL_BLOCK_ID, drop_null_loads
from ucm_db.connector.identity import KVShape, namespace
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import UcmDbConnectorStats
from ucm_db.connector.roles import RolePolicy
from ucm_db.connector.scheduler.hooks import UcmDbScheduler, logger
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.hybrid.ssm_state import SsmStateScheduler, ssm_claim
from ucm_db.connector.worker.hooks import UcmDbWorker
from ucm_db.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: Steps whose loads the grouped scheduler remembers until their output is back.
_MAX_PENDING_STEPS = 64


def check_hybrid(groups: Sequence[KVGroup], shape: KVShape, settings: ConnectorSettings) -> None:
    """Refuses a hybrid deployment ucm-db does not serve yet (module invariants)."""
    if len(groups) > 1 and shape.tp_size * shape.pp_size > 1:
        raise ConfigError(
            f"ucm-db stores a model with {len(groups)} KV cache groups at tensor and pipeline parallel size 1 only "
            f"(this engine: TP={shape.tp_size}, PP={shape.pp_size})",
            hint="serve the model at TP=1 and PP=1, or without ucm-db",
        )


def group_shape(shape: KVShape, group: KVGroup) -> KVShape:
    """The shape of one group's KV: the model's, over the group's layers, at
    the group's block size (an SSM state group's block is one unit per
    layer: its state page)."""
    block_size = group.block_size or shape.block_size
    if group.kind == "ssm_state":
        return replace(shape, layers=len(group.layer_names), kv_heads=1, block_size=block_size)
    return replace(shape, layers=len(group.layer_names), block_size=block_size)


class _MergedCounters:
    """The ``take`` of several halves' counters, as one interval's stats."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self._parts = parts

    def take(self) -> UcmDbConnectorStats | None:
        out: UcmDbConnectorStats | None = None
        for part in self._parts:
            stats = part.counters.take()
            if stats is not None:
                out = stats if out is None else out.aggregate(stats)  # type: ignore[assignment]
        return out


class GroupedScheduler:
    """The scheduler half of a hybrid model: one :class:`UcmDbScheduler` per group."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape, role: RolePolicy, groups: Sequence[KVGroup], *,
                 generations_checked: bool = False) -> None:
        base = namespace(shape)
        self.groups = list(groups)
        if settings.load_mode != "async":
            logger.info("ucm-db: a model with %d KV cache groups loads asynchronously (load_mode %r is for models with one): "
                        "vLLM recovers from a failed load of such a model only per request, after an async load",
                        len(self.groups), settings.load_mode)
        settings = replace(settings, load_mode="async")  # module invariants
        self.parts = [(SsmStateScheduler if g.kind == "ssm_state" else UcmDbScheduler)(
                          settings, group_shape(shape, g), role, g.index, group_namespace(base, self.groups, g),
                          generations_checked=generations_checked)
                      for g in self.groups]
        self._attention = [p for p in self.parts if not isinstance(p, SsmStateScheduler)]
        self._states = [p for p in self.parts if isinstance(p, SsmStateScheduler)]
        self._step_tokens = claim_step(self.groups, shape.block_size)  # a hit is a multiple of it (module invariants)
        # Lookups and hits are the same for every group (the shortest claim):
        # the first attention group's counters report them once.
        self.counters = self._attention[0].counters
        self._broken: set[tuple[int, str]] = set()  # (group, request) whose chain met a null block
        self._step_loads: dict[int, list[tuple[str, set[int]]]] = {}  # step -> (request, every group's loaded blocks)
        self._load_failed: set[str] = set()  # requests whose async load failed: claimed nothing more

    @property
    def kv_cache_manager(self) -> Any:
        return self.parts[0].kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, manager: Any) -> None:
        for part in self.parts:
            part.kv_cache_manager = manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The hit every group can serve, always loaded asynchronously; 0
        after a failed load of the request (module invariants)."""
        if request.request_id in self._load_failed:
            for part in self._attention:  # a lookup still: what another connector loads now is told apart (composition.py)
                part._state(request).start_lookup(num_computed_tokens)
            return 0, False
        answers = [part.get_num_new_matched_tokens(request, num_computed_tokens)[0] for part in self._attention]
        if any(tokens is None for tokens in answers):
            return None, False
        end = num_computed_tokens + min(tokens for tokens in answers if tokens is not None)
        tokens = max(0, end // self._step_tokens * self._step_tokens - num_computed_tokens)
        if self._states and tokens > 0:
            tokens = ssm_claim(self._states, request, num_computed_tokens, tokens, self._step_tokens)
        return tokens, tokens > 0

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The claim's split by tier, as the first attention group saw it
        (every group claims the same blocks)."""
        return self._attention[0].hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Every group plans its part of the request's async load."""
        lead = self._attention[0]
        state = lead._requests.get(request.request_id)
        local_tokens = state.lookup.local_tokens if state is not None and state.lookup is not None else None
        for part in self._attention if num_external_tokens else ():
            part_state = part._requests.get(request.request_id)
            if part_state is not None:
                part_state.async_tried = False  # a resumed request's claim is async again: no sync claim here
        for part in self.parts:
            part.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens and local_tokens is not None:
            for state_part in self._states:
                state_part.plan_async_load(request, blocks, local_tokens + num_external_tokens)
        if self.groups[self.parts.index(lead)].index != 0 and local_tokens is not None:
            # The ordinary scheduler logs this line for group 0 only; here group 0 holds SSM state.
            logger.info(
                "ucm-db: request %s: %d prompt tokens, %d from vLLM's prefix cache, %d hit tokens loaded from ucm-db",
                request.request_id, request.num_prompt_tokens, local_tokens, num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        metas = [part.build_connector_meta(scheduler_output) for part in self.parts]
        loaded: dict[str, set[int]] = {}
        for meta in metas:
            drop_null_loads(meta)
            for transfer in meta.loads:
                loaded.setdefault(transfer.req_id, set()).update(transfer.block_ids)
        if loaded:
            self._step_loads[metas[0].step] = list(loaded.items())
            if len(self._step_loads) > _MAX_PENDING_STEPS:
                del self._step_loads[min(self._step_loads)]
        after: dict[str, set[int]] = {}
        settling = set()  # requests with a save held or voidable this step: their other groups' saves are tagged
        for meta in metas:
            for transfer in meta.saves:
                after.setdefault(transfer.req_id, set()).update(transfer.after_loads)
                if transfer.hold_id >= 0 or transfer.voidable:
                    settling.add(transfer.req_id)
        for index, meta in enumerate(metas):
            kept = [replace(t, after_loads=tuple(sorted(after[t.req_id])),
                            voidable=t.voidable or (t.hold_id < 0 and t.req_id in settling)) if after[t.req_id] else t
                    for t in meta.saves if self._keeps(index, t)]
            if meta.saves and not kept:  # its worker drains nothing this step: its voids wait (settlement.py)
                self.parts[index].saves_dropped(meta.step)
            meta.saves = kept
        first = metas[self.parts.index(self._attention[0])]
        return UcmDbConnectorMetadata(step=first.step, idle=first.idle, epoch=first.epoch, preempted=first.preempted, groups=metas)

    def _keeps(self, group: int, save: BlockTransfer) -> bool:
        """False for a save that would read a null block, and for every later
        save of its request in that group (module invariants)."""
        if (group, save.req_id) not in self._broken and NULL_BLOCK_ID not in save.block_ids:
            return True
        self._broken.add((group, save.req_id))
        return False

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        """Every group forgets the request; a ``kv_producer`` returns the
        first attention group's publication."""
        results = [part.request_finished(request, list(block_ids[i]) if i < len(block_ids) else [])
                   for i, part in enumerate(self.parts)]  # every group forgets it, whatever vLLM passed
        self._broken = {(g, r) for g, r in self._broken if r != request.request_id}
        self._load_failed.discard(request.request_id)
        return False, results[self.parts.index(self._attention[0])][1]

    def reset_cache(self) -> bool:
        return all([part.reset_cache() for part in self.parts])

    def observe_output(self, worker_meta: object, invalid_block_ids: set[int] | None = None,
                       failed_requests: set[str] | None = None) -> None:
        """One step's output; ``failed_requests`` (vLLM's ``failed_recving``):
        async loads that failed, recomputed from the first token by vLLM."""
        for req_id in failed_requests or ():
            if any(req_id in part._requests for part in self.parts):  # not one finished (aborted) meanwhile
                self._load_failed.add(req_id)
            for part in self.parts:
                part_state = part._requests.get(req_id)
                if part_state is not None:
                    part_state.async_block_ids = ()
                    part_state.stored_blocks = part_state.saved_blocks = 0
                part.rewind(req_id, 0)  # nothing stored or saved: its KV is computed and saved again
        invalid = invalid_block_ids or set()
        step = worker_meta.step if isinstance(worker_meta, UcmDbWorkerMetadata) else None
        rewound: set[str] = set()
        if step is not None or invalid:
            for number in [s for s in sorted(self._step_loads) if step is None or s <= step]:
                rewound.update(req_id for req_id, ids in self._step_loads.pop(number) if invalid.intersection(ids))
        for part in self.parts:
            part.observe_output(worker_meta, invalid)
        for req_id in rewound:  # vLLM recomputes from the failed block in every group
            for part in self.parts:
                part.rewind(req_id, None)

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()


class GroupedWorker:
    """The worker half of a hybrid model: one :class:`UcmDbWorker` per group."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape, num_blocks: int | None, role: RolePolicy,
                 groups: Sequence[KVGroup]) -> None:
        base = namespace(shape)
        self.groups = list(groups)
        settings = replace(settings, load_mode="async")  # every load is async (module invariants)
        self.parts = [UcmDbWorker(settings, group_shape(shape, g), num_blocks, role, group_namespace(base, self.groups, g))
                      for g in self.groups]
        self.counters = _MergedCounters(self.parts)
        self._owner: dict[str, UcmDbWorker] = {}
        self._loads = GroupLoads(self.parts)  # every load is async (module invariants, hybrid_loads.py)

    def register_kv_caches(self, kv_caches: Mapping[str, Any], tp_rank: int, pp_rank: int) -> None:
        for group, part in zip(self.groups, self.parts):
            missing = [name for name in group.layer_names if name not in kv_caches]
            if missing:
                raise ConfigError(
                    f"vLLM registered no KV cache for layers {missing} of KV cache group {group.index}",
                    hint="report this model to ucm-db (its KV caches do not match its KV cache groups)",
                )
            part.register_kv_caches({name: kv_caches[name] for name in group.layer_names}, tp_rank, pp_rank)
            self._owner.update((name, part) for name in group.layer_names)

    def start_load(self, meta: UcmDbConnectorMetadata) -> None:
        for index, (part, group_meta) in enumerate(zip(self.parts, meta.groups)):
            self._loads.submitted(index, [t.req_id for t in group_meta.async_loads])
            self._loads.failed_now(index, group_meta.unloadable)
            part.start_load(group_meta)

    def wait_for_layer(self, layer_name: str) -> None:
        part = self._owner.get(layer_name)
        for one in [part] if part is not None else self.parts:
            one.wait_for_layer(layer_name)

    def save(self, meta: UcmDbConnectorMetadata) -> None:
        failed = set().union(*(part.recent_failures() for part in self.parts))
        for part, group_meta in zip(self.parts, meta.groups):
            part.recent_failures(failed)  # a block any group failed voids every group's saves over it
            part.save(group_meta)

    def handle_preemptions(self, meta: UcmDbConnectorMetadata) -> None:
        for part, group_meta in zip(self.parts, meta.groups):
            part.handle_preemptions(group_meta)

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests every group's async load of which has ended (hybrid_loads.py)."""
        return self._loads.finished(wait_s)

    def take_failed_loads(self) -> set[str]:
        """Requests :meth:`finished_loads` reported whose load failed in some group, once."""
        return self._loads.take_failed()

    def take_load_errors(self) -> set[int]:
        """Always empty: every load is async and its failures are reported
        per request (:meth:`take_failed_loads`); block ids would stop vLLM's
        engine (module invariants); a sync load's failure, which cannot
        arise, is logged as the bug it would be."""
        failed = set().union(*(part.take_load_errors() for part in self.parts))
        if failed:
            logger.error("ucm-db: %d blocks of a hybrid model failed a sync load, which no hybrid load should be: "
                         "their KV may be stale; report this as a ucm-db bug", len(failed))
        return set()

    def take_worker_meta(self) -> UcmDbWorkerMetadata | None:
        out: UcmDbWorkerMetadata | None = None
        for part in self.parts:
            meta = part.take_worker_meta()
            if meta is not None:
                out = meta if out is None else out.aggregate(meta)  # type: ignore[assignment]
        return out

    def drain(self) -> None:
        for part in self.parts:
            part.drain()

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()
