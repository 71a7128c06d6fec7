"""Paired warm passes for ``ucm-db bench serve --paired``: the warm bound
and ucm-db's second pass measured in turns, both servers up.

On this 2-core host one server's passes spread by up to 14% (the host's
other work comes and goes), so two rows measured minutes apart compare the
host's moods as much as the servers. With ``--paired`` the bound's server
and ucm-db's server stay up together after their first passes, and their
warm passes alternate in the order ABBA BAAB...: each ratio is one pass of
ucm-db over the bound's pass next to it, and the row's figure is the median
of those ratios.

Invariants:
    * The paired passes start once both servers are idle (:func:`wait_idle`:
      ucm-db's first pass leaves saves to commit), so neither server's
      leftover work lands in the other's pass.
    * Each paired pass starts once the other server is idle too
      (:data:`QUIET_WINDOW_S`): after its last step of a pass, vLLM's
      worker spins on its message queue for a second (``shm_broadcast``'s
      busy loop) on the core both servers' model threads are bound to. A
      pass started meanwhile lost about a second of its model thread:
      2026-12-03, conversation workload, every ucm-db pass that followed a
      bound pass at once and stalled (p99 TTFT ~1 s) had the bound
      server's worker using 12.5-14.1% of a core during it (1.3-1.9% in
      the others). One server is what a user runs: the pair measures each
      alone.
    * Pair ``k`` runs the bound first when ``k`` is even and ucm-db first
      when it is odd, so a steady drift in the host's load favours neither.
    * Each paired pass records the CPU seconds the other, idle server's
      process group used meanwhile (``other_server_cpu_s``): a figure that
      says whether the waiting server took anything from the measured one.
    * :func:`paired_ratios` divides pass ``k`` of ucm-db by pass ``k`` of
      the bound, the two passes of one pair.
    * A pair is *disturbed* where either pass's CPUs spent more than
      ``DISTURBED_UNTRACED_SHARE`` of a core on work no traced thread did
      (thread_trace's ``(host) untraced`` row: other processes on the
      machine, the kernel, the other server; ``(other)`` rows name them):
      such a pass stalled ~1 s with the model thread runnable. The row's figure stays the
      median of every pair; the undisturbed pairs' median is reported
      beside it, never instead.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_db.tools.bench import host_trace
from ucm_db.tools.bench.serve_server import Server, ServerSpec

#: The two rows a pair holds, and what a run without one of them is told.
PAIR_ROWS = frozenset({"warm-bound", "ucm-second"})
MISSING_PAIR = "pairs a warm-bound pass with a ucm-second pass: --rows must name both"
#: Clock ticks per second of ``/proc/PID/stat``'s CPU times.
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_group_stats(pgid: int, proc: Path = Path("/proc")) -> dict[int, list[str]]:
    """The live processes of process group ``pgid``, each with its
    ``/proc/PID/stat`` fields after the command name (``state ppid pgrp ...
    utime stime ...``); empty where ``/proc`` cannot say (another OS)."""
    return {pid: fields for pid, (_, fields) in host_trace.process_stats(proc).items() if int(fields[2]) == pgid}


def process_group_cpu_s(pgid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) used so far by the live processes of
    process group ``pgid``; 0.0 where ``/proc`` cannot say (another OS)."""
    ticks = sum(int(f[11]) + int(f[12]) for f in process_group_stats(pgid, proc).values())
    return ticks / _TICKS_PER_S


#: The window over which the other server must stay idle before a paired
#: pass (:func:`wait_idle`'s share of a core: 5%): longer than vLLM's
#: one-second busy loop after a worker's last message.
QUIET_WINDOW_S = 1.5


