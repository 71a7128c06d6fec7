"""Where a serving pass's CPU goes, thread by thread (Linux ``/proc``).

A pass of ``ucm-db bench serve`` runs a server (API process, engine core,
the connector's threads and commit process) and this benchmark's client on
a host of few cores. When ucm-db's work slows the server down, the
question is whose time it took: the model thread's run-queue wait grows
when another thread shares its core; a thread bound to the spare core
delays whatever else needs that core. :func:`snapshot` reads, for every
thread of the given processes, its CPU time and its run-queue wait
(``/proc/PID/task/TID/schedstat``: nanoseconds on a CPU, nanoseconds
waiting for one, time slices) and the CPUs it may run on; :func:`diff`
turns two snapshots around a pass into rows, busiest first.

Invariants:
    * A row's ``cpu_s`` and ``wait_s`` are what the thread used between the
      two snapshots; a thread born after the first counts from zero, one
      gone before the second is absent (its time is lost, not guessed).
    * Rows are keyed by process, thread name and allowed CPUs, summed over
      threads alike (vLLM's and Python's pools name their threads alike),
      so two passes' rows can be set side by side.
    * Nothing here alters the traced processes: it only reads ``/proc``.
    * A virtual machine's host may take a CPU away (steal, ``/proc/stat``):
      a thread runnable meanwhile counts that time as wait, though no
      thread of the guest ran. :func:`trace_pass` adds rows per CPU
      (process ``(host)``): ``busy``, the share of the pass the CPU ran
      anything (these threads, other processes, the kernel's own), and
      ``steal`` where the host took some, and ``untraced``, the busy time
      no traced thread used, so a pass slowed by the host or by work
      outside the traced processes is told from one slowed by a traced
      thread. It then names the rest (:mod:`.host_trace`): the other
      processes' and kernel threads' CPU by name (process ``(other)``) and
      the kernel's pressure stalls (process ``(pressure)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ucm_db.tools.bench import host_trace
from ucm_db.tools.bench.serve_paired import process_group_stats

PROC = Path("/proc")


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters at one moment."""

    process: str  # the process's name: its command's short form
    thread: str  # the thread's comm (15 characters at most)
    cpu_ns: int
    wait_ns: int  # time runnable but not running: another thread held its CPU
    slices: int
    cpus: str  # Cpus_allowed_list


def process_group(pgid: int, proc: Path = PROC) -> list[int]:
    """The live processes of process group ``pgid``."""
    return list(process_group_stats(pgid, proc))


def process_name(pid: int, proc: Path = PROC) -> str:
    """A short name for ``pid``: ``python -m X`` -> X; a vLLM engine core's
    title (``VLLM::EngineCore``) as it set it; else the program's name."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        comm = (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    if words and words[0].startswith("VLLM::"):
        return words[0]
    if len(words) > 1 and os.path.basename(words[0]).startswith("python") and not words[1].startswith("-"):
        return os.path.basename(words[1])
    return comm


def _thread(pid: int, tid: int, process: str, proc: Path) -> ThreadSample | None:
    task = proc / str(pid) / "task" / str(tid)
    try:
        run_ns, wait_ns, slices = ((task / "schedstat").read_text().split() + ["0", "0", "0"])[:3]
        comm = (task / "comm").read_text().strip()
        cpus = next((line.split(":", 1)[1].strip() for line in (task / "status").read_text().splitlines()
                     if line.startswith("Cpus_allowed_list:")), "?")
    except OSError:
        return None  # the thread ended meanwhile
    return ThreadSample(process, comm, int(run_ns), int(wait_ns), int(slices), cpus)


def snapshot(pids: Iterable[int], proc: Path = PROC) -> dict[tuple[int, int], ThreadSample]:
    """Every live thread of ``pids``, keyed by (pid, tid)."""
    out: dict[tuple[int, int], ThreadSample] = {}
    for pid in pids:
        name = process_name(pid, proc)
        try:
            tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            sample = _thread(pid, tid, name, proc)
            if sample is not None:
                out[(pid, tid)] = sample
    return out


#: The share of a core (CPU or wait) under which a thread's row is left out.
SHOWN_SHARE = 0.005


def diff(before: dict[tuple[int, int], ThreadSample], after: dict[tuple[int, int], ThreadSample],
         wall_s: float, min_share: float = SHOWN_SHARE, by_thread: bool = False) -> list[dict[str, Any]]:
    """Rows of what each (process, thread name, CPUs) used between ``before``
    and ``after`` (each thread apart with ``by_thread``): CPU and run-queue
    wait in seconds and as shares of ``wall_s``; rows under ``min_share``
    of a core in both are dropped. Busiest first."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, now in after.items():
        then = before.get(key)
        cpu_ns = now.cpu_ns - (then.cpu_ns if then else 0)
        wait_ns = now.wait_ns - (then.wait_ns if then else 0)
        group = (now.process, now.thread, now.cpus) + (key if by_thread else ())
        row = rows.setdefault(group, {"process": now.process, "thread": now.thread, "threads": 0,
                                                          "cpu_s": 0.0, "wait_s": 0.0, "cpus": now.cpus})
        row["threads"] += 1
        row["cpu_s"] += cpu_ns / 1e9
        row["wait_s"] += wait_ns / 1e9
    out = []
    for row in rows.values():
        row["cpu_share"] = round(row["cpu_s"] / wall_s, 4) if wall_s > 0 else 0.0
        row["wait_share"] = round(row["wait_s"] / wall_s, 4) if wall_s > 0 else 0.0
        if max(row["cpu_share"], row["wait_share"]) >= min_share:
            row["cpu_s"], row["wait_s"] = round(row["cpu_s"], 4), round(row["wait_s"], 4)
            out.append(row)
    return sorted(out, key=lambda r: -r["cpu_s"])


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a small table (share of one core: CPU, run-queue wait)."""
    lines = [f"    {'process':<28} {'thread':<16} {'n':>3} {'cpu':>6} {'wait':>6}  cpus"]
    for r in rows:
        lines.append(f"    {r['process'][:28]:<28} {r['thread'][:16]:<16} {r['threads']:>3} {r['cpu_share']:>6.1%} "
                     f"{r['wait_share']:>6.1%}  {r['cpus']}")
    return "\n".join(lines)


def cpu_ticks(proc: Path = PROC) -> dict[str, tuple[int, int]]:
    """Clock ticks each CPU spent busy (user, nice, system, irq, softirq)
    and taken by the host (steal) so far, by CPU number (``/proc/stat``);
    empty where it cannot say."""
    out: dict[str, tuple[int, int]] = {}
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(values) > 7:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
            out[name[3:]] = (user + nice + system + irq + softirq, steal)
    return out


def cpu_rows(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], wall_s: float,
             min_share: float = 0.005) -> list[dict[str, Any]]:
    """Rows of each CPU between the two readings (process ``(host)``):
    ``busy`` always, ``steal`` where the host took at least ``min_share``;
    ``cpu_share`` is the share of the pass."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    rows = []
    for cpu, (busy, steal) in after.items():
        busy_then, steal_then = before.get(cpu, (busy, steal))
        for what, ticks, floor in (("busy", busy - busy_then, 0.0), ("steal", steal - steal_then, min_share)):
            seconds = ticks / ticks_per_s
            share = round(seconds / wall_s, 4) if wall_s > 0 else 0.0
            if share >= floor:
                rows.append({"process": "(host)", "thread": what, "threads": 0, "cpu_s": round(seconds, 4),
                             "wait_s": 0.0, "cpus": cpu, "cpu_share": share, "wait_share": 0.0})
    return rows


