"""How fast the store's background threads hand the GIL back to the engine.

The connector's threads (the writer's commits, the maintenance thread's
recency writes, uploads) run Python beside the engine's own thread, and
CPython lets a thread that holds the GIL keep it for a whole switch
interval (5 ms by default) while another waits for it. Every time the
model's thread comes back from a torch kernel while one of them runs, it
can wait up to that long: on the 2-core hosts measured, loads on the
model's thread ran at 1.9 GB/s while the maintenance thread wrote recency
and at 2.4-3.4 GB/s with a 0.5 ms interval (BENCHMARKS.md, Serving).

Invariants:
    * The connector only ever shortens the interval (``switch_interval_s``,
      default :data:`DEFAULT_SWITCH_INTERVAL_S`); a host that set a shorter
      one keeps it, and 0 leaves the interval alone.
    * It is set once per process, when the connector is made, and logged.
"""

from __future__ import annotations

import sys

#: The connector's default: short enough that a waiting engine thread gets
#: the GIL within half a millisecond, long enough that switches cost nothing
#: measurable (a switch is a few microseconds).
DEFAULT_SWITCH_INTERVAL_S = 0.0005
#: Longest interval the option accepts (Python's default is 0.005).
MAX_SWITCH_INTERVAL_S = 0.1


def shorten_switch_interval(seconds: float) -> float | None:
    """Sets Python's thread switch interval to ``seconds`` if that is
    shorter than the current one; returns the interval it replaced (None:
    left alone, as for 0)."""
    if seconds <= 0:
        return None
    current = sys.getswitchinterval()
    if seconds >= current:
        return None
    sys.setswitchinterval(seconds)
    return current
