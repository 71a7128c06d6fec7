"""The writer's provisional tags: voidable saves' units survive its death
only as a sweep's.

A ``kv_producer``'s voidable save (voids.py) commits before the step that
may void it. Its void lives in this process; should the process die first
(SIGKILL, a crash, an OOM kill), nobody would delete the units. So each
voidable save's put tags its units (``Store.put_segments``' ``provisional``,
the tags of one :class:`ucm_db.ProvisionalOwner` per writer), and the tags
are settled once the save's fate is known here: its void deleted the units,
its record was forgotten (no void comes), or it stored nothing. A store
that finds the owner's process gone deletes the units of every tag not
settled, with their descendants (``ucm_db/store/provisional.py``).

Invariants:
    * Each voidable save gets a new tag in each round that puts it
      (:meth:`ProvisionalTags.tag_for`); a save id's tags are settled
      together, never while a void of that id is kept for its retry (the
      wrong units are stored until it succeeds).
    * Settles are batched: one transaction at the end of a writer round
      or void; one that fails is kept and retried at the next (a tag left
      unsettled costs, should this process die, its right units: a lost
      save, never a wrong one).
    * A clean close (the writer's) settles every open tag but those of voids
      whose delete still fails, so the sweep deletes what is known wrong; a
      save whose void had not come by then stands, as it did before tags.
      Only a process that dies (no close) leaves every open tag to the sweep.
    * No owner (the store directory takes no record locks): voids work as
      before, in memory only; logged once.
    * Writer thread only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from vllm.logger import init_logger

import ucm_db

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_FAILURE_LOG_INTERVAL_S = 60.0


class ProvisionalTags:
    """One writer's provisional owner and its saves' open tags (module invariants)."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store
        self._owner: ucm_db.ProvisionalOwner | None = None
        self._no_owner = False  # making one failed: never tried again
        self._open: dict[Any, list[bytes]] = {}  # save id -> its tags not settled
        self._round: dict[Any, bytes] = {}  # save id -> its tag in the current round
        self._due: list[bytes] = []  # tags to settle at the round's end (a failed settle's too)
        self._failure_logged_s = -_FAILURE_LOG_INTERVAL_S

    def tag_for(self, save: Any) -> bytes | None:
        """The tag of ``save``'s units in this round (None: no owner)."""
        tag = self._round.get(save)
        if tag is not None:
            return tag
        owner = self._owner_or_none()
        if owner is None:
            return None
        tag = self._round[save] = owner.tag()
        self._open.setdefault(save, []).append(tag)
        return tag

    def settle(self, save: Any) -> None:
        """``save``'s fate is known here: its tags are settled at the round's end."""
        self._due.extend(self._open.pop(save, ()))

    def end_round(self) -> None:
        """Ends a writer round or void: settles the tags due, in one transaction."""
        self._round.clear()
        if not self._due or self._owner is None:
            self._due.clear()
            return
        try:
            self._owner.settle(self._due)
        except (ucm_db.UcmDbError, OSError) as exc:
            now = time.monotonic()
            if now - self._failure_logged_s >= _FAILURE_LOG_INTERVAL_S:
                self._failure_logged_s = now
                logger.warning("ucm-db: settling %d saves that stand failed (retried after the next round; should this "
                               "process die first, their blocks are deleted, not served wrong; logged at most once a "
                               "minute): %s", len(self._due), exc)
            return
        self._due.clear()

    def close(self, wrong: Iterable[Any]) -> None:
        """A clean end: settles every open tag but those of the saves in
        ``wrong`` (voided, their delete still failing), then ends the owner:
        the sweep deletes those. A save whose void might still have come
        stands, as it did before tags (module invariants)."""
        if self._owner is None:
            return
        keep = set(wrong)
        for save in [save for save in self._open if save not in keep]:
            self.settle(save)
        self.end_round()
        owner, self._owner = self._owner, None
        owner.close()

    def _owner_or_none(self) -> ucm_db.ProvisionalOwner | None:
        if self._owner is None and not self._no_owner:
            try:
                self._owner = self._store.provisional_owner()
            except (ucm_db.UcmDbError, OSError) as exc:
                self._no_owner = True
                logger.warning("ucm-db: saves a later step may void are kept in memory only (a worker that dies before "
                               "their void leaves them stored): %s", exc)
        return self._owner
