"""How often each block key was seen, for ``admit_after`` (admission.py).

Invariants:
    * The memory is fixed (:data:`SKETCH_DEPTH` rows of
      :data:`SKETCH_WIDTH` one-byte counters, 16 MiB, touched as counters are).
    * A key's count never undercounts its sightings within the window
      (:data:`SKETCH_HALVE_EVERY` sightings); it may overcount.
    * Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Count-min sketch rows (one 4-byte slice of the block key each: keys are blake2b digests).
SKETCH_DEPTH = 4
#: One-byte counters per row (a power of two).
SKETCH_WIDTH = 1 << 22
#: Sightings between two halvings of every counter (the sketch's window).
SKETCH_HALVE_EVERY = SKETCH_WIDTH // 4


class SightingSketch:
    """How often each block key was seen: a count-min sketch of
    :data:`SKETCH_DEPTH` x :data:`SKETCH_WIDTH` saturating one-byte counters
    (16 MiB), every counter halved each :data:`SKETCH_HALVE_EVERY`
    sightings, so a key seen once is forgotten within one window and old
    counts fade. A count is never below the key's sightings in the window;
    it is above when each row's counter was hit by other keys too: with
    ``n`` keys sighted since the last halving, a never-seen key reads at
    least 1 with odds about ``(1 - exp(-n / SKETCH_WIDTH)) ** SKETCH_DEPTH``:
    0.24% just before a halving (``n`` a quarter of the width), less after."""

    def __init__(self, width: int = SKETCH_WIDTH, depth: int = SKETCH_DEPTH, halve_every: int = SKETCH_HALVE_EVERY) -> None:
        if width & (width - 1) or not 1 <= depth <= 4:
            raise ValueError("width must be a power of two and depth in [1, 4]")
        self._mask = width - 1
        self._depth = depth
        self._rows = np.arange(depth)[None, :]
        self._table = np.zeros((depth, width), dtype=np.uint8)  # zero pages: memory is touched as counters are
        self._halve_every = halve_every
        self._since_halving = 0

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _cells(self, keys: Sequence[bytes]) -> np.ndarray:
        """Each key's counter index in each row, shape ``(len(keys), depth)``."""
        raw = np.frombuffer(b"".join(bytes(key[:16]).ljust(16, b"\0") for key in keys), dtype="<u4").reshape(-1, 4)
        return raw[:, : self._depth] & self._mask

    def sight(self, keys: Sequence[bytes]) -> None:
        """Counts one sighting of each of ``keys`` (distinct keys: a chain's).
        Two of them sharing a counter raise it once, which keeps it at or
        above each one's own count (the only promise a count-min makes)."""
        if not keys:
            return
        cells = self._cells(keys)
        self._table[self._rows, cells] = np.minimum(self._table[self._rows, cells], 254) + 1
        self._since_halving += len(keys)
        if self._since_halving >= self._halve_every:
            self._table >>= 1
            self._since_halving = 0

    def counts(self, keys: Sequence[bytes]) -> np.ndarray:
        """Each key's sightings (the least of its counters)."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        return self._table[self._rows, self._cells(keys)].min(axis=1)
