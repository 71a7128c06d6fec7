"""The scale benchmark: ``ucm-db bench scale`` (issue 13, item 4).

Builds two stores of small blocks, a large one (default 1M blocks) and a
small one (default 10k), in chains of 1024 blocks of 32 tokens (a 32K-token
prompt each), and measures in each:

==================  ==========================================================
open                ``ucm_db.open`` in a fresh process (import excluded)
first hit           open -> the first ``lookup`` that returns a hit, same process
lookup              a stored 1024-block chain (32K tokens), full hit, median
                    per call of ``LOOKUPS_PER_RUN``
put                 one new 64-block chain segment (a 2K-token prompt), median
                    per call, after ``WARMUP_PUTS`` untimed ones and ``WARMUP_S``
                    from the first (with the page faults per timed put); every
                    put is deleted after, so the store keeps its size
put, real size      the same with ``--real-put-bytes`` per block (default
                    256 KiB: one 32-token block of an 8-layer model with 8 KV
                    heads of 64, bf16), the cost a serving engine pays: the
                    small-payload put is the index alone, its worst case
verify --sample     the real ``ucm-db verify PATH --sample N --json``, wall
compact             the real ``ucm-db compact PATH --json``, wall (rewrites the file)
put, real, compact  "put, real size" again after the compacts: the store as
                    built keeps the free pages its bulk build left in LMDB's
                    free list, which every put of a large block searches for
                    a contiguous run; the rewritten file has none
==================  ==========================================================

and the ratio large / small of each. Targets (issue 13): first hit within
1 s of open; lookup and put within 1.5x of the small store.

Invariants:
    * Every figure is the median of ``--runs`` repetitions and every run is
      kept (``--json``); the two stores are measured in turns within each
      repetition, so load on a shared machine hits both alike.
    * Open and first hit are timed in a new Python process (nothing of the
      store is cached in the measuring process; the OS page cache is warm:
      the benchmark does not drop caches on a shared host).
    * The CLI figures include the ``ucm-db`` process start; ``cli_start``
      (``ucm-db --help``) is reported beside them so it can be subtracted.
    * A lookup that does not find the whole chain, or a first "hit" that is
      not one, stops the benchmark: such a figure would measure nothing.
    * Verdicts are computed from this run's figures, never hard-coded.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import click
import numpy as np

import ucm_db
from ucm_db import Namespace

#: Namespace of the scale stores (vLLM CPU block size 32, bf16).
NAMESPACE = Namespace(model="ucm-db-bench-scale", kv_dtype="bfloat16", block_size=32)
CHAIN_BLOCKS = 1024  # 32K tokens of 32-token blocks
PUT_BLOCKS = 64  # one put: a 2K-token prompt's new blocks
LOOKUPS_PER_RUN = 300
PUTS_PER_RUN = 30
#: Untimed puts after open, then a pause until WARMUP_S: a just-opened
#: process takes a page fault on each page of the LMDB map it touches first
#: until the store's background prefault has mapped the cached file (about
#: 0.3 s at 1M blocks here); a serving process is long-lived.
WARMUP_PUTS = 10
WARMUP_S = 2.0
_GIB = 1 << 30
#: One 32-token block of an 8-layer model, 8 KV heads of 64, bf16 (K and V).
REAL_BLOCK_BYTES = 8 * 2 * 8 * 64 * 32 * 2
#: Figures whose large / small ratio has a target, and the bound.
RATIO_TARGETS = {"lookup_ms": 1.5, "put_ms": 1.5}
FIRST_HIT_TARGET_S = 1.0


@dataclass(frozen=True)
class ScaleOptions:
    """What to build and how often to measure.

    Attributes:
        large_blocks / small_blocks: blocks in the two stores.
        payload_bytes: bytes per stored block (small: the index is measured).
        runs: repetitions per figure (the median is reported).
        verify_sample: blocks checked by ``ucm-db verify --sample``.
        scratch_dir: parent of the scratch stores (None: the system temp dir).
        compact: also time ``ucm-db compact`` (rewrites the store file).
        chain_blocks: blocks per stored chain (and per measured lookup).
        real_put_bytes: bytes per block of the second put figure
            (``put_real_ms``); 0 leaves it out.
        engine: the stores' local engine (``"lmdb"``, ``"rocksdb"``).
    """

    large_blocks: int = 1_000_000
    small_blocks: int = 10_000
    payload_bytes: int = 128
    runs: int = 3
    verify_sample: int = 1000
    scratch_dir: str | None = None
    compact: bool = True
    chain_blocks: int = CHAIN_BLOCKS
    real_put_bytes: int = REAL_BLOCK_BYTES
    engine: str = "lmdb"


def chain_keys(seed: int, count: int = CHAIN_BLOCKS) -> list[bytes]:
    """Keys of chain ``seed`` (distinct seeds: disjoint chains)."""
    tokens = (np.arange(count * NAMESPACE.block_size, dtype=np.int64) + seed * 7_919 * 1_000_003) % (1 << 31)
    return list(NAMESPACE.block_keys(cast(Sequence[int], tokens)))  # numpy ids are accepted (see Namespace.block_keys)


def build_store(path: Path, n_blocks: int, payload_bytes: int, *, chain_blocks: int = CHAIN_BLOCKS,
                progress: bool = False, engine: str = "lmdb") -> dict[str, float]:
    """Fills a new store at ``path`` with ``n_blocks`` blocks in chains of
    ``chain_blocks`` (seeds 0, 1, ...; one commit per chain); returns build
    figures. The store keeps ``engine``: later opens find it there."""
    payloads = [bytes([i % 251]) * payload_bytes for i in range(16)]
    started = time.perf_counter()
    put_s = 0.0
    with ucm_db.open(path, codec="none", capacity_bytes=64 * _GIB, engine=engine) as store:
        done, seed = 0, 0
        while done < n_blocks:
            keys = chain_keys(seed, min(chain_blocks, n_blocks - done))
            t0 = time.perf_counter()
            store.put(NAMESPACE, keys, [payloads[i % 16] for i in range(len(keys))], parent=None)
            put_s += time.perf_counter() - t0
            done += len(keys)
            seed += 1
            if progress and seed % max(1, 100_000 // chain_blocks) == 0:
                print(f"  built {done}/{n_blocks} blocks ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        store.flush()
    return {"build_s": time.perf_counter() - started, "build_put_s": put_s, "chains": seed,
            "store_bytes": float(sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()))}


def full_chains(n_blocks: int, chain_blocks: int) -> int:
    """Chains of a store of ``n_blocks`` holding all ``chain_blocks`` blocks (the last may be shorter)."""
    return n_blocks // chain_blocks


# -- open and first hit, in a fresh process --------------------------------------
_PROBE = """
import sys, time, json
t0 = time.perf_counter()
import ucm_db
from ucm_db.tools.bench.scale import NAMESPACE, chain_keys
import_s = time.perf_counter() - t0
keys = chain_keys(int(sys.argv[2]), int(sys.argv[3]))
t0 = time.perf_counter()
store = ucm_db.open(sys.argv[1])
open_s = time.perf_counter() - t0
found = store.lookup(NAMESPACE, keys)
first_hit_s = time.perf_counter() - t0
store.close()
print(json.dumps({"import_s": import_s, "open_s": open_s, "first_hit_s": first_hit_s, "found": found}))
"""


def probe_open(path: Path, seed: int, chain_blocks: int = CHAIN_BLOCKS) -> dict[str, float]:
    """Open and first-hit seconds of chain ``seed``, measured in a new process."""
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(seed), str(chain_blocks)], check=True,
                         capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["found"] != chain_blocks:
        raise RuntimeError(f"first lookup after open found {result['found']} of {chain_blocks} blocks of chain {seed} in {path}")
    return result


# -- lookup and put, in this process ---------------------------------------------
def time_lookups(store: Any, chains: list[list[bytes]]) -> float:
    """Median seconds per full-hit lookup, cycling over ``chains``."""
    times = []
    for i in range(LOOKUPS_PER_RUN):
        keys = chains[i % len(chains)]
        t0 = time.perf_counter()
        found = store.lookup(NAMESPACE, keys)
        times.append(time.perf_counter() - t0)
        if found != len(keys):
            raise RuntimeError("lookup of a stored chain was not a full hit")
    return statistics.median(times)


def time_puts(store: Any, first_seed: int, payload_bytes: int) -> tuple[float, float]:
    """Median seconds per put of a new ``PUT_BLOCKS``-block chain root
    segment, and the minor page faults per timed put (this process). The
    puts are deleted afterwards, so the store keeps its size across runs."""
    payload = bytes([3]) * payload_bytes
    roots = []

    def put(seed: int) -> float:
        keys = chain_keys(seed, PUT_BLOCKS)
        t0 = time.perf_counter()
        store.put(NAMESPACE, keys, [payload] * PUT_BLOCKS, parent=None)
        elapsed = time.perf_counter() - t0
        roots.append(keys[0])
        return elapsed

    warm_until = time.monotonic() + WARMUP_S
    for i in range(WARMUP_PUTS):
        put(first_seed + i)
    time.sleep(max(0.0, warm_until - time.monotonic()))
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [put(first_seed + WARMUP_PUTS + i) for i in range(PUTS_PER_RUN)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    store.delete(NAMESPACE, roots)  # each root takes its chain with it
    return statistics.median(times), faults / PUTS_PER_RUN


# -- the CLI ----------------------------------------------------------------------
def _cli(*args: str) -> float:
    """Wall seconds of ``ucm-db ARGS`` (the installed entry point's code)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import sys; from ucm_db.tools.cli import main; sys.exit(main())", *args],
                         capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"ucm-db {' '.join(args)} exited {out.returncode}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return wall_s


# -- the run ----------------------------------------------------------------------
@contextmanager
def _scratch(options: ScaleOptions) -> Iterator[Path]:
    if options.scratch_dir is not None:
        Path(options.scratch_dir).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ucm-bench-scale-", dir=options.scratch_dir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(options: ScaleOptions, *, progress: bool = False) -> dict[str, Any]:
    """Builds both stores, measures them in turns; returns the report."""
    started = time.time()
    sizes = {"large": options.large_blocks, "small": options.small_blocks}
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in sizes}
    builds: dict[str, dict[str, float]] = {}

    def add(store_name: str, figure: str, value: float) -> None:
        runs[store_name].setdefault(figure, []).append(value)

    with _scratch(options) as root:
        paths = {name: root / name for name in sizes}
        for name, n in sizes.items():
            if progress:
                print(f"building the {name} store: {n} blocks of {options.payload_bytes} bytes", file=sys.stderr, flush=True)
            builds[name] = build_store(paths[name], n, options.payload_bytes, chain_blocks=options.chain_blocks,
                                       progress=progress, engine=options.engine)
        cli_start = [_cli("--help") for _ in range(options.runs)]
        for rep in range(options.runs):
            for name, n in sizes.items():
                probe = probe_open(paths[name], (rep * 7919) % full_chains(n, options.chain_blocks), options.chain_blocks)
                for figure in ("import_s", "open_s", "first_hit_s"):
                    add(name, figure, probe[figure])
            for name, n in sizes.items():
                chains = [chain_keys((rep * 31 + 17 * i) % full_chains(n, options.chain_blocks), options.chain_blocks)
                          for i in range(8)]
                with ucm_db.open(paths[name]) as store:
                    store.lookup(NAMESPACE, chains[0])  # the first call's one-off costs are "first hit"
                    add(name, "lookup_ms", time_lookups(store, chains) * 1e3)
                    put_s, faults = time_puts(store, 10_000_000 + rep * 1000, options.payload_bytes)
                    add(name, "put_ms", put_s * 1e3)
                    add(name, "put_minor_faults", faults)
                    if options.real_put_bytes:
                        put_s, _ = time_puts(store, 20_000_000 + rep * 1000, options.real_put_bytes)
                        add(name, "put_real_ms", put_s * 1e3)
            for name in sizes:
                add(name, "verify_sample_s", _cli("verify", str(paths[name]), "--sample", str(options.verify_sample), "--json"))
        if options.compact:
            for rep in range(options.runs):
                for name in sizes:
                    add(name, "compact_s", _cli("compact", str(paths[name]), "--json"))
            if options.real_put_bytes:  # the same put into the rewritten file: no free list left to search
                for rep in range(options.runs):
                    for name in sizes:
                        with ucm_db.open(paths[name]) as store:
                            put_s, _ = time_puts(store, 30_000_000 + rep * 1000, options.real_put_bytes)
                            add(name, "put_real_compacted_ms", put_s * 1e3)
    return _report(options, runs, builds, cli_start, time.time() - started)


