"""``admit_after: "auto"``: store every chain while the engine's work is
reused, and only chains seen twice while it is not.

Storing a block that is never read again is pure cost (the writer's copy,
encode and commit: the no-reuse tax). :class:`AutoThreshold` watches the
**reuse share**: of the blocks of the requests the scheduler plans saves for,
the fraction that were seen before, either found stored by the request's
lookup (loaded from ucm-db, or held by vLLM's own cache and stored) or counted
by the admission's sighting sketch (computed again since an earlier sighting).
It sets the admission threshold that
:class:`~ucm_db.connector.admission.Admission` applies: 1 (store from
the first sighting) or 2 (from the second).

Invariants:
    * The threshold starts at 1 and stays there until
      :data:`MIN_EVIDENCE_BLOCKS` blocks were observed; then it moves to 2
      when the share falls below :data:`LOW_SHARE` and back to 1 when it
      reaches :data:`HIGH_SHARE` (a gap, so it does not flap around one
      value). The sketch counts sightings at either threshold, so a
      prefix seen a second time raises the share whatever the threshold
      is: a workload whose prefixes come back turns storing on again.
    * The share is a block-weighted mean whose weights halve every
      :data:`HALF_LIFE_BLOCKS` blocks observed: recent traffic counts, a
      burst of unique prompts an hour ago does not.
    * Only the threshold changes; admission still only shortens a
      request's saves to a prefix of its chain (admission.py), so
      what is stored keeps the parent-before-child invariant.
    * Imports no vLLM (the settings and tests use it in any process).
"""

from __future__ import annotations

import logging

#: Blocks observed before the threshold may leave 1 (a few dozen prompts).
MIN_EVIDENCE_BLOCKS = 1024
#: Blocks after which an observation weighs half as much.
HALF_LIFE_BLOCKS = 2048
#: Below this reuse share, chains are stored from their second sighting.
LOW_SHARE = 0.05
#: At or above this share, every chain is stored again.
HIGH_SHARE = 0.10

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handler prints it


class AutoThreshold:
    """The admission threshold of ``admit_after: "auto"`` (module invariants)."""

    def __init__(self) -> None:
        self.threshold = 1
        self._reused = 0.0  # decayed block counts
        self._blocks = 0.0
        self._observed_blocks = 0  # undecayed, for the evidence floor

    @property
    def share(self) -> float:
        """The decayed reuse share (0.0 before any observation)."""
        return self._reused / self._blocks if self._blocks else 0.0

    def observe(self, reused_blocks: int, blocks: int) -> int:
        """Takes ``blocks`` newly considered blocks of a request, of which
        ``reused_blocks`` were seen before; returns the threshold now in
        force (logged when it moves)."""
        if blocks <= 0:
            return self.threshold
        decay = 0.5 ** (blocks / HALF_LIFE_BLOCKS)
        self._reused = self._reused * decay + min(reused_blocks, blocks)
        self._blocks = self._blocks * decay + blocks
        self._observed_blocks += blocks
        if self._observed_blocks < MIN_EVIDENCE_BLOCKS:
            return self.threshold
        share = self.share
        if self.threshold == 1 and share < LOW_SHARE:
            self._move(2, share)
        elif self.threshold == 2 and share >= HIGH_SHARE:
            self._move(1, share)
        return self.threshold

    def _move(self, threshold: int, share: float) -> None:
        self.threshold = threshold
        if threshold == 2:
            logger.info("ucm-db: admit_after auto: %.1f%% of recent blocks were seen before (below %.0f%%): chains are "
                        "stored from their second sighting", 100 * share, 100 * LOW_SHARE)
        else:
            logger.info("ucm-db: admit_after auto: %.1f%% of recent blocks were seen before (%.0f%% or more): every "
                        "chain is stored again", 100 * share, 100 * HIGH_SHARE)
