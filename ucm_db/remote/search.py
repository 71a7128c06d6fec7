"""The remote prefix search and the circuit breaker of read-through.

Invariants:
    * :func:`search_prefix` makes O(log_{F+1} n) rounds of at most
      ``fanout + 1`` parallel probes and stops, with what it knows, at the
      first round that could not answer.
    * :class:`Breaker`: open after a failure, for a backoff doubling from
      :data:`MIN_BACKOFF_S` up to :data:`MAX_BACKOFF_S`; a success closes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Parallel probes per round of the prefix search (rounds ~ log_{F+1} n).
SEARCH_FANOUT = 8
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class Breaker:
    """Circuit breaker: open after a failure, for a doubling backoff."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._backoff_s = MIN_BACKOFF_S
        self.trips = 0

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def open_for_s(self) -> float:
        """Seconds until the breaker lets requests through again (0: now)."""
        return max(0.0, self._open_until - time.monotonic())

    def failure(self) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
            self.trips += 1

    def success(self) -> None:
        with self._lock:
            self._backoff_s = MIN_BACKOFF_S
            self._open_until = 0.0


@dataclass(slots=True)
class SearchResult:
    """Outcome of a remote prefix search.

    Attributes:
        count: leading keys found present (a lower bound when ``complete``
            is False: the deadline or an error cut the search short).
        rounds: sequential round trips made.
        requests: probe requests issued.
        complete: the search ran to its end.
    """

    count: int
    rounds: int
    requests: int
    complete: bool


def search_points(lo: int, hi: int, fanout: int, first_round: bool) -> list[int]:
    """Indices to probe in ``[lo, hi)``: ``fanout`` evenly spaced points,
    plus the last index in the first round (a full hit then costs 1 round)."""
    span = hi - lo
    k = min(fanout, span)
    points = {lo + (j * span) // (k + 1) for j in range(1, k + 1)}
    if first_round:
        points.add(hi - 1)
    return sorted(p for p in points if lo <= p < hi)


def search_prefix(
    probe_many: Callable[[list[int]], list[bool] | None], n: int, *, fanout: int = SEARCH_FANOUT,
) -> SearchResult:
    """Finds how many leading items are present with parallel probes.

    ``probe_many(indices)`` returns presence per index, or None when it could
    not answer (deadline, error): the search stops with what it knows.
    Each round narrows ``[lo, hi]`` by a factor of ``fanout + 1``.
    """
    lo, hi = 0, n
    rounds = requests = 0
    while lo < hi:
        points = search_points(lo, hi, fanout, rounds == 0)
        present = probe_many(points)
        rounds += 1
        requests += len(points)
        if present is None:
            return SearchResult(lo, rounds, requests, False)
        for point, here in zip(points, present):
            if here:
                lo = max(lo, point + 1)
            else:
                hi = min(hi, point)
                break
        lo = min(lo, hi)
    return SearchResult(lo, rounds, requests, True)
