"""``ucm-db bench recency``: what readers' LRU touches cost the reading process.

vLLM's scheduler touches every unit of every block it loads, once a step
that loads; the store buffers the touches and its maintenance thread writes
them (``ucm_db/store/background.py``, ``ucm_db/index/writes.py``). One LMDB
store (codec none, 64-byte payloads: only the index is written) holds
``--chains`` chains of ``--blocks`` blocks. Phases, in this order:

1. **aged prefix** (skipped with ``--aged-s 0``): the store rests
   ``--aged-s`` (past the index's ``ANCESTOR_RECENCY_SLACK_NS``, 30 s),
   then each chain's last block is touched and ``Store.flush`` timed: the
   walk up rewrites every ancestor, older than the slack. Then the same
   touches and flush again at once: the walk stops at the first ancestor.
2. **every touch written**: every block touched, then ``Store.flush``
   (which writes every touch buffered), ``--rounds`` times: the flush's
   time per touch. The baseline of phase 3.
3. **re-touches kept back**: every block touched each ``--interval-s``
   while the maintenance thread runs its rounds for ``--seconds``; its CPU
   time (``/proc/self/task/TID/schedstat``, the thread the new store
   started) less that of as long a window with no touches (its syncs),
   per touch. The window starts after the
   round that writes the first touches and is shorter than half of
   ``RECENCY_REFRESH_S``, so every later round keeps its touches back.

Also printed: the caller's own time per touch (``Store.touch`` buffers).

Invariants:
    * Phases 2 and 3 are one store, one run: their ratio is within one run.
    * Every block is stored before any phase, and a lookup finds each
      chain whole at the end (a benchmark that lost blocks fails).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import BlockKeys, Namespace

BLOCK_SIZE = 16
PAYLOAD = b"r" * 64
#: The store's maintenance thread's name (``ucm_db/store/background.py``).
MAINTENANCE_THREAD = "ucm-db-maintenance"


def maintenance_tids() -> set[int]:
    """The OS thread ids of this process's live store maintenance threads."""
    return {t.native_id for t in threading.enumerate() if t.name == MAINTENANCE_THREAD and t.native_id is not None}