def _report(options: ScaleOptions, runs: dict[str, dict[str, list[float]]], builds: dict[str, dict[str, float]],
            cli_start: list[float], elapsed_s: float) -> dict[str, Any]:
    medians = {name: {fig: statistics.median(values) for fig, values in figs.items()} for name, figs in runs.items()}
    ratios = {fig: medians["large"][fig] / medians["small"][fig] for fig in medians["large"] if medians["small"][fig] > 0}
    targets = [{"target": "first hit within 1 s of open, large store", "measured": round(medians["large"]["first_hit_s"], 4),
                "bound": f"<= {FIRST_HIT_TARGET_S}", "met": medians["large"]["first_hit_s"] <= FIRST_HIT_TARGET_S}]
    for fig, bound in RATIO_TARGETS.items():
        targets.append({"target": f"{fig} large / small", "measured": round(ratios[fig], 4), "bound": f"<= {bound}",
                        "met": ratios[fig] <= bound})
    return {
        "options": {"large_blocks": options.large_blocks, "small_blocks": options.small_blocks,
                    "payload_bytes": options.payload_bytes, "runs": options.runs, "verify_sample": options.verify_sample,
                    "chain_blocks": options.chain_blocks, "put_blocks": PUT_BLOCKS,
                    "real_put_bytes": options.real_put_bytes, "block_tokens": NAMESPACE.block_size, "engine": options.engine},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_at_end": os.getloadavg()},
        "elapsed_s": round(elapsed_s, 1),
        "build": builds,
        "cli_start_s": {"median": statistics.median(cli_start), "runs": cli_start},
        "runs": runs,
        "medians": medians,
        "ratios": ratios,
        "targets": targets,
    }


