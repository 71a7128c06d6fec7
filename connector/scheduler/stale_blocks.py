"""Blocks of vLLM's KV cache whose KV went stale, until it is written again.

vLLM runs a step's forward pass before it learns that a synchronous load of
that step failed. Under ``kv_load_failure_policy: "recompute"`` it rewinds
the first request holding a failed block and lets every other request that
shares it through the prefix cache keep it as computed, counting on the
first to write it again within the next forward pass. Where that does not
happen (the first request's recompute is chunked by
``long_prefill_token_threshold`` or the step's token budget, or it is
aborted), the others compute over the stale KV. This module follows that KV
slot by slot and has vLLM rewind whoever would read it.

Invariants:
    * A block goes stale when a step's output names a failed load (its
      blocks, and every later block of each table that held one:
      settlement.forget_failed_blocks); for each stale block it keeps the
      number of leading slots written again since by a request that read
      no stale slot (writes of one request are contiguous and in token
      order, and a rewound request restarts at a block's start, so a count
      is enough). A block a step loads is written whole before the forward
      pass (a failed load is reported and goes stale again); a block vLLM
      freed is forgotten and evicted from its prefix cache, so its next
      holder gets it fresh and writes it before reading it.
    * Each step is judged as it is planned, where every earlier step that
      computes has its output back (vLLM's synchronous scheduling). An
      engine that plans a step before the last one's output is back
      (async scheduling, a pipeline's batch queue) claims every hit
      asynchronously (``engine_facts.steps_overlap``): no synchronous
      load runs there, and the planner clears the tracker where a step
      is pending (nothing to judge against). A judged step's
      request *reads* the slots before its computed tokens and writes the
      slots of its scheduled tokens whose ids are known (a draft token's
      slot counts as unwritten: where vLLM keeps an accepted draft's KV,
      reading it once more costs a recompute, never wrong KV). vLLM writes
      a layer's KV for every token of the batch before that layer's
      attention reads any, so a slot written in the same step by a request
      that reads nothing stale is not stale to the others, and one a
      *tainted* request (one reading a stale slot) writes is stale to all
      of them, a request admitted beside it with that block as a local hit
      included (vLLM hashes a block as it schedules the tokens that fill
      it): the verdict is a fixpoint over the step's requests, iterated
      until no more are tainted. A tainted request's output and every slot
      it writes in the step are wrong (those slots go stale).
    * A tainted request's saves are not planned (planner.py), and the step's
      metadata names every stale block a tainted request read
      (``stale_reads``): each worker reports them with its failed loads
      (``invalid_block_ids``), so vLLM skips the tainted requests' output
      of the step and rewinds them (each to its first stale block, or back
      to its computed tokens where another request is rewound to write
      it); the scheduler then rewinds each of them that still counts a
      stale block it read as computed to that block's first token
      (:func:`recompute_stale_reads`), and their save marks, and evicts
      from vLLM's prefix cache every block of their tables as planned from
      the first stale one (theirs still or not: one aborted while its step
      ran left its blocks hashed; hooks.py). A request holding such a block without reading a stale slot may be
      rewound too (vLLM rewinds by blocks): that costs a recompute, never
      wrong KV, and the next step it no longer counts the block as computed.
    * Nothing is tracked and nothing is computed per step while no block is
      stale, which is every step until a synchronous load fails.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


#: Steps whose verdicts are kept awaiting their output (sync scheduling: one; a pipeline's batch queue: a few).
MAX_STEPS_IN_FLIGHT = 64


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request's part of a step, as planned."""

    req_id: str
    block_ids: Sequence[int]  # its block table (one KV cache group)
    computed_tokens: int  # tokens computed before the step (the slots it reads)
    written_end: int  # end of the slots the step writes whose token ids are known


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What one step planned over stale blocks: the blocks tainted requests read, and those requests."""

    stale_reads: tuple[int, ...] = ()
    tainted: frozenset[str] = frozenset()
    tables: tuple[tuple[int, ...], ...] = ()  # the tainted requests' block tables as planned


#: The verdict of a step that reads nothing stale (every step while no block is stale).
CLEAN_STEP = StepVerdict()


class StaleBlocks:
    """The stale blocks of one KV cache group and the verdicts of the steps in flight."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._clean_slots: dict[int, int] = {}  # stale block id -> leading slots written right since it went stale
        self._verdicts: dict[int, StepVerdict] = {}  # step -> its verdict, until the step's output is back

    @property
    def empty(self) -> bool:
        return not self._clean_slots

    def went_stale(self, block_ids: Iterable[int]) -> None:
        """Blocks whose KV is wrong from their first slot (a failed load's, or computed after one)."""
        for block_id in block_ids:
            self._clean_slots[block_id] = 0

    def clear(self) -> None:
        """Forgets every stale block (steps are planned before earlier outputs are back: nothing is judged)."""
        self._clean_slots.clear()

    def forget_freed(self, is_free: Callable[[int], bool]) -> set[int]:
        """Forgets the stale blocks vLLM freed and returns them: the caller
        evicts them from vLLM's prefix cache, so their next holder is given
        them fresh, and writes them before it reads them."""
        freed = {b for b in self._clean_slots if is_free(b)}
        for block_id in freed:
            del self._clean_slots[block_id]
        return freed

    def plan(self, step: int, scheduled: Sequence[Scheduled], loaded: Iterable[int]) -> StepVerdict:
        """The step's verdict (module invariants); remembered until :meth:`output_back`."""
        for block_id in loaded:
            self._clean_slots.pop(block_id, None)
        if not self._clean_slots:
            return CLEAN_STEP
        tainted: list[Scheduled] = []
        tainted_ids: set[str] = set()
        wrong_from: dict[int, int] = {}  # block id -> first slot a tainted request writes in the step
        while True:  # each round's tainted requests write wrong KV that others of the step may read
            clean = dict(self._clean_slots)
            undecided = [part for part in scheduled if part.req_id not in tainted_ids and self._touches(part, clean, wrong_from)]
            progress = True
            while progress and undecided:  # fixpoint: a right write may clean what another request reads
                progress = False
                for part in list(undecided):
                    if not self._stale_reads(part, clean, wrong_from):
                        undecided.remove(part)
                        self._write(part, clean, wrong_from, right=True)
                        progress = True
            if not undecided:
                break
            for part in undecided:
                tainted.append(part)
                tainted_ids.add(part.req_id)
                self._write(part, clean, wrong_from, right=False)
        for block_id, slot in wrong_from.items():  # the tainted requests' writes go stale
            clean[block_id] = min(clean.get(block_id, self._block_size), slot)
        self._clean_slots = {block_id: slots for block_id, slots in clean.items() if slots < self._block_size}
        if not tainted:
            return CLEAN_STEP
        stale_reads = {block for part in tainted for block in self._stale_reads(part, self._clean_slots, wrong_from)}
        verdict = StepVerdict(tuple(sorted(stale_reads)), frozenset(tainted_ids),
                              tuple(tuple(part.block_ids) for part in tainted))
        self._verdicts[step] = verdict
        for old in [s for s in self._verdicts if s < step - MAX_STEPS_IN_FLIGHT]:
            del self._verdicts[old]  # a step whose output never came back (its engine step was abandoned)
        return verdict

    def output_back(self, step: int | None) -> StepVerdict:
        """The verdict of step ``step``, whose output is back (forgotten here)."""
        return self._verdicts.pop(step, CLEAN_STEP) if step is not None else CLEAN_STEP

    def _touches(self, part: Scheduled, clean: dict[int, int], wrong_from: dict[int, int]) -> bool:
        """Whether ``part``'s table holds, up to its written end, a stale block or one a tainted request writes."""
        for block_id in part.block_ids[: -(-part.written_end // self._block_size)]:
            if block_id in clean or block_id in wrong_from:
                return True
        return False

    def _stale_reads(self, part: Scheduled, clean: dict[int, int], wrong_from: dict[int, int]) -> list[int]:
        """The blocks whose slots ``part`` reads (before its computed tokens)
        stale: not written right since they went stale, or written in the
        step by a tainted request."""
        read: list[int] = []
        for index, block_id in enumerate(part.block_ids[: -(-part.computed_tokens // self._block_size)]):
            needed = min(self._block_size, part.computed_tokens - index * self._block_size)
            if clean.get(block_id, needed) < needed or wrong_from.get(block_id, needed) < needed:
                read.append(block_id)
        return read

    def _write(self, part: Scheduled, clean: dict[int, int], wrong_from: dict[int, int], right: bool) -> None:
        """Counts ``part``'s writes of the step: a right one extends a stale
        block's clean slots (it starts at or before their end); a wrong one
        is where the block goes stale from (``wrong_from``)."""
        size = self._block_size
        for position in range(part.computed_tokens - part.computed_tokens % size, part.written_end, size):
            index = position // size
            if index >= len(part.block_ids):
                break
            block_id = part.block_ids[index]
            start = max(part.computed_tokens, position) - position
            end = min(part.written_end, position + size) - position
            slots = clean.get(block_id)
            if right and slots is not None and slots >= start:
                clean[block_id] = max(slots, end)
            elif not right:
                wrong_from[block_id] = min(wrong_from.get(block_id, size), start)

def recompute_stale_reads(request: Any, block_ids: Sequence[int] | None, stale_reads: Collection[int], block_size: int) -> None:
    """Moves a tainted request's computed tokens (vLLM's ``Request``) back
    to the first token of the first block of ``block_ids`` among
    ``stale_reads``, where it still counts one as computed. vLLM rewinds
    only the first request holding a reported block: one left counting it
    would read it again, and be reported again, at every step another
    request rewrites it in chunks, each report rewinding that writer too,
    and none would finish. Nothing where it holds none (preempted, or
    rewound before them)."""
    first = next((index for index, block_id in enumerate(block_ids or ()) if block_id in stale_reads), None)
    if first is not None and request.num_computed_tokens > first * block_size:
        request.num_computed_tokens = first * block_size
