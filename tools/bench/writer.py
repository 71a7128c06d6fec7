"""In-engine saves per writer CPU second: ``ucm-db bench writer`` (issue 50, item 3).

    ucm-db bench writer [--layers 8,2] [--job-blocks 1,2] [--jobs 256] [--backlog all] [--codec none] [--json]

Target of the issue: in-engine saves >= 0.8x ``bench core``'s durable put per
writer CPU second.

The saves: a real connector worker
(:class:`~ucm_db.connector.worker.hooks.UcmDbWorker`, no engine, the entry
``bench load`` drives too) over a KV cache in vLLM CPU's layout (one bf16
tensor per layer, ``[blocks, 4 KV heads, block 32, 2 x head 64]``: the
serving model's shape, :mod:`.serve_model`), filled with real K/V
activations (:mod:`.kv_sample`). The connector stores a block as one unit
per KV head, one frame per layer (``layers x 8 KiB``: 64 KiB at 8 layers);
each job is one engine step's ``save`` of ``--job-blocks`` blocks (cycled:
1, 2, 1, ...) of one of 8 requests in turn, each continuing its request's
chain. The worker copies them out and its
:class:`~ucm_db.connector.worker.writer.BackgroundWriter` commits them into
an LMDB store (the connector's defaults but the codec and capacity:
durability ``group``, 2 codec threads). ``--store full`` (the default): a
store at capacity, filled untimed with jobs of the same shape, so every
commit evicts what it stores, as a serving store's does once full
(:mod:`.at_capacity`); ``--store fresh``: a new store that only grows.
Three modes:

* ``backlog``: every job's ``save`` is called back to back, then ``drain``:
  the queue grows and each writer round commits the jobs queued, up to
  ``COALESCE_MAX_BYTES``, in one transaction;
* ``paced``: ``save`` then ``drain``, job after job: one job per transaction;
* ``steps``: ``save`` then :data:`STEP_S` of sleep, job after job (an
  engine's decode steps, each saving a block or two while the writer
  works), then ``drain``: what the writer's linger
  (:data:`~ucm_db.connector.worker.writer.LINGER_S`) coalesces.

Each repetition ends with ``Store.flush()`` (durable, as ``bench core``
times its put). Figures per case, GB/s of saved KV bytes:

* ``writer``: per CPU second of the writer thread (its CPU clock,
  ``pthread_getcpuclockid``, from the first save to the end of ``drain``:
  queue handling, rounds, framing, the commit);
* ``commit``: per second of the writer's own commit CPU counter
  (``vllm:ucm_db_save_commit_cpu_seconds_total``);
* ``off_engine``: per CPU second of the whole process less the calling
  (engine's) thread's ``save`` and ``drain`` calls: the writer, the store's
  sync and codec threads and the ``flush``. With ``--codec zstd`` the codec
  threads compress, so read this one rather than ``writer``;
* ``wall``: saved bytes over the time from the first save to durable;
* ``written_x_saved``: bytes the process handed to ``write``/``pwrite``
  (``/proc/self/io`` ``wchar``: LMDB's commits write every dirty page) from
  the first save to durable, over the saved bytes: the write amplification
  of the store's records (a unit's body in overflow pages plus the B-tree
  pages its other records dirty). None where ``/proc`` has no ``io``.

The baseline is ``bench core``'s durable put row of the same codec
(:func:`.at_capacity.put_once`: 64 (quick 32) x 2 MiB of real K/V, 16 per
commit, ``durability="group"``, timed to ``flush()``, into a store in the
same state as the cases': at capacity or fresh), per
CPU second of the whole process, as ``bench core`` reports it; each
repetition runs it :data:`BASELINE_PUTS` times and keeps the one of median
CPU time. A case's ratio is the median over repetitions of (its figure /
the baseline's) within each repetition.

Invariants:
    * Every repetition runs the baseline then each case, each on a store of
      its own, so a slow spell of the shared host hits all alike; figures are
      medians of ``--repeat`` and keep every run. One round before them
      warms up, untimed.
    * A case whose saves were not all committed (an error, a drop) raises:
      its figure would be meaningless.
    * vLLM and torch are imported only when a case runs (the connector's
      modules need them).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from ucm_db.tools.bench import at_capacity, writer_table
from ucm_db.tools.bench.common import BLOCK_BYTES, BenchOptions, Figure, int_list
from ucm_db.tools.bench.core import load_payloads
from ucm_db.tools.bench.load import BLOCK, HEAD_SIZE, KV_HEADS, LAYER_UNIT_BYTES

TARGET = 0.8
#: Baseline puts a repetition, the one of median CPU time kept: on a VM that
#: backs fresh memory lazily one put's kernel time swung 4-5x at random
#: (bimodal medians of 0.4 and 1.8 GB/s per CPU s in one run of 15).
BASELINE_PUTS = 3
REQUESTS = 8  # requests whose saves take turns, each continuing its own chain
CACHE_BLOCKS = 64  # blocks of the KV cache the saves copy out of (reused, as an engine's are)
CAPACITY_BYTES = 4 << 30
MODES = ("backlog", "paced", "steps")
#: The ``steps`` mode's time between two saves (a fast engine's decode step).
STEP_S = 0.002
GB = 1e9


@dataclass(frozen=True)
class Case:
    """One configuration: the model's layers and whether saves queue up."""

    layers: int
    mode: str  # one of MODES

    @property
    def name(self) -> str:
        return f"{self.layers}L_{self.mode}"

    @property
    def unit_bytes(self) -> int:
        return self.layers * LAYER_UNIT_BYTES