_ROWS = (("open_s", "open (new process)", 1e3, "ms"), ("first_hit_s", "open -> first hit", 1e3, "ms"),
         ("lookup_ms", "lookup of a chain, full hit", 1.0, "ms"), ("put_ms", f"put {PUT_BLOCKS} blocks", 1.0, "ms"),
         ("put_real_ms", f"put {PUT_BLOCKS} blocks, real size", 1.0, "ms"),
         ("verify_sample_s", "ucm-db verify --sample", 1.0, "s"), ("compact_s", "ucm-db compact", 1.0, "s"),
         ("put_real_compacted_ms", f"put {PUT_BLOCKS} real, after compact", 1.0, "ms"),
         ("put_minor_faults", "page faults per put (minor)", 1.0, ""), ("import_s", "import ucm_db (probe)", 1e3, "ms"))


def format_table(report: dict[str, Any]) -> str:
    """The human-readable report: one row per figure, medians and ratio."""
    opts = report["options"]
    large, small = opts["large_blocks"], opts["small_blocks"]
    lines = [f"{'figure':<30} {'unit':<4} {f'{large} blocks':>14} {f'{small} blocks':>14} {'ratio':>7}  runs (large | small)"]
    for key, label, scale, unit in _ROWS:
        if key not in report["medians"]["large"]:
            continue
        big, little = (report["medians"][s][key] * scale for s in ("large", "small"))
        spread = " ".join(f"{v * scale:.3g}" for v in report["runs"]["large"][key]) + " | " + \
            " ".join(f"{v * scale:.3g}" for v in report["runs"]["small"][key])
        ratio = f"{big / little:>7.2f}" if little > 0 else f"{'-':>7}"
        lines.append(f"{label:<30} {unit:<4} {big:>14.4g} {little:>14.4g} {ratio}  {spread}")
    lines.append(f"{'build (put only)':<30} {'s':<4} {report['build']['large']['build_put_s']:>14.1f} "
                 f"{report['build']['small']['build_put_s']:>14.2f}")
    lines.append(f"{'store size on disk':<30} {'MiB':<4} {report['build']['large']['store_bytes'] / 2**20:>14.0f} "
                 f"{report['build']['small']['store_bytes'] / 2**20:>14.1f}")
    lines.append(f"ucm-db process start (ucm-db --help), included in the CLI rows: {report['cli_start_s']['median']:.2f} s")
    lines.append("")
    for t in report["targets"]:
        lines.append(f"{t['target']:<44} {t['measured']:>9.4g}  {t['bound']:<8} {'met' if t['met'] else 'MISSED'}")
    load = ", ".join(f"{x:.2f}" for x in report["machine"]["load_avg_at_end"])
    lines.append(f"\n{report['machine']['cpus']} CPUs, load average at end {load}; {report['elapsed_s']} s; "
                 f"{opts.get('engine', 'lmdb')} engine, {opts['payload_bytes']}-byte payloads ({opts['real_put_bytes']} in 'real size'), chains of {opts['chain_blocks']} x {opts['block_tokens']}-token blocks")
    return "\n".join(lines)