def wait_idle(cpu_s: Callable[[], float], *, window_s: float = 2.0, idle_share: float = 0.05, timeout_s: float = 180.0,
              sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> float:
    """Waits until ``cpu_s()`` (a server's CPU seconds so far) grows by less
    than ``idle_share`` of a core over a ``window_s`` window, or
    ``timeout_s`` has passed; returns the seconds waited. A server that has
    just run a first pass may still be committing its saves: a pass of the
    other server measured meanwhile would pay for them."""
    started = clock()
    before = cpu_s()
    while clock() - started < timeout_s:
        sleep(window_s)
        now = cpu_s()
        if now - before < idle_share * window_s:
            break
        before = now
    return round(clock() - started, 1)


def pair_order(pair: int) -> tuple[str, str]:
    """Which row of pair ``pair`` runs first: ABBA (see the module invariants)."""
    return ("warm-bound", "ucm-second") if pair % 2 == 0 else ("ucm-second", "warm-bound")


def paired_passes(
    passes: int, run_pass: Callable[[str], dict[str, Any]], group_cpu_s: Callable[[str], float],
    wait_quiet: Callable[[str], float] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``passes`` pairs of warm passes: ``run_pass(row)`` runs one pass of
    ``row`` (``warm-bound`` or ``ucm-second``) and returns its figures;
    ``group_cpu_s(row)`` reads the CPU seconds of ``row``'s server so far;
    ``wait_quiet(row)``, where given, waits until ``row``'s server is idle
    and returns the seconds waited: it runs for the other server before
    each pass (module invariants). Returns each row's passes in pair order,
    each with the other server's CPU seconds during it
    (``other_server_cpu_s``) and the wait for it (``other_server_wait_s``)."""
    out: dict[str, list[dict[str, Any]]] = {"warm-bound": [], "ucm-second": []}
    for pair in range(passes):
        for row in pair_order(pair):
            other = "ucm-second" if row == "warm-bound" else "warm-bound"
            waited_s = wait_quiet(other) if wait_quiet is not None else 0.0
            before_s = group_cpu_s(other)
            result = run_pass(row)
            result["other_server_cpu_s"] = round(group_cpu_s(other) - before_s, 3)
            result["other_server_wait_s"] = waited_s
            out[row].append(result)
    return out


def paired_ratios(bound: list[dict[str, Any]], ucm: list[dict[str, Any]]) -> list[float]:
    """ucm-db's request throughput over the bound's, pair by pair."""
    if len(bound) != len(ucm):
        raise ValueError(f"{len(ucm)} ucm-db passes against {len(bound)} bound passes: pairs need one of each")
    return [round(u["request_throughput"] / b["request_throughput"], 4) for b, u in zip(bound, ucm)]


#: Untraced CPU (a share of one core over a pass) above which a pass is
#: disturbed: quiet passes on the 2-core host showed 1.6-3.4%, the passes
#: with a ~1 s stall 15.1-15.7% (2026-12-03, conversation workload).
DISTURBED_UNTRACED_SHARE = 0.08


def untraced_share(result: dict[str, Any]) -> float | None:
    """The pass's ``(host) untraced`` share of a core, or None where the
    pass was not traced."""
    return next((r["cpu_share"] for r in result.get("threads", ()) if r.get("process") == "(host)"
                 and r.get("thread") == "untraced"), None)


def quiet_pairs(bound: list[dict[str, Any]], ucm: list[dict[str, Any]]) -> list[int]:
    """The pairs neither of whose passes was disturbed (module invariants)."""
    def quiet(result: dict[str, Any]) -> bool:
        share = untraced_share(result)
        return share is None or share <= DISTURBED_UNTRACED_SHARE
    return [k for k, (b, u) in enumerate(zip(bound, ucm)) if quiet(b) and quiet(u)]


def throughput_ratio(row: dict[str, Any], base: dict[str, Any]) -> tuple[float, bool]:
    """A row's request throughput against its bound's, and whether it was
    paired: the median of the pairs' ratios where the row has them
    (``--paired``), else the ratio of the two rows' figures."""
    if "paired_ratios" in row:
        return statistics.median(row["paired_ratios"]), True
    return row["request_throughput"] / base["request_throughput"], False


def paired_rows(
    bound: ServerSpec, ucm: ServerSpec, passes: int, want: set[str], open_server: Callable[[ServerSpec, str], Server],
    run_pass: Callable[[Server, str], dict[str, Any]], repeated_row: Callable[[list[dict[str, Any]]], dict[str, Any]],
    progress: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """The bound's server (``cold-bound``, its first pass) and ucm-db's
    (``ucm-first``) started in turn and kept up, then ``passes`` pairs of
    ``warm-bound`` and ``ucm-second``. ``open_server(spec, label)`` makes a
    server (entered here), ``run_pass(server, row)`` runs one pass,
    ``repeated_row`` folds a row's passes. First rows not in ``want`` run
    all the same (a warm row needs a warm server) and are left out.
    ``ucm-second`` carries ``paired_ratios``."""
    rows: dict[str, dict[str, Any]] = {}
    servers: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        for label, spec, first_row, warm_row in (("bound", bound, "cold-bound", "warm-bound"),
                                                 ("ucm", ucm, "ucm-first", "ucm-second")):
            named = " (vLLM's no-op connector)" if spec.transfer is not None else ""
            progress(f"starting the server for {label}{named} (kept up for paired warm passes)")
            server = stack.enter_context(open_server(spec, label))
            progress(f"  healthy after {server.start_s:.0f} s")
            servers[warm_row] = server
            first = run_pass(server, first_row)
            if first_row in want:
                rows[first_row] = {**first, "server_start_s": server.start_s}
        for row, server in servers.items():  # the first passes' saves committed, the servers quiet
            waited_s = wait_idle(lambda: process_group_cpu_s(server.pgid))
            progress(f"  {row}'s server idle after {waited_s:.0f} s")
        by_row = paired_passes(passes, lambda row: run_pass(servers[row], row),
                               lambda row: process_group_cpu_s(servers[row].pgid),
                               lambda row: wait_idle(lambda: process_group_cpu_s(servers[row].pgid), window_s=QUIET_WINDOW_S))
    for row, row_passes in by_row.items():
        rows[row] = {**repeated_row(row_passes), "server_start_s": servers[row].start_s}
    ratios = rows["ucm-second"]["paired_ratios"] = paired_ratios(by_row["warm-bound"], by_row["ucm-second"])
    progress("  paired ratios ucm-second / warm-bound: " + ", ".join(f"{r:.3f}" for r in ratios))
    quiet = quiet_pairs(by_row["warm-bound"], by_row["ucm-second"])
    if len(quiet) < len(ratios):
        kept = rows["ucm-second"]["quiet_paired_ratios"] = [ratios[k] for k in quiet]
        rest = f"{statistics.median(kept):.3f}" if kept else "none left"
        progress(f"  {len(ratios) - len(quiet)} of {len(ratios)} pairs disturbed by work outside the servers (untraced CPU "
                 f"> {DISTURBED_UNTRACED_SHARE:.0%} of a core in a pass); median of the others: {rest}")
    return rows