def trace_pass(pgid: int, send: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs ``send()``, a pass that returns its figures with its
    ``duration`` in seconds, and adds ``threads``: the rows of what each
    thread of process group ``pgid`` (a server) and of this process (the
    client) used meanwhile, then each CPU's busy time and steal (module
    doc), and the other processes' rows and the pressure stalls
    (:mod:`.host_trace`)."""
    pids = [*process_group(pgid), os.getpid()]
    before, ticks = snapshot(pids), cpu_ticks()
    others, stalls, irqs = host_trace.other_ticks(pids), host_trace.pressure_us(), host_trace.interrupt_ticks()
    result = send()
    wall_s = float(result["duration"])
    pids_after = {*pids, *process_group(pgid)}
    after, ticks_after = snapshot(pids_after), cpu_ticks()
    others_after, stalls_after, irqs_after = host_trace.other_ticks(pids_after), host_trace.pressure_us(), host_trace.interrupt_ticks()
    hosts = cpu_rows(ticks, ticks_after, wall_s)
    traced = diff(before, after, wall_s, min_share=0.0)  # every thread: what untraced_row subtracts
    shown = [r for r in traced if max(r["cpu_share"], r["wait_share"]) >= SHOWN_SHARE]
    result["threads"] = (shown + hosts + untraced_row(traced, hosts, wall_s)
                         + host_trace.other_rows(others, others_after, wall_s)
                         + host_trace.interrupt_rows(irqs, irqs_after, wall_s)
                         + host_trace.pressure_rows(stalls, stalls_after, wall_s))
    return result


def untraced_row(threads: list[dict[str, Any]], hosts: list[dict[str, Any]], wall_s: float) -> list[dict[str, Any]]:
    """One row (process ``(host)``, thread ``untraced``) of the CPU time
    the CPUs were busy beyond what the traced threads used: other
    processes on the machine (a container sees the whole machine's
    ``/proc/stat``) and the kernel's own threads; empty where no CPU
    reported its busy time."""
    busy = [r["cpu_s"] for r in hosts if r["thread"] == "busy"]
    if not busy or wall_s <= 0:
        return []
    seconds = max(0.0, sum(busy) - sum(r["cpu_s"] for r in threads))
    return [{"process": "(host)", "thread": "untraced", "threads": 0, "cpu_s": round(seconds, 4), "wait_s": 0.0,
             "cpus": "all", "cpu_share": round(seconds / wall_s, 4), "wait_share": 0.0}]


def shown(rows: list[dict[str, Any]]) -> str:
    """The rows as lines to print after a pass's progress line, where
    ``UCM_DB_BENCH_THREADS=1``; else nothing."""
    return "\n" + format_rows(rows) if os.environ.get("UCM_DB_BENCH_THREADS") == "1" else ""