def thread_cpu_ns(tid: int) -> int:
    """CPU time of this process's thread ``tid`` (schedstat's first field)."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])


def _chains(ns: Namespace, chains: int, blocks: int) -> list[BlockKeys]:
    return [ns.block_keys([c * 10**7 + t for t in range(blocks * BLOCK_SIZE)]) for c in range(chains)]


def _timed_flush_ms(store: ucm_db.Store) -> float:
    started = time.perf_counter()
    store.flush()
    return (time.perf_counter() - started) * 1e3


def _aged_prefix(store: ucm_db.Store, ns: Namespace, keyed: list[BlockKeys], aged_s: float) -> dict[str, float]:
    time.sleep(aged_s)
    tails = [keys[-1:] for keys in keyed]
    figures = {}
    for name in ("aged_flush_ms", "again_flush_ms"):
        for keys in tails:
            store.touch(ns, keys)
        figures[name] = round(_timed_flush_ms(store), 3)
    return figures


def _every_touch_written(store: ucm_db.Store, ns: Namespace, keyed: list[BlockKeys], rounds: int) -> dict[str, Any]:
    touches = sum(len(keys) for keys in keyed)
    touch_us, flush_us = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for keys in keyed:
            store.touch(ns, keys)
        touch_us.append((time.perf_counter() - started) * 1e6 / touches)
        flush_us.append(_timed_flush_ms(store) * 1e3 / touches)
    return {"written_us_per_touch": round(statistics.median(flush_us), 3), "written_runs": [round(v, 3) for v in flush_us],
            "caller_us_per_touch": round(statistics.median(touch_us), 3)}


def _kept_back(store: ucm_db.Store, ns: Namespace, keyed: list[BlockKeys], interval_s: float, seconds: float,
               tid: int) -> dict[str, float]:
    idle_started = thread_cpu_ns(tid)
    time.sleep(seconds)
    idle_ns = thread_cpu_ns(tid) - idle_started
    for keys in keyed:
        store.touch(ns, keys)
    time.sleep(interval_s * 1.5)  # the round that writes them (this process has not written them in a round yet)
    cpu_started, touches = thread_cpu_ns(tid), 0
    until_s = time.monotonic() + seconds
    while time.monotonic() < until_s:
        for keys in keyed:
            store.touch(ns, keys)
            touches += len(keys)
        time.sleep(interval_s)
    busy_ns = thread_cpu_ns(tid) - cpu_started
    return {"kept_back_us_per_touch": round(max(0, busy_ns - idle_ns) / 1e3 / touches, 3),
            "maintenance_idle_ms": round(idle_ns / 1e6, 2), "maintenance_touching_ms": round(busy_ns / 1e6, 2),
            "kept_back_touches": touches}


def run(chains: int, blocks: int, aged_s: float, rounds: int, interval_s: float, seconds: float) -> dict[str, Any]:
    """Every phase on one fresh store (module doc); the figures."""
    ns = Namespace(model="bench/recency", kv_dtype="bfloat16", block_size=BLOCK_SIZE)
    keyed = _chains(ns, chains, blocks)
    out: dict[str, Any] = {"chains": chains, "blocks": blocks, "interval_s": interval_s, "seconds": seconds}
    others = maintenance_tids()  # other stores open in this process (a test suite's) have theirs
    with tempfile.TemporaryDirectory() as scratch, ucm_db.open(scratch + "/s", codec="none", capacity_bytes=4 << 30,
                                                               encode_threads=0, sync_interval_s=interval_s) as store:
        mine = maintenance_tids() - others
        if len(mine) != 1:
            raise RuntimeError(f"want the new store's one {MAINTENANCE_THREAD!r} thread, found {len(mine)}")
        for keys in keyed:
            store.put(ns, keys, [PAYLOAD] * len(keys))
        store.flush()
        if aged_s > 0:
            out.update(_aged_prefix(store, ns, keyed, aged_s))
        out.update(_every_touch_written(store, ns, keyed, rounds))
        out.update(_kept_back(store, ns, keyed, interval_s, seconds, mine.pop()))
        if any(store.lookup(ns, keys, remote=False) != len(keys) for keys in keyed):
            raise RuntimeError("a chain lost blocks during the benchmark")
    out["kept_back_over_written"] = round(out["kept_back_us_per_touch"] / out["written_us_per_touch"], 3)
    return out


@click.command("recency", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--chains", type=click.IntRange(min=1), default=4, show_default=True, help="prompts read again and again")
@click.option("--blocks", type=click.IntRange(min=1), default=512, show_default=True, help="blocks per prompt")
@click.option("--aged-s", type=click.FloatRange(min=0), default=31.0, show_default=True,
              help="rest before the aged-prefix phase (past the 30 s ancestor slack); 0 skips it")
@click.option("--rounds", type=click.IntRange(min=1), default=9, show_default=True, help="touch-and-flush rounds; median")
@click.option("--interval-s", type=click.FloatRange(min=0.01), default=0.2, show_default=True,
              help="the store's sync_interval_s, and the pause between the kept-back phase's touches")
@click.option("--seconds", type=click.FloatRange(min=0.5, max=14.0), default=6.0, show_default=True,
              help="length of the kept-back window and of its idle baseline (under half the 30 s refresh time)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(chains: int, blocks: int, aged_s: float, rounds: int, interval_s: float, seconds: float, as_json: bool) -> None:
    """What readers' LRU touches cost: every touch written against re-touches kept back.

    \b
    Example:
        ucm-db bench recency
        ucm-db bench recency --aged-s 0 --seconds 3 --json
    """
    figures = run(chains, blocks, aged_s, rounds, interval_s, seconds)
    if as_json:
        click.echo(json.dumps(figures, indent=2, sort_keys=True))
        return
    click.echo(f"{chains} chains x {blocks} blocks, LMDB, 64-byte payloads; maintenance round every {interval_s} s")
    if "aged_flush_ms" in figures:
        click.echo(f"  tails touched after {aged_s:g} s at rest, flush       {figures['aged_flush_ms']:9.3f} ms (every ancestor rewritten)")
        click.echo(f"  the same again at once, flush              {figures['again_flush_ms']:9.3f} ms (walk stops at recent ancestors)")
    click.echo(f"  Store.touch, the caller                    {figures['caller_us_per_touch']:9.3f} us a touch")
    click.echo(f"  every touch written (touch, flush)         {figures['written_us_per_touch']:9.3f} us a touch "
               f"(runs {figures['written_runs']})")
    click.echo(f"  re-touches kept back, maintenance CPU      {figures['kept_back_us_per_touch']:9.3f} us a touch "
               f"({figures['kept_back_touches']} touches; {figures['maintenance_touching_ms']} ms busy against "
               f"{figures['maintenance_idle_ms']} ms idle)")
    click.echo(f"  kept back / written                        {figures['kept_back_over_written']:9.3f}x")
