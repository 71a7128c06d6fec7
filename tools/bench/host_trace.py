"""What the rest of the machine did during a serving pass (Linux ``/proc``).

:mod:`.thread_trace` accounts for every thread of the server and the client,
and its ``(host) untraced`` row for the busy CPU time none of them used.
This module names that time and what else stalls a pass:

* :func:`process_stats` reads every process's ``/proc/PID/stat`` (the
  paired benchmarks' process-group CPU reads it too);
  :func:`other_ticks` takes the CPU time of every other process and kernel
  thread (``/proc/PID/stat``: user and system ticks); :func:`other_rows`
  turns two readings into rows (process ``(other)``), one per name, so a
  pass disturbed by the kernel's write-back (``kworker``, ``jbd2``), its
  page reclaim (``kswapd``, ``kdamond``: a VM host's DAMON paging out idle
  page cache) or another job is told by name.
* :func:`interrupt_ticks` reads the CPUs' time in interrupts, which no
  task is charged for (:func:`interrupt_rows`: ``irq+softirq``).
* :func:`pressure_us` reads the kernel's pressure-stall totals
  (``/proc/pressure/{cpu,io,memory}``, the ``some`` lines: time at least
  one task waited for that resource); :func:`pressure_rows` gives each as a
  share of the pass (process ``(pressure)``), where it reached
  ``min_share``.

Invariants:
    * Only reads ``/proc``; a file that is missing or unreadable (not Linux,
      a process that ended meanwhile, a kernel without PSI) gives no row,
      never an error.
    * A process first seen in the second reading counts from zero; one gone
      by then is absent (its time is lost, not guessed), as in
      :mod:`.thread_trace`. A task is matched by pid, whatever its name
      then (kernel workers rename themselves); a pid whose ticks went
      back (reused by a new task) counts from zero.
    * Rows have :mod:`.thread_trace`'s shape (``process``, ``thread``,
      ``threads``, ``cpu_s``, ``wait_s``, ``cpus``, ``cpu_share``,
      ``wait_share``), so they print and merge with its rows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

PROC = Path("/proc")
#: The pressure-stall resources read (``/proc/pressure/NAME``).
PRESSURE_RESOURCES = ("cpu", "io", "memory")

_KWORKER = re.compile(r"^kworker/[^-]*(?:-(?P<queue>.+))?$")


def group_name(comm: str) -> str:
    """The row a task's CPU time goes to: its ``comm``, but a kernel
    worker by the work queue it ran last (``kworker/u8:1-writeback`` and
    ``kworker/u8:3-writeback`` -> ``kworker-writeback``), since workers
    come and go and take each queue's work in turn. A worker renames
    itself as it goes, so its time between two readings goes to the
    queue it ran last: a hint at the work, not an exact split."""
    match = _KWORKER.match(comm)
    if match is None:
        return comm
    return "kworker-" + match["queue"] if match["queue"] else "kworker"


def process_stats(proc: Path = PROC) -> dict[int, tuple[str, list[str]]]:
    """Every live process (and kernel thread): its name and its
    ``/proc/PID/stat`` fields after the name (``state ppid pgrp ... utime
    stime ...``), by pid; empty where ``/proc`` cannot say."""
    out: dict[int, tuple[str, list[str]]] = {}
    try:
        entries = [entry for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return out
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        # "pid (comm) state ppid pgrp ... utime stime": comm may hold spaces
        # and parentheses, so the fields are counted from its last ')'.
        head, _, rest = stat.rpartition(")")
        fields = rest.split()
        if "(" in head and len(fields) > 12:
            out[int(entry.name)] = (head.partition("(")[2], fields)
    return out


def other_ticks(exclude: Collection[int], proc: Path = PROC) -> dict[int, tuple[str, int]]:
    """Each live process's (and kernel thread's) name and its user plus
    system clock ticks so far, by pid, but those of ``exclude``."""
    return {pid: (group_name(comm), int(fields[11]) + int(fields[12]))
            for pid, (comm, fields) in process_stats(proc).items() if pid not in exclude}


def other_rows(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], wall_s: float,
               min_share: float = 0.01) -> list[dict[str, Any]]:
    """Rows (process ``(other)``) of the CPU time each name used between the
    readings, those of at least ``min_share`` of a core; busiest first."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, list[int]] = {}
    for pid, (name, ticks) in after.items():
        then = before.get(pid)
        used = ticks - then[1] if then is not None and then[1] <= ticks else ticks  # a reused pid counts from zero
        counts = by_name.setdefault(name, [0, 0])
        counts[0] += 1
        counts[1] += max(0, used)
    rows = []
    for name, (tasks, ticks) in by_name.items():
        seconds = ticks / ticks_per_s
        share = round(seconds / wall_s, 4) if wall_s > 0 else 0.0
        if ticks and share >= min_share:
            rows.append({"process": "(other)", "thread": name, "threads": tasks, "cpu_s": round(seconds, 4),
                         "wait_s": 0.0, "cpus": "all", "cpu_share": share, "wait_share": 0.0})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def interrupt_ticks(proc: Path = PROC) -> int | None:
    """Clock ticks all CPUs spent in interrupts and soft interrupts so far
    (``/proc/stat``: no task's time, so no :func:`other_ticks` row holds
    it), or None where it cannot say."""
    try:
        first = (proc / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(first) < 8 or first[0] != "cpu":
        return None
    return int(first[6]) + int(first[7])


def interrupt_rows(before: int | None, after: int | None, wall_s: float, min_share: float = 0.01) -> list[dict[str, Any]]:
    """One row (process ``(other)``, thread ``irq+softirq``) of the
    interrupts' CPU time between the readings, where it reached ``min_share``."""
    if before is None or after is None or wall_s <= 0:
        return []
    seconds = (after - before) / os.sysconf("SC_CLK_TCK")
    share = round(seconds / wall_s, 4)
    if share < min_share:
        return []
    return [{"process": "(other)", "thread": "irq+softirq", "threads": 0, "cpu_s": round(seconds, 4), "wait_s": 0.0,
             "cpus": "all", "cpu_share": share, "wait_share": 0.0}]


def pressure_us(proc: Path = PROC) -> dict[str, int]:
    """Each resource's ``some`` stall total so far, in microseconds."""
    out = {}
    for resource in PRESSURE_RESOURCES:
        try:
            lines = (proc / "pressure" / resource).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split()
            if words and words[0] == "some":
                total = next((w.split("=", 1)[1] for w in words if w.startswith("total=")), None)
                if total is not None and total.isdigit():
                    out[resource] = int(total)
    return out


def pressure_rows(before: dict[str, int], after: dict[str, int], wall_s: float,
                  min_share: float = 0.005) -> list[dict[str, Any]]:
    """Rows (process ``(pressure)``, thread ``RESOURCE some``) of the pass's
    share in which some task stalled on the resource, where it reached
    ``min_share``; in ``wait_s``/``wait_share`` (a stall is waiting)."""
    rows = []
    for resource, total in after.items():
        seconds = (total - before.get(resource, total)) / 1e6
        share = round(seconds / wall_s, 4) if wall_s > 0 else 0.0
        if share >= min_share:
            rows.append({"process": "(pressure)", "thread": f"{resource} some", "threads": 0, "cpu_s": 0.0,
                         "wait_s": round(seconds, 4), "cpus": "all", "cpu_share": 0.0, "wait_share": share})
    return rows
