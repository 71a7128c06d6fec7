"""The deployment's admission of computed blocks (``kv_connector_extra_config``):
``save_decode`` (false: only blocks made wholly of prompt tokens are stored)
and ``admit_after`` (N: a block is stored from the Nth sighting of its
chain, counted in a :class:`SightingSketch`; ``"auto"``: N moves between 1
and 2 by the share of computed blocks seen before,
:mod:`ucm_db.connector.auto_admission`). A request's own controls
(``save: "always"`` skips the count) are :mod:`ucm_db.connector.request_controls`'.

Invariants:
    * Admission only ever shortens a request's saves to a prefix: a block
      is admitted only after every block before it, so a stored chain
      keeps the parent-before-child invariant.
    * The sketch's memory is fixed (16 MiB,
      :mod:`~ucm_db.connector.sighting_sketch`; allocated only where
      ``admit_after > 1`` or ``"auto"``) and it never undercounts a key's sightings
      within its window; it may overcount (a block admitted early, with
      the odds in :class:`SightingSketch`). It lives in the scheduler's
      memory only: a restart counts every chain from zero.
    * A ``kv_producer`` admits every block (its consumers read what it
      publishes): ``"auto"`` is 1 there, and a fixed ``admit_after`` above 1
      is refused at start (:class:`Admission`).
    * This module imports no vLLM (the settings parse it in any process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ucm_db.connector import auto_admission
from ucm_db.connector.auto_admission import AutoThreshold
from ucm_db.connector.sighting_sketch import SightingSketch
from ucm_db.config import brief_value
from ucm_db.errors import ConfigError

#: The largest ``admit_after`` (counters saturate at 255).
MAX_ADMIT_AFTER = 255
#: ``admit_after``'s adaptive setting (auto_admission.py).
AUTO = "auto"


def check_admission(save_decode: Any, admit_after: Any) -> None:
    """Validates the admission settings (raises ConfigError)."""
    if not isinstance(save_decode, bool):
        raise ConfigError(f"save_decode must be true or false, got {brief_value(save_decode)}",
                          hint="use save_decode=true (store generated tokens' blocks too: a chat's next turn holds the reply)")
    if admit_after == AUTO:
        return
    if isinstance(admit_after, bool) or not isinstance(admit_after, int) or not 1 <= admit_after <= MAX_ADMIT_AFTER:
        raise ConfigError(f"admit_after must be an integer in [1, {MAX_ADMIT_AFTER}] or \"auto\", got {brief_value(admit_after)}",
                          hint="use admit_after=1 (store every chain), 2 (store a chain from its second sighting) or "
                               "\"auto\" (2 while little of the engine's work is reused, else 1)")


class AdmissionMarks(Protocol):
    """What admission reads and moves of a request's state
    (:class:`~ucm_db.connector.scheduler.request_state.RequestState`, which imports this module)."""

    stored_blocks: int
    sighted_blocks: int
    admitted_blocks: int
    admission_checked_blocks: int


class Admission:
    """Which computed blocks of a request may be stored (``save_decode``,
    ``admit_after``; module invariants)."""

    def __init__(self, save_decode: bool = True, admit_after: int | str = 1, *, publishes: bool = False,
                 store_foreign_loads: bool = False) -> None:
        """``publishes``: a ``kv_producer``'s, whose consumers read what it
        stores while its own traffic shows no reuse: ``"auto"`` is 1 there,
        and a fixed N above 1 is refused (ConfigError: it would publish
        nothing of a prompt's first sighting, and its consumers would
        recompute it all). ``store_foreign_loads``: requests another kind
        of connector loaded are saved too (composition.py)."""
        check_admission(save_decode, admit_after)
        if publishes and admit_after != AUTO and int(admit_after) > 1:
            raise ConfigError(f"admit_after {admit_after} on a kv_producer would publish nothing of a prompt's first "
                              "sightings, so its consumers would recompute them",
                              hint='use admit_after=1 (or "auto", which is 1 on a kv_producer), or kv_role "kv_both" '
                                   "to store only chains seen again")
        self.save_decode = save_decode
        self.store_foreign_loads = store_foreign_loads
        if admit_after == AUTO and publishes:
            auto_admission.logger.info("ucm-db: admit_after \"auto\" stores every chain on a kv_producer (its consumers read them)")
            admit_after = 1
        #: ``admit_after: "auto"``'s threshold (auto_admission.py), or None for a fixed N.
        self.auto = AutoThreshold() if admit_after == AUTO else None
        self.admit_after = 1 if self.auto is not None else int(admit_after)
        self.sketch = SightingSketch() if self.auto is not None or self.admit_after > 1 else None

    def savable_end(self, end: int, prompt_blocks: int) -> int:
        """Where a request's storable blocks end, ``[0, end)`` being
        complete: without ``save_decode``, no further than its
        ``prompt_blocks`` (the blocks made wholly of prompt tokens)."""
        return end if self.save_decode else min(end, prompt_blocks)

    def decided(self, state: AdmissionMarks, start: int, end: int) -> bool:
        """True where :meth:`admit` would admit nothing to save from block
        ``start`` (the request's first unsaved one) to ``end``: the counts
        were read at this ``end`` already, refused a block, and every block
        admitted before it is saved (a preempted request saves its admitted
        blocks again). A refused block is read again once the request
        completes a block, not at every step (a decode step completes one
        in ``block_size``): with unique prompts, ``admit_after: 2``'s case,
        reading every step made the sketch the largest item of a c1
        server's scheduling work (py-spy) and its hooks 2-3x dearer a
        decode step than ``admit_after: 1``'s."""
        return (self.sketch is not None and end <= state.admission_checked_blocks
                and state.admitted_blocks < end and state.admitted_blocks <= start)

    def admit(self, state: AdmissionMarks, keys: Sequence[bytes], end: int, token_ids: Sequence[int] = (),
              *, saving: bool = True) -> int:
        """Counts the sightings of the request's blocks before ``end`` not
        counted yet (those known stored excepted) and returns where its
        admitted prefix ends (at most ``end``). Counts are read once per
        ``end`` the request reaches (:meth:`decided`). Under ``"auto"`` the
        blocks not observed yet feed its threshold first, which then
        applies to them (:meth:`_observe_reuse`), and ``token_ids`` (the
        request's) say whether its chain is one sampled at 2. A request not
        ``saving`` (``save: false``) is counted as a sighting only: it
        feeds no threshold (``"auto"`` measures the requests that plan saves)."""
        if self.sketch is None:
            return end
        before = state.sighted_blocks
        first = max(before, state.stored_blocks)
        if end > first:
            self.sketch.sight(keys[first:end])
        admitted = max(state.admitted_blocks, state.stored_blocks)
        observe = saving and self.auto is not None and end > before
        check = admitted < end and end > state.admission_checked_blocks
        # One read of the counts serves both: the sightings just counted and the blocks not admitted yet.
        low = min(first if observe else end, admitted if check else end)
        counts = self.sketch.counts(keys[low:end]) if low < end else np.zeros(0, dtype=np.uint8)
        if end > first or observe:
            state.sighted_blocks = end  # under "auto" also where every block was stored: observed once
        at_2 = self.auto is not None and self.admit_after == 2  # only there does the sample count (hashed once)
        sampled = at_2 and auto_admission.sampled(token_ids)
        if observe:
            self.admit_after = self._observe_reuse(state.stored_blocks, counts[first - low:], before, end, sampled)
            if not at_2 and self.admit_after == 2:  # these blocks moved it to 2: they are admitted at 2
                sampled = auto_admission.sampled(token_ids)
        if self.admit_after == 1 or sampled:
            admitted = max(admitted, end)  # no count can refuse a block (a sampled chain: auto_admission.py)
        elif check:
            refused = np.flatnonzero(counts[admitted - low:] < self.admit_after)
            admitted = end if not len(refused) else admitted + int(refused[0])
            state.admission_checked_blocks = end
        state.admitted_blocks = admitted
        return min(admitted, end)

    def _observe_reuse(self, stored_blocks: int, sighted_counts: np.ndarray, before: int, end: int,
                       sampled: bool) -> int:
        """Feeds ``admit_after: "auto"`` a request's blocks ``[before,
        end)``, observed once each: those below ``stored_blocks`` were found
        stored (reused); of those just sighted (``sighted_counts``, their
        counts after this sighting) a count of 2 or more was seen before.
        ``sampled``: the chain is stored from its first sighting at 2.
        Returns the threshold in force."""
        assert self.auto is not None
        stored = max(0, min(stored_blocks, end) - before)
        seen = int(np.count_nonzero(sighted_counts >= 2))
        return self.auto.observe(stored + seen, end - before, sampled=sampled)

