"""``ucm-db bench engines``: the LMDB and RocksDB engines side by side.

The same workload runs through the full Store API on each engine: put
chains of blocks in batches, read them all back (``get``), and binary-search
prefix lookups. The codec is ``none`` so the figures compare the engines,
not compression; payloads are random (incompressible). Each figure is the
median of ``--repeat`` runs on a fresh store, and the report gives RocksDB
relative to LMDB measured in the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import Namespace

ENGINES = ("lmdb", "rocksdb")
NS = Namespace(model="bench/engines", kv_dtype="bfloat16", block_size=16)


def _chains(blocks: int, chain_blocks: int) -> list[list[bytes]]:
    out = []
    for c in range(blocks // chain_blocks):
        out.append(NS.block_keys([c * 100_000 + t for t in range(chain_blocks * NS.block_size)]))
    return out


def run_once(engine: str, scratch: Path, chains: list[list[bytes]], payload: bytes) -> dict[str, float]:
    """Seconds for put, get and lookup of every chain on a fresh store."""
    path = scratch / f"{engine}-{time.monotonic_ns()}"
    capacity = 4 * len(payload) * sum(len(c) for c in chains) + (64 << 20)
    try:
        with ucm_db.open(path, engine=engine, codec="none", capacity_bytes=capacity, durability="group") as store:
            t0 = time.perf_counter()
            for keys in chains:
                store.put(NS, keys, [payload] * len(keys))
            store.flush()
            t1 = time.perf_counter()
            for keys in chains:
                got = store.get(NS, keys)
                assert all(g is not None for g in got)
            t2 = time.perf_counter()
            for keys in chains:
                assert store.lookup(NS, keys) == len(keys)
            t3 = time.perf_counter()
        return {"put_s": t1 - t0, "get_s": t2 - t1, "lookup_s": t3 - t2}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def compare(blocks: int, block_bytes: int, chain_blocks: int, repeat: int, scratch_dir: str | None = None) -> dict[str, Any]:
    """Runs both engines ``repeat`` times, interleaved; returns medians and ratios."""
    chains = _chains(blocks, chain_blocks)
    n_blocks = sum(len(c) for c in chains)
    payload = os.urandom(block_bytes)
    scratch = Path(tempfile.mkdtemp(prefix="ucm-db-bench-engines-", dir=scratch_dir))
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    try:
        for _ in range(repeat):
            for engine in ENGINES:  # interleaved so drift in machine load hits both
                runs[engine].append(run_once(engine, scratch, chains, payload))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report: dict[str, Any] = {"blocks": n_blocks, "block_bytes": block_bytes, "chain_blocks": chain_blocks, "repeat": repeat, "engines": {}}
    total_bytes = n_blocks * block_bytes
    for engine in ENGINES:
        med = {k: statistics.median(r[k] for r in runs[engine]) for k in ("put_s", "get_s", "lookup_s")}
        report["engines"][engine] = {
            "put_MBps": total_bytes / med["put_s"] / 1e6, "get_MBps": total_bytes / med["get_s"] / 1e6,
            "lookup_us_per_chain": med["lookup_s"] / len(chains) * 1e6, "runs": runs[engine],
        }
    lm, rk = report["engines"]["lmdb"], report["engines"]["rocksdb"]
    report["rocksdb_vs_lmdb"] = {
        "put": rk["put_MBps"] / lm["put_MBps"], "get": rk["get_MBps"] / lm["get_MBps"],
        "lookup_speed": lm["lookup_us_per_chain"] / rk["lookup_us_per_chain"],
    }
    return report


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['blocks']} blocks x {r['block_bytes']} B, chains of {r['chain_blocks']}, median of {r['repeat']}",
             f"{'engine':<8} {'put MB/s':>10} {'get MB/s':>10} {'lookup us/chain':>16}"]
    for name, e in r["engines"].items():
        lines.append(f"{name:<8} {e['put_MBps']:>10.1f} {e['get_MBps']:>10.1f} {e['lookup_us_per_chain']:>16.1f}")
    x = r["rocksdb_vs_lmdb"]
    lines.append(f"rocksdb / lmdb: put {x['put']:.2f}x, get {x['get']:.2f}x, lookup speed {x['lookup_speed']:.2f}x")
    return "\n".join(lines)


@click.command("engines", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--blocks", type=click.IntRange(min=1), default=2048, show_default=True, help="blocks per run")
@click.option("--block-bytes", type=click.IntRange(min=1), default=64 * 1024, show_default=True, help="bytes per block")
@click.option("--chain-blocks", type=click.IntRange(min=1), default=32, show_default=True, help="blocks per chain and per put")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="runs per engine; the median is reported")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None, help="scratch directory (default: system temp)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def command(blocks: int, block_bytes: int, chain_blocks: int, repeat: int, scratch_dir: str | None, as_json: bool) -> None:
    """The LMDB and RocksDB engines side by side through the Store API (put, get, lookup).

    \b
    Example:
        ucm-db bench engines --blocks 2000 --repeat 5
    """
    if blocks < chain_blocks:
        raise click.BadParameter(f"--blocks {blocks} is fewer than one chain of --chain-blocks {chain_blocks}", param_hint="--blocks")
    report = compare(blocks, block_bytes, chain_blocks, repeat, scratch_dir)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
