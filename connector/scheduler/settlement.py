"""Settlement of the saves planned over loads whose outcome is not known yet.

vLLM runs a step's forward pass before it learns that a load of that step
failed, so KV computed after a failed block is wrong. A save planned in a
step that also loads blocks it depends on names them (``after_loads``,
metadata.py); this module keeps what the scheduler must remember until the
outputs of those steps are back, and turns them into verdicts.

Invariants:
    * With several ranks (each sees only its own failures) a save over a
      load is held by the workers (``hold_id``): it gets one verdict,
      commit or drop, once the output of every step up to its own is back,
      in planning order; after a dropped save, the same request's later
      held saves drop too (each must commit after the one before it, or not
      at all). A ``kv_producer`` commits inside the step instead (roles.py),
      so its save over a load is deleted afterwards (``void_saves``: what
      its writers stored of it, worker/voids.py) if a load it depends on failed.
    * Blocks another connector loaded (MultiConnector, composition.py) count
      as loads of the request for its saves, with one rank too: such a save
      is held (or, a producer's, voided) like one over a load of our own.
    * Every request a failed load, a voided save or a save a worker dropped
      itself touches is rewound to where vLLM recomputes (the ``rewind``
      callback), so what it computes again is saved again. With one rank a
      save over our own loads is neither held nor committed when one of
      them failed (its worker drops it, worker/hooks.py): it is tracked
      like a producer's, and its request rewound, though it was never
      stored. Its request may not be the one whose load failed: another
      sharing the block through vLLM's prefix cache keeps it as computed.
    * The blocks of a failed load, and every later block of each block
      table that held one, leave vLLM's prefix cache
      (:func:`forget_failed_blocks`) when a step's output names them: under
      ``kv_load_failure_policy: "recompute"`` vLLM keeps them hashed (for
      the request to write again) and rewinds only the requests it still
      runs or holds waiting, so a request aborted or preempted before the
      output came back (the client's abort between a step's execution and
      its output; the next step, planned before it with async scheduling or
      a batch queue) would hand their stale KV to the next request of that
      prefix, as a local hit the connector would then save. The tables are
      those requests hold now and those recorded while the steps were
      planned (:meth:`SaveSettlement.record_tables`: every scheduled request
      whose table held a block loaded in a step whose output was not back,
      the loader's and those sharing its blocks), kept until the output of
      their step is back: a request that left holds none now.
    * A voided save's block keys are fenced from the step the void is
      known (the output naming the failed load) until the void has surely
      run: the output is back of a step at or after the one whose metadata
      carried it that also saves (a ``kv_producer``'s worker drains its
      writer within every step that saves, and the void was queued before
      that step's saves). Meanwhile no lookup of this engine counts a
      fenced block as stored (:meth:`SaveSettlement.unfenced`): another
      request of the same prefix, looked up before the void ran, loaded the
      voided KV (and a producer published it). The step that drains is the
      one whose *final* metadata saves (a hybrid model's group may lose
      every save of a step after planning: :meth:`SaveSettlement.saves_dropped`).
      A request vLLM finishes while it handles a step's output (before the
      connector sees that output) may pass the fences that output lifts
      (``output_back``): the step is back, its worker ran the void. A
      fence is never dropped before its void ran: at most
      :data:`MAX_FENCES` fences whose drained step is planned are kept (the
      oldest go first); those waiting for a saving step are bounded by the
      voids of the steps in flight (a void comes from a saving step's output).
      Where the delete itself fails, the worker retries it before its later
      rounds (worker/voids.py); the fence does not wait for that.
    * Failed block ids of a settled step stay known while a pending save
      may depend on them: until the step is more than
      :data:`MAX_PENDING_STEPS` steps older than the oldest held save or
      unsettled load (all of them are forgotten once nothing is pending).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucm_db.connector.composition import sibling_block_ids
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

#: Steps awaiting their workers' output at most (older ones are dropped:
#: an output that carried no metadata never comes).
MAX_PENDING_STEPS = 64

#: Fences whose drained step is planned kept at most (the oldest goes first; a fence stays only
#: until this engine's next step that saves is back). Fences not yet drained are never dropped.
MAX_FENCES = 1024

#: ``rewind(request id, save start or None)``: moves a request's stored and
#: saved marks back to the blocks vLLM still counts as computed.
Rewind = Callable[[str, "int | None"], None]


@dataclass
class StepLoads:
    """A step's synchronous loads, and its saves over unsettled loads that
    are not held (a ``kv_producer``'s, committed at once; one rank's, which
    its worker drops itself over a failed load), until the step's output
    says whether every load held."""

    loads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (request id, block ids)
    # (save, its first block's index, committed: a rank or a connector that did not see the failure stored it)
    saves: list[tuple[BlockTransfer, int, bool]] = field(default_factory=list)
    sibling: set[str] = field(default_factory=set)  # requests whose loads another connector made (composition.py)


@dataclass
class Fence:
    """The keys of a voided save, fenced from lookups until the void ran
    (module invariants): ``drained`` is the first step that saves, from
    the one whose metadata carried the void on."""

    keys: frozenset[bytes]
    drained: int | None = None


@dataclass(frozen=True)
class HeldSave:
    """A save the workers keep until the outputs of the steps it depends on are back."""

    step: int
    transfer: BlockTransfer
    start: int  # its first block's index in the request


class SaveSettlement:
    """The loads and saves of steps whose output is not back, and their verdicts."""

    def __init__(self, several_ranks: bool, publishes: bool) -> None:
        # With several ranks a save over a load waits for the verdict of every
        # rank (a rank sees only its own failures); one rank sees all of its own,
        # but not another connector's. A producer commits at once (roles.py).
        self._several_ranks = several_ranks
        self._publishes = publishes
        self._step_loads: dict[int, StepLoads] = {}  # steps with sync loads whose output has not come back
        self._voids: list[BlockTransfer] = []  # committed saves to delete, for the next step's metadata
        self._held: dict[int, HeldSave] = {}  # by hold id (ascending = planning order)
        self._next_hold_id = 0
        self._held_verdicts: tuple[list[int], list[int]] = ([], [])  # (commit, drop), for the next metadata
        # Failed block ids by settled step, while saves planned at or after that step may depend on them.
        self._recent_bad: dict[int, set[int]] = {}
        # step -> block tables of the requests it computed over unsettled loads (forget_failed_blocks)
        self._tables: dict[int, list[tuple[int, ...]]] = {}
        self._fences: list[Fence] = []  # voided saves' keys, until their void surely ran
        self._returned = -1  # the last step whose output came back

    def record_loads(self, meta: UcmDbConnectorMetadata, others: Sequence[tuple[str, tuple[int, ...]]] = ()) -> set[int]:
        """Remembers the step's synchronous loads, and ``others``: (request,
        block ids) another connector loaded this step (composition.py);
        returns every block loaded in this step or in an earlier one whose
        output is not back (async scheduling plans a step
        before the last one's output has come back): this step's KV may
        attend to any of them."""
        if meta.loads or others:
            own = [(t.req_id, t.block_ids) for t in meta.loads]
            self._step_loads[meta.step] = StepLoads(own + list(others), sibling={r for r, _ in others})
            if len(self._step_loads) > MAX_PENDING_STEPS:
                del self._step_loads[min(self._step_loads)]
        return {b for record in self._step_loads.values() for _, ids in record.loads for b in ids}

    def record_tables(self, step: int, tables: Iterable[Sequence[int]]) -> None:
        """Remembers, until step ``step``'s output is back, the block tables
        of the requests it computes over loads whose outcome is not known
        (module invariants: their blocks after a failed one are stale)."""
        self._tables[step] = [tuple(table) for table in tables]
        if len(self._tables) > MAX_PENDING_STEPS:
            del self._tables[min(self._tables)]

    def tables(self) -> list[tuple[int, ...]]:
        """The block tables :meth:`record_tables` keeps, of every step whose output is not back."""
        return [table for tables in self._tables.values() for table in tables]

    def after_loads(self, req_id: str, block_ids: Sequence[int], loaded: set[int]) -> tuple[tuple[int, ...], bool]:
        """(the loaded blocks a save of ``req_id`` over ``block_ids`` depends
        on, whether any of them another connector loaded): its own blocks
        among ``loaded``, and every group's blocks another connector loaded
        into the request in steps whose outcome is not back. Blocks another
        connector loaded into another request that ``req_id`` shares
        through vLLM's prefix cache count as its too: this connector's
        workers never see that load fail, so such a save is held."""
        own = tuple(b for b in block_ids if b in loaded) if loaded else ()
        sibling = sibling_block_ids(self._step_loads.values(), req_id)
        if own and not sibling:  # shared from a request another connector loaded: its failure is that connector's
            sibling = {b for record in self._step_loads.values() for r, ids in record.loads if r in record.sibling
                       for b in ids}.intersection(own)
        return (tuple(sorted(sibling.union(own))), True) if sibling else (own, False)

    def hold_id(self, req_id: str, after_loads: tuple[int, ...], sibling: bool = False) -> int:
        """The hold id of a save about to be planned (-1: not held). Saves
        over loads are held with several ranks, or over another connector's
        loads, unless this role commits at once (a producer's). A save
        after a held one of the same request is held too: it must commit
        after it, or not at all."""
        holds = not self._publishes and (self._several_ranks or sibling)
        hold = holds and (bool(after_loads) or any(h.transfer.req_id == req_id for h in self._held.values()))
        if not hold:
            return -1
        self._next_hold_id += 1
        return self._next_hold_id - 1

    def voidable(self, hold_id: int, after_loads: tuple[int, ...], sibling: bool = False) -> bool:
        """Whether a save the scheduler may void a step later: committed at
        once over loads that another rank or another connector made (what
        :meth:`track` records as committed). One rank's save over its own
        loads never is: its worker drops it when one of them failed."""
        return hold_id < 0 and bool(after_loads) and (self._several_ranks or sibling)

    def track(self, step: int, transfer: BlockTransfer, start: int, sibling: bool = False) -> None:
        """Remembers a planned save that waits on loads: held; or (a
        producer's) committed at once and deleted if another rank or
        another connector failed; or (one rank, over its own loads) dropped
        by its worker if one failed, its request rewound either way."""
        if transfer.hold_id >= 0:
            self._held[transfer.hold_id] = HeldSave(step, transfer, start)
        elif transfer.after_loads:
            committed = self.voidable(transfer.hold_id, transfer.after_loads, sibling)
            self._step_loads.setdefault(step, StepLoads()).saves.append((transfer, start, committed))

    def take_verdicts(self, meta: UcmDbConnectorMetadata) -> None:
        """Puts the voided saves and the held saves' verdicts reached since
        the last step into ``meta``, once; notes the step for their fences."""
        meta.void_saves, self._voids = self._voids, []
        for fence in self._fences if meta.saves else ():  # every fence's void is in this metadata or an earlier one
            if fence.drained is None:
                fence.drained = meta.step  # its worker drains the writer, the void queued before, within this step
        (meta.held_commits, meta.held_drops), self._held_verdicts = self._held_verdicts, ([], [])

    def saves_dropped(self, step: int) -> None:
        """Step ``step``'s final metadata saves nothing after all (a hybrid
        group's saves cut at a null block, hybrid/hooks.py): its worker does
        not drain its writer, so the fences noted for it wait for a later
        saving step (module invariants)."""
        for fence in self._fences:
            if fence.drained == step:
                fence.drained = None

    def settle(self, step: int | None, invalid: set[int], rewind: Rewind) -> None:
        """Settles the sync loads of steps up to ``step`` (every step's, if
        the output named none but reports invalid blocks): each request
        that loaded an invalid block is rewound to where vLLM recomputes it
        (vLLM has already moved its computed tokens back to that block); a
        save computed over one is voided (deleted if committed, dropped if
        held; one rank's own worker dropped it already) and its request
        rewound too. Held saves planned up to ``step`` get their verdict,
        in planning order, for the next step's metadata: after a dropped
        one, a request's later ones drop too. The recorded block tables of
        steps up to ``step`` are forgotten. A committed save voided is
        counted by the workers whose void deletes it (worker/voids.py)."""
        for number in [s for s in self._tables if step is not None and s <= step]:
            del self._tables[number]
        if step is not None:  # the output of a step that drained the void is back: the void ran
            self._returned = max(self._returned, step)
            self._fences = [f for f in self._fences if f.drained is None or f.drained > step]
        if step is None and not invalid:
            return
        settled = [(s, self._step_loads.pop(s)) for s in sorted(self._step_loads) if step is None or s <= step]
        for number, record in settled:
            bad = invalid.intersection(b for _, ids in record.loads for b in ids)
            if bad:
                self._recent_bad[number] = bad
            for req_id, block_ids in record.loads:
                if bad.intersection(block_ids):
                    rewind(req_id, None)
        recent_bad = set().union(*self._recent_bad.values())
        for _, record in settled:
            for transfer, start, committed in record.saves:
                if not recent_bad.intersection(transfer.after_loads):
                    continue
                rewind(transfer.req_id, start)  # saved again once recomputed
                if committed:
                    self._voids.append(transfer)
                    self._fences.append(Fence(frozenset(transfer.keys)))
                    self._trim_fences()
                    logger.warning("ucm-db: request %s: %d blocks saved over a block that failed to load are voided",
                                   transfer.req_id, len(transfer.block_ids))
        if step is not None:
            self._give_verdicts(step, recent_bad, rewind)
        # A pending save depends only on loads of steps up to its own.
        oldest = min([h.step for h in self._held.values()] + list(self._step_loads), default=None)
        for number in [s for s in self._recent_bad if oldest is None or s < oldest - MAX_PENDING_STEPS]:
            del self._recent_bad[number]

    def _trim_fences(self) -> None:
        """Drops the oldest fences whose drained step is planned, beyond
        :data:`MAX_FENCES` of them; never one not yet drained (module invariants)."""
        excess = sum(fence.drained is not None for fence in self._fences) - MAX_FENCES
        if excess > 0:
            dropped = {id(fence) for fence in [f for f in self._fences if f.drained is not None][:excess]}
            self._fences = [fence for fence in self._fences if id(fence) not in dropped]

    @property
    def fenced(self) -> bool:
        """Whether any voided save's keys are fenced now (usually not: then a
        lookup needs no keys for :meth:`unfenced`)."""
        return bool(self._fences)

    def unfenced(self, keys: Sequence[bytes], found: int, output_back: bool = False) -> int:
        """``found`` leading blocks of a chain (``keys``) cut before the first
        one whose void may not have run yet (module invariants);
        ``output_back``: asked while vLLM handles the output of the step
        after the last one seen here (its fences' voids ran)."""
        if not self._fences:
            return found
        back = self._returned + 1 if output_back else self._returned
        fenced = frozenset().union(*(f.keys for f in self._fences if f.drained is None or f.drained > back))
        return next((i for i in range(found) if keys[i] in fenced), found) if fenced else found

    def _give_verdicts(self, step: int, recent_bad: set[int], rewind: Rewind) -> None:
        """Commit or drop, in planning order, for every held save planned up to ``step``."""
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
                rewind(req_id, held.start)
            else:
                commits.append(hold_id)


def forget_failed_blocks(kv_cache_manager: Any, recorded: Iterable[Sequence[int]], req_ids: Iterable[str], group: int,
                         invalid: set[int]) -> set[int]:
    """Evicts from vLLM's prefix cache every failed block and, of each block
    table holding one, every block after it (module invariants): the tables
    ``recorded`` as the steps were planned and those the requests ``req_ids``
    hold now (in KV cache group ``group``), as vLLM's
    ``kv_load_failure_policy: "fail"`` does for the requests it runs. The
    blocks stay allocated to whoever holds them; one given to another request
    since loses its hash too (a lost local hit, never wrong KV). Returns the
    blocks named, stale from their first slot (those vLLM had not hashed
    keep no hash to evict)."""
    if kv_cache_manager is None or not invalid:
        return set()
    stale = set(invalid)
    held = (kv_cache_manager.get_block_ids(req_id)[group] for req_id in req_ids)
    for block_ids in itertools.chain(recorded, held):
        first = next((i for i, block_id in enumerate(block_ids) if block_id in invalid), None)
        if first is not None:
            stale.update(block_ids[first:])
    kv_cache_manager.evict_blocks(stale)
    return stale
