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
      pass (a failed load is reported and goes stale again); a block no
      live request holds is forgotten (its next holder writes it first).
    * Each step is judged as it is planned, where every earlier step that
      computes has its output back (vLLM's synchronous scheduling). An
      engine that plans a step before the last one's output is back (a
      pipeline's batch queue; async scheduling claims asynchronously
      anyway) is not judged: the tracker forgets its blocks, and vLLM's
      own handling is all there is (docs/connector.md). A judged step's
      request *reads* the slots before its computed tokens and writes the
      slots of its scheduled tokens whose ids are known (draft
      tokens are written again once known). vLLM writes a layer's KV for
      every token of the batch before that layer's attention reads any, so
      a slot written in the same step by a request that reads nothing stale
      is not stale to the others: the verdicts are a fixpoint over the
      step's requests. A request reading a stale slot is *tainted*: its
      output and every slot it writes in the step are wrong (those slots
      go stale).
    * A tainted request's saves are not planned (planner.py), and the step's
      metadata names every stale block a tainted request read
      (``stale_reads``): each worker reports them with its failed loads
      (``invalid_block_ids``), so vLLM skips the tainted requests' output
      of the step and rewinds them (each to its first stale block, or back
      to its computed tokens where another request is rewound to write
      it); the scheduler then rewinds each of them that still counts a
      stale block it read as computed to that block's first token
      (:func:`recompute_stale_reads`), and their save marks (hooks.py). A
      request holding such a block without reading a stale slot may be
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

    def forget_freed(self, is_free: Callable[[int], bool]) -> None:
        """Forgets the stale blocks vLLM freed (their next holder writes them first)."""
        for block_id in [b for b in self._clean_slots if is_free(b)]:
            del self._clean_slots[block_id]

    def plan(self, step: int, scheduled: Sequence[Scheduled], loaded: Iterable[int]) -> StepVerdict:
        """The step's verdict (module invariants); remembered until :meth:`output_back`."""
        for block_id in loaded:
            self._clean_slots.pop(block_id, None)
        if not self._clean_slots:
            return CLEAN_STEP
        clean = self._clean_slots
        undecided = [part for part in scheduled if self._holds_stale(part)]
        progress = True
        while progress and undecided:  # fixpoint: a right write may clean what another request reads
            progress = False
            for part in list(undecided):
                if not self._stale_read(part):
                    undecided.remove(part)
                    self._write(part, right=True)
                    progress = True
        stale_reads = sorted({block for part in undecided for block in self._stale_read(part)})
        for part in undecided:
            self._write(part, right=False)
        for block_id in [b for b, slots in clean.items() if slots >= self._block_size]:
            del clean[block_id]
        verdict = StepVerdict(tuple(stale_reads), frozenset(part.req_id for part in undecided))
        if verdict.tainted:
            self._verdicts[step] = verdict
            for old in [s for s in self._verdicts if s < step - MAX_STEPS_IN_FLIGHT]:
                del self._verdicts[old]  # a step whose output never came back (its engine step was abandoned)
        return verdict

    def output_back(self, step: int | None) -> StepVerdict:
        """The verdict of step ``step``, whose output is back (forgotten here)."""
        return self._verdicts.pop(step, CLEAN_STEP) if step is not None else CLEAN_STEP

    def _holds_stale(self, part: Scheduled) -> bool:
        end_block = -(-part.written_end // self._block_size)
        return any(block_id in self._clean_slots for block_id in part.block_ids[:end_block])

    def _stale_read(self, part: Scheduled) -> list[int]:
        """The stale blocks whose slots ``part`` reads (before its computed tokens) and that are not written right."""
        read: list[int] = []
        for index, block_id in enumerate(part.block_ids[: -(-part.computed_tokens // self._block_size)]):
            slots = self._clean_slots.get(block_id)
            if slots is not None and slots < min(self._block_size, part.computed_tokens - index * self._block_size):
                read.append(block_id)
        return read

    def _write(self, part: Scheduled, right: bool) -> None:
        """Counts ``part``'s writes: a right one extends a stale block's clean
        slots (it starts at or before their end); a wrong one cuts them."""
        size = self._block_size
        for position in range(part.computed_tokens - part.computed_tokens % size, part.written_end, size):
            index = position // size
            if index >= len(part.block_ids):
                break
            block_id = part.block_ids[index]
            start = max(part.computed_tokens, position) - position
            end = min(part.written_end, position + size) - position
            slots = self._clean_slots.get(block_id)
            if right and slots is not None and slots >= start:
                self._clean_slots[block_id] = max(slots, end)
            elif not right:
                self._clean_slots[block_id] = min(size if slots is None else slots, start)


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
