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
    * At threshold 2, one chain in :data:`SAMPLE_ONE_IN` is still stored
      from its first sighting: the chains whose first
      :data:`SAMPLE_ROOT_TOKENS` token ids :func:`sampled` picks, the same
      chains on every engine and in every KV cache group of a hybrid model
      (whose groups key the same tokens apart: a chain some groups stored
      and others not would serve no hit). Reuse that only
      another engine, or this one after a restart, would see (a chain
      computed once here and read later elsewhere) is invisible to the
      sketch, but is found stored for the sampled chains; their own share
      (:attr:`AutoThreshold.sampled_share`, from :data:`MIN_SAMPLED_BLOCKS`
      sampled blocks on) reaching :data:`HIGH_SHARE` moves the threshold
      back to 1 and becomes the share. So engines sharing a store never all
      stop storing what they read from each other; the cost is a
      :data:`SAMPLE_ONE_IN`-th of threshold 1's writes while nothing is
      reused.
    * Only the threshold changes (and a sampled chain is admitted whole
      at 2); admission still only shortens a request's saves to a prefix
      of its chain (admission.py), so what is stored keeps the
      parent-before-child invariant.
    * Imports no vLLM (the settings and tests use it in any process).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import numpy as np

#: Blocks observed before the threshold may leave 1 (a few dozen prompts).
MIN_EVIDENCE_BLOCKS = 1024
#: Blocks after which an observation weighs half as much.
HALF_LIFE_BLOCKS = 2048
#: Below this reuse share, chains are stored from their second sighting.
LOW_SHARE = 0.05
#: At or above this share, every chain is stored again.
HIGH_SHARE = 0.10
#: At threshold 2, one chain in this many is stored from its first sighting (module invariants).
SAMPLE_ONE_IN = 16
#: Sampled blocks observed at threshold 2 before their share alone may move it back to 1.
MIN_SAMPLED_BLOCKS = 256
#: Leading token ids that decide whether a chain is sampled (a request holding fewer is not sampled until it
#: holds them: with blocks of under 16 tokens its first blocks may be refused until then, never stored with a gap).
SAMPLE_ROOT_TOKENS = 16

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handler prints it


def sampled(token_ids: Sequence[int]) -> bool:
    """Whether the chain of a request whose token ids begin with
    ``token_ids`` is stored from its first sighting at threshold 2 (module
    invariants): the same answer on every engine, for one chain in
    :data:`SAMPLE_ONE_IN`, decided by its first :data:`SAMPLE_ROOT_TOKENS`
    ids (fewer: not sampled)."""
    if len(token_ids) < SAMPLE_ROOT_TOKENS:
        return False
    root = np.asarray(token_ids[:SAMPLE_ROOT_TOKENS], dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(root, digest_size=8).digest(), "little") % SAMPLE_ONE_IN == 0


class DecayedShare:
    """A block-weighted share whose weights halve every
    :data:`HALF_LIFE_BLOCKS` blocks added."""

    def __init__(self) -> None:
        self.reused = 0.0  # decayed block counts
        self.blocks = 0.0
        self.observed_blocks = 0  # undecayed, for the evidence floors

    @property
    def share(self) -> float:
        """The decayed share (0.0 before any observation)."""
        return self.reused / self.blocks if self.blocks else 0.0

    def add(self, reused_blocks: int, blocks: int) -> None:
        decay = 0.5 ** (blocks / HALF_LIFE_BLOCKS)
        self.reused = self.reused * decay + min(reused_blocks, blocks)
        self.blocks = self.blocks * decay + blocks
        self.observed_blocks += blocks


class AutoThreshold:
    """The admission threshold of ``admit_after: "auto"`` (module invariants)."""

    def __init__(self) -> None:
        self.threshold = 1
        self._all = DecayedShare()
        self._sampled = DecayedShare()  # the sampled chains' blocks observed at threshold 2

    @property
    def share(self) -> float:
        """The decayed reuse share (0.0 before any observation)."""
        return self._all.share

    @property
    def sampled_share(self) -> float:
        """The sampled chains' share at threshold 2 (0.0 at threshold 1)."""
        return self._sampled.share

    def observe(self, reused_blocks: int, blocks: int, *, sampled: bool = False) -> int:
        """Takes ``blocks`` newly considered blocks of a request, of which
        ``reused_blocks`` were seen before (``sampled``: its chain is one
        :func:`sampled` picks); returns the threshold now in force (logged
        when it moves)."""
        if blocks <= 0:
            return self.threshold
        self._all.add(reused_blocks, blocks)
        if self.threshold == 2 and sampled:
            self._sampled.add(reused_blocks, blocks)
        if self._all.observed_blocks < MIN_EVIDENCE_BLOCKS:
            return self.threshold
        share = self.share
        if self.threshold == 1 and share < LOW_SHARE:
            self._sampled = DecayedShare()
            self._move(2, share)
        elif self.threshold == 2 and share >= HIGH_SHARE:
            self._move(1, share)
        elif (self.threshold == 2 and self._sampled.observed_blocks >= MIN_SAMPLED_BLOCKS
              and self._sampled.share >= HIGH_SHARE):
            self._all, self._sampled = self._sampled, DecayedShare()  # the sample's estimate stands for all
            self._move(1, self.share, " of the chains still stored at 2 (by this engine or another)")
        return self.threshold

    def _move(self, threshold: int, share: float, which: str = "") -> None:
        self.threshold = threshold
        if threshold == 2:
            logger.info("ucm-db: admit_after auto: %.1f%% of recent blocks were seen before (below %.0f%%): chains are "
                        "stored from their second sighting (one in %d from its first)", 100 * share, 100 * LOW_SHARE,
                        SAMPLE_ONE_IN)
        else:
            logger.info("ucm-db: admit_after auto: %.1f%% of recent blocks%s were seen before (%.0f%% or more): every "
                        "chain is stored again", 100 * share, which, 100 * HIGH_SHARE)