@dataclass
class Run:
    """One repetition of one case: seconds, CPU seconds and what was committed."""

    wall_s: float
    writer_cpu_s: float
    commit_cpu_s: float
    off_engine_cpu_s: float
    saved_bytes: int
    commits: int
    written_bytes: int | None = None  # handed to write/pwrite by the process (None: not known)
    evicted_units: int = 0  # units the timed saves evicted (a store at capacity: about as many as they stored)


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def written_bytes() -> int | None:
    """Bytes this process has handed to write-like calls (``wchar`` of
    ``/proc/self/io``); None where that file is missing or unreadable."""
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _kv_caches(layers: int, payloads: Sequence[memoryview]) -> dict[str, Any]:
    """The KV cache, vLLM CPU layout, filled with the real K/V bytes of
    ``payloads`` (cycled), each layer from different bytes."""
    import torch

    shape = (CACHE_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    layer_bytes = CACHE_BLOCKS * KV_HEADS * BLOCK * 2 * HEAD_SIZE * 2
    need = -(-layers * layer_bytes // BLOCK_BYTES)
    flat = np.concatenate([np.frombuffer(payloads[i % len(payloads)], np.uint8) for i in range(need)])
    return {f"model.layers.{i}.self_attn.attn": torch.from_numpy(flat[i * layer_bytes:(i + 1) * layer_bytes].copy())
            .view(torch.bfloat16).reshape(shape) for i in range(layers)}


def plan(layers: int, jobs: int, job_blocks: Sequence[int], seed: int = 0) -> list[Any]:
    """The jobs' save metadata, one engine step each: ``job_blocks[j %
    len]`` blocks of request ``j % REQUESTS``, continuing its chain, copied
    out of the next blocks of the KV cache. Another ``seed``: the same jobs
    over other tokens (a store's filler)."""
    from ucm_db.connector.identity import namespace
    from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
    from ucm_db.tools.bench.load import _shape

    sizes = [job_blocks[j % len(job_blocks)] for j in range(jobs)]
    per_request = [sum(sizes[r::REQUESTS]) for r in range(REQUESTS)]
    ns = namespace(_shape(layers))
    chains = [ns.block_keys([(seed * REQUESTS + r + 1) * 10_000_000 + t for t in range(n * BLOCK)])
              for r, n in enumerate(per_request)]
    done, cursor, metas = [0] * REQUESTS, 0, []
    for j, n in enumerate(sizes):
        r, at = j % REQUESTS, done[j % REQUESTS]
        ids = tuple((cursor + i) % CACHE_BLOCKS for i in range(n))
        meta = UcmDbConnectorMetadata()
        meta.saves.append(BlockTransfer(f"req-{r}", tuple(chains[r][at:at + n]), ids, parent=chains[r][at - 1] if at else None))
        metas.append(meta)
        done[r], cursor = at + n, cursor + n
    return metas


def median_by_cpu(puts: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The ``(wall_s, cpu_s)`` pair of median CPU time (the upper one of an even count)."""
    return sorted(puts, key=lambda wall_cpu: wall_cpu[1])[len(puts) // 2]


def _writer_clock(before: set[int | None]) -> int:
    """The CPU clock of the writer thread started since ``before`` (the
    idents then alive): read from here, it counts that thread alone."""
    found = [t.ident for t in threading.enumerate() if t.name == "ucm-db-writer" and t.ident not in before]
    if len(found) != 1 or found[0] is None:
        raise RuntimeError(f"expected one new ucm-db-writer thread, found {len(found)}")
    return time.pthread_getcpuclockid(found[0])


def _commits(counters: Any) -> int:
    """Transactions the writer committed (its commit-latency observations)."""
    return int(sum(v for k, v in counters.totals.data.items() if k.startswith("save_commit_hist_")))


def writer_once(case: Case, caches: dict[str, Any], metas: Sequence[Any], codec: str, scratch: Path,
                fillers: Sequence[Sequence[Any]] = (), engine: str = "lmdb") -> Run:
    """One repetition of ``case`` on a fresh store (opened and removed
    untimed), or with ``fillers`` (plans of the same size, other keys) on
    one at capacity: a capacity of what ``metas`` save, filled untimed by
    ``fillers`` (:mod:`.at_capacity`)."""
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.stores import acquire, release
    from ucm_db.connector.worker.hooks import UcmDbWorker
    from ucm_db.tools.bench.load import _shape

    path = Path(tempfile.mkdtemp(prefix=f"ucm-bench-writer-{case.name}-", dir=scratch))
    expected = sum(len(t.keys) for meta in metas for t in meta.saves) * KV_HEADS * case.unit_bytes
    capacity_bytes = at_capacity.capacity_for(expected, expected // case.unit_bytes) if fillers else CAPACITY_BYTES
    settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": codec, "capacity_bytes": capacity_bytes,
                                                    "engine": engine})
    worker = UcmDbWorker(settings, _shape(case.layers), CACHE_BLOCKS)
    before = {t.ident for t in threading.enumerate()}
    worker.register_kv_caches(caches, 0, 0)
    store = acquire(settings)  # the worker's store (one per path per process): to flush it
    try:
        clock = _writer_clock(before)
        for filler in fillers:  # untimed: brings the store to capacity (at_capacity.py)
            for meta in filler:
                worker.save(meta)
            worker.drain()
        store.flush()
        totals0, commits0, evictions0 = dict(worker.counters.totals.data), _commits(worker.counters), store.stats().evictions
        written0 = written_bytes()
        wall0, proc0, main0, writer0 = time.perf_counter(), _process_cpu_s(), time.thread_time(), time.clock_gettime(clock)
        for meta in metas:
            worker.save(meta)
            if case.mode == "paced":
                worker.drain()
            elif case.mode == "steps":
                time.sleep(STEP_S)
        worker.drain()
        writer_cpu_s = time.clock_gettime(clock) - writer0
        engine_cpu_s = time.thread_time() - main0
        store.flush()
        wall_s, proc_s = time.perf_counter() - wall0, _process_cpu_s() - proc0
        written1 = written_bytes()
        totals = {name: value - totals0.get(name, 0) for name, value in worker.counters.totals.data.items()}
        if totals["saved_bytes"] != expected or totals["save_errors"] or totals["saves_dropped"]:
            raise RuntimeError(f"{case.name}: saved {totals['saved_bytes']:.0f} of {expected} bytes "
                               f"({totals['save_errors']:.0f} errors, {totals['saves_dropped']:.0f} dropped)")
        written = None if written0 is None or written1 is None else written1 - written0
        return Run(wall_s, writer_cpu_s, totals["save_commit_cpu_s"], proc_s - engine_cpu_s, expected,
                   _commits(worker.counters) - commits0, written, store.stats().evictions - evictions0)
    finally:
        release(store)
        worker.shutdown()
        shutil.rmtree(path, ignore_errors=True)


def _figure(values: list[float], unit: str, note: str = "") -> Figure:
    return Figure(statistics.median(values), unit, [round(v, 4) for v in values], note)


def run(layers: Sequence[int], modes: Sequence[str], job_blocks: Sequence[int], jobs: int, codec: str, repeat: int,
        quick: bool = False, scratch_dir: str | None = None, store: str = "full", engine: str = "lmdb") -> dict[str, Any]:
    """Every case against the baseline, interleaved by repetition (module
    docstring); figures as plain dicts (``value``, ``unit``, ``runs``, ``note``)."""
    started, load_avg = time.time(), [round(x, 2) for x in os.getloadavg()]
    options = BenchOptions(quick=quick, repeat=repeat, scratch_dir=scratch_dir)
    payloads = load_payloads(options.put_blocks)
    cases = [Case(n, mode) for n in layers for mode in modes]
    caches = {n: _kv_caches(n, payloads) for n in layers}
    metas = {n: plan(n, jobs, job_blocks) for n in layers}
    fillers = {n: [plan(n, jobs, job_blocks, seed=1 + turn) for turn in range(at_capacity.TURNOVERS)] if store == "full" else []
               for n in layers}
    base: list[tuple[float, float]] = []
    runs: dict[Case, list[Run]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-writer-", dir=scratch_dir) as scratch:
        for rep in range(repeat + 1):  # round 0 warms up, untimed: a process's first store ran up to 2x slower
            puts = [at_capacity.put_once(options, payloads, codec, store) for _ in range(BASELINE_PUTS)]
            put_run = median_by_cpu(puts)
            case_runs = {case: writer_once(case, caches[case.layers], metas[case.layers], codec, Path(scratch), fillers[case.layers],
                                           engine) for case in cases}
            if rep:
                base.append(put_run)
                for case, one in case_runs.items():
                    runs[case].append(one)
    put_bytes = options.put_blocks * BLOCK_BYTES
    baseline = {
        "put_gbps": _figure([put_bytes / wall / GB for wall, _ in base], "GB/s", "wall, to durable"),
        "put_gbps_per_cpu_s": _figure([put_bytes / cpu / GB for _, cpu in base], "GB/s", "per CPU second of the process"),
        "blocks": options.put_blocks, "block_bytes": BLOCK_BYTES,
    }
    return as_dict({
        "model": {"layout": "vLLM CPU", "kv_dtype": "bfloat16", "kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "block_size": BLOCK},
        "options": {"layers": list(layers), "modes": list(modes), "job_blocks": list(job_blocks), "jobs": jobs, "codec": codec, "store": store, "engine": engine,
                    "repeat": repeat, "quick": quick, "requests": REQUESTS, "durability": "group"},
        "baseline": baseline,
        "rows": [_row(case, runs[case], base, put_bytes) for case in cases],
        "target": TARGET,
        "host": {"cpus": os.cpu_count(), "load_avg_at_start": load_avg},
        "elapsed_s": round(time.time() - started, 1),
    })


def _row(case: Case, runs: list[Run], base: list[tuple[float, float]], put_bytes: int) -> dict[str, Any]:
    """A case's figures, and its ratios to the baseline of the same repetitions."""
    saved = runs[0].saved_bytes
    put_per_cpu = [put_bytes / cpu / GB for _, cpu in base]
    per_cpu = {name: [saved / getattr(r, f"{name}_cpu_s") / GB for r in runs] for name in ("writer", "commit", "off_engine")}
    row: dict[str, Any] = {
        "case": case.name, "layers": case.layers, "mode": case.mode,
        "unit_bytes": case.unit_bytes, "saved_bytes": saved, "commits": statistics.median(r.commits for r in runs),
        "evicted_units": statistics.median(r.evicted_units for r in runs),
        "wall_gbps": _figure([saved / r.wall_s / GB for r in runs], "GB/s", "first save to durable (flush)"),
    }
    for name, values in per_cpu.items():
        row[f"{name}_gbps_per_cpu_s"] = _figure(values, "GB/s")
        row[f"{name}_x_put"] = _figure([v / p for v, p in zip(values, put_per_cpu)], "x")
    row["writer_cpu_ms_per_commit"] = _figure([r.writer_cpu_s / r.commits * 1e3 for r in runs], "ms")
    written = [r.written_bytes / r.saved_bytes for r in runs if r.written_bytes is not None]
    row["written_x_saved"] = _figure(written, "x", "bytes written to the store's files per saved byte") if written else None
    ratio = row["writer_x_put"].value
    row["target"] = {"target": f"writer GB/s per CPU s >= {TARGET}x durable put", "measured": round(ratio, 4), "met": ratio >= TARGET}
    return row


def as_dict(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its figures as plain dicts (what ``--json`` prints)."""
    def plain(value: Any) -> Any:
        if isinstance(value, Figure):
            return value.to_dict()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value
    return plain(report)


@click.command("writer", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layers", default="8,2", show_default=True, callback=int_list, help="model layers, one case set each")
@click.option("--job-blocks", default="1,2", show_default=True, callback=int_list,
              help="blocks per job (one engine step's save), cycled over the jobs")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="jobs per repetition [256; quick 64]")
@click.option("--backlog", type=click.Choice(["all", "both", "on", "off", "steps"]), default="all", show_default=True,
              help="on: saves queue up and rounds coalesce; off: one job per transaction (paced); steps: saves "
                   "2 ms apart (decode steps); both: on and off")
@click.option("--codec", type=click.Choice(["none", "zstd"]), default="none", show_default=True, help="store codec (and baseline's)")
@click.option("--store", type=click.Choice(["full", "fresh"]), default="full", show_default=True,
              help="full: saves and baseline into stores at capacity (every save evicts; at_capacity.py); fresh: new stores")
@click.option("--engine", type=click.Choice(["lmdb", "rocksdb"]), default="lmdb", show_default=True,
              help="the saves' store engine (the baseline stays bench core's LMDB put)")
@click.option("--repeat", type=click.IntRange(min=1), default=None, help="repetitions (median) [7; quick 3]")
@click.option("--quick", is_flag=True, help="64 jobs, 3 repetitions, bench core --quick's baseline (32 blocks)")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None, help="scratch directory (default: system temp)")
@click.option("--json", "as_json", is_flag=True, help="print the full report as JSON")
def command(layers: list[int], job_blocks: list[int], jobs: int | None, backlog: str, codec: str, store: str,
            engine: str, repeat: int | None, quick: bool, scratch_dir: str | None, as_json: bool) -> None:
    """In-engine saves (connector worker + background writer) per writer CPU second against bench core's durable put.

    The target (issue 50) is reported, not enforced: writer GB/s per CPU
    second >= 0.8x the durable put's GB/s per CPU second, same run.

    \b
    Example:
        ucm-db bench writer
        ucm-db bench writer --layers 8 --backlog on --codec zstd --json
        ucm-db bench writer --quick --job-blocks 2 --jobs 32
        ucm-db bench writer --quick --layers 8 --backlog on --engine rocksdb
    """
    modes = {"all": MODES, "both": ("backlog", "paced"), "on": ("backlog",), "off": ("paced",), "steps": ("steps",)}[backlog]
    report = run(layers, modes, job_blocks, jobs or (64 if quick else 256), codec, repeat or (3 if quick else 7), quick, scratch_dir, store, engine)
    click.echo(json.dumps(report, indent=2) if as_json else writer_table.format_table(report))


if __name__ == "__main__":
    command()