@click.command("scale", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--blocks", "large_blocks", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="blocks in the large store")
@click.option("--small-blocks", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="blocks in the small store")
@click.option("--chain-blocks", type=click.IntRange(min=1), default=CHAIN_BLOCKS, show_default=True,
              help="blocks per chain (a prompt of this many 32-token blocks); each lookup reads one chain")
@click.option("--payload-bytes", type=click.IntRange(min=1), default=128, show_default=True, help="bytes per block")
@click.option("--real-put-bytes", type=click.IntRange(min=0), default=REAL_BLOCK_BYTES, show_default=True,
              help="bytes per block of the 'put, real size' figure (0: leave it out)")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="repetitions per figure (medians)")
@click.option("--verify-sample", type=click.IntRange(min=1), default=1000, show_default=True,
              help="N of `ucm-db verify --sample N`")
@click.option("--no-compact", is_flag=True, help="skip `ucm-db compact` (it rewrites each store file)")
@click.option("--engine", type=click.Choice(["lmdb", "rocksdb"]), default="lmdb", show_default=True,
              help="local engine of both stores")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None,
              help="scratch directory for the two stores (default: system temp)")
@click.option("--json", "as_json", is_flag=True, help="print the full report as JSON")
def command(large_blocks: int, small_blocks: int, chain_blocks: int, payload_bytes: int, real_put_bytes: int, runs: int, verify_sample: int, no_compact: bool,
            engine: str, scratch_dir: str | None, as_json: bool) -> None:
    """A large store against a small one: open, first hit, lookup, put, verify --sample, compact.

    Targets (issue 13) are reported, not enforced (exit status 0): first hit
    within 1 s of open, lookup and put within 1.5x of the small store.
    Building 1M blocks takes minutes; progress goes to stderr.

    \b
    Example:
        ucm-db bench scale
        ucm-db bench scale --blocks 100000 --small-blocks 2048 --runs 5 --json
    """
    if min(large_blocks, small_blocks) < chain_blocks:
        raise click.BadParameter(f"each store needs at least one whole chain of {chain_blocks} blocks",
                                 param_hint="--blocks/--small-blocks")
    options = ScaleOptions(large_blocks=large_blocks, small_blocks=small_blocks, payload_bytes=payload_bytes, runs=runs,
                           verify_sample=verify_sample, scratch_dir=scratch_dir, compact=not no_compact,
                           chain_blocks=chain_blocks, real_put_bytes=real_put_bytes, engine=engine)
    report = run(options, progress=True)  # progress goes to stderr
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
