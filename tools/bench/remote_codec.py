"""Codec per tier on a bandwidth-limited remote: ``ucm-db bench remote-codec``.

For each link bandwidth (a ``throttled://`` remote, :mod:`.throttle`: one
token bucket for every byte in or out) and each remote codec (``none``,
``zstd``, ``auto``), with the local tier on codec ``none``:

* upload: puts N blocks of real bf16 K/V (write-back) and waits for the
  uploader to drain; raw bytes / seconds from the first put to the drained
  queue (the local puts, about as fast as a 400 MB/s link here, count in);
* drain: the uploader alone on a backlog of N queued blocks (the puts run
  while the bench holds the store's uploader election lock, as another
  process would; the clock starts when it lets go): raw bytes / seconds;
* read-through: an empty local tier over that remote reads every block
  with ``get`` (fetch, verify, promote, decode into new buffers); raw bytes /
  seconds;
* warm: another empty local tier pulls the same chain into itself with
  ``Store.warm`` (fetch, verify, promote: what a serving node's lookups
  do), without decoding anything for a caller; raw bytes / seconds;
* baseline: raw ``cat_file`` of the same objects through the same link and
  the same number of threads, and the link's own bandwidth.

Figures are medians of ``--runs`` runs; the ratio of interest is zstd's raw
throughput over none's at the same bandwidth (issue target >= 1.3x).
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import Namespace
from ucm_db.components import UPLOADER_LOCK_NAME  # the drain bench plays another process holding the election lock
from ucm_db.tools.bench.throttle import register

NAMESPACE = Namespace(model="bench/remote-codec", kv_dtype="bfloat16", block_size=16)
CODECS = ("none", "zstd", "auto")
BLOCK_BYTES = 2 << 20
READ_THREADS = 4


def _payloads(count: int) -> list[memoryview]:
    from ucm_db.tools.bench.kv_sample import capture_kv_in_subprocess, kv_blocks

    stream = capture_kv_in_subprocess()
    return [memoryview(block) for block in kv_blocks(stream, BLOCK_BYTES, count)]


def _one_run(scratch: Path, bandwidth: float, remote_codec: str, payloads: list[memoryview], run: int) -> dict[str, float]:
    remote_dir = scratch / f"remote-{remote_codec}-{int(bandwidth)}-{run}"
    remote_dir.mkdir()
    remote = {"remote": "throttled://kv", "remote_options": {"path": str(remote_dir), "bandwidth_bytes_per_s": bandwidth}}
    keys = NAMESPACE.block_keys(list(range(len(payloads) * NAMESPACE.block_size)), extras={"run": f"{remote_codec}{run}"})
    raw_bytes = sum(len(p) for p in payloads)
    with ucm_db.open(scratch / f"w-{remote_codec}-{int(bandwidth)}-{run}", codec="none", capacity_bytes=4 << 30,
                     remote_codec=remote_codec, **remote) as writer:
        started = time.perf_counter()
        for i in range(0, len(keys), 8):
            writer.put(NAMESPACE, keys[i : i + 8], payloads[i : i + 8])
        writer.flush(upload_timeout_s=600)
        upload_s = time.perf_counter() - started
        choice = writer.stats().remote.get("codec", {}).get("codec", remote_codec)
    drain_remote = {"remote": "throttled://kv", "remote_options": {"path": str(remote_dir) + "-drain", "bandwidth_bytes_per_s": bandwidth}}
    drain_s = _backlog_drain_s(scratch / f"d-{remote_codec}-{int(bandwidth)}-{run}", remote_codec, drain_remote, payloads, keys)
    with ucm_db.open(scratch / f"r-{remote_codec}-{int(bandwidth)}-{run}", codec="none", capacity_bytes=4 << 30,
                     remote_deadline_s=30, **remote) as reader:
        started = time.perf_counter()
        blocks = reader.get(NAMESPACE, keys)
        read_s = time.perf_counter() - started
        if any(b is None for b in blocks):
            raise RuntimeError("read-through missed a block the writer uploaded")
    with ucm_db.open(scratch / f"m-{remote_codec}-{int(bandwidth)}-{run}", codec="none", capacity_bytes=4 << 30,
                     remote_deadline_s=30, **remote) as warmer:
        started = time.perf_counter()
        report = warmer.warm(NAMESPACE, keys=keys)
        warm_s = time.perf_counter() - started
        if warmer.lookup(NAMESPACE, keys, remote=False) != len(keys):
            raise RuntimeError(f"warm left blocks on the remote: {report}")
    files = sorted(p for p in remote_dir.rglob("*") if p.is_file() and len(p.name) == 64)
    fs_bytes = sum(p.stat().st_size for p in files)
    import fsspec

    fs, root = fsspec.core.url_to_fs("throttled://kv", **remote["remote_options"])
    relative = [str(p.relative_to(remote_dir / "kv")) for p in files]
    started = time.perf_counter()
    with ThreadPoolExecutor(READ_THREADS) as pool:
        list(pool.map(lambda rel: fs.cat_file(f"{root}/{rel}"), relative))
    cat_s = time.perf_counter() - started
    return {
        "upload_raw_mb_s": raw_bytes / upload_s / 1e6, "drain_raw_mb_s": raw_bytes / drain_s / 1e6, "read_through_raw_mb_s": raw_bytes / read_s / 1e6,
        "warm_raw_mb_s": raw_bytes / warm_s / 1e6,
        "cat_file_mb_s": fs_bytes / cat_s / 1e6, "stored_ratio": raw_bytes / fs_bytes if fs_bytes else 0.0,
        "auto_choice": choice,
    }


def _backlog_drain_s(store_dir: Path, remote_codec: str, remote: dict[str, Any], payloads: list[memoryview],
                     keys: list[bytes]) -> float:
    """Seconds the uploader takes to drain a backlog of ``payloads``."""
    store_dir.mkdir()
    lock_fd = os.open(store_dir / UPLOADER_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # this store's uploader waits, as if another process held the queue
        with ucm_db.open(store_dir, codec="none", capacity_bytes=4 << 30, remote_codec=remote_codec, **remote) as writer:
            for i in range(0, len(keys), 8):
                writer.put(NAMESPACE, keys[i : i + 8], payloads[i : i + 8])
            if writer.stats().remote.get("uploaded"):
                raise RuntimeError("the uploader ran while the bench held its election lock: the drain would be short")
            started = time.perf_counter()
            os.close(lock_fd)
            lock_fd = -1
            writer.flush(upload_timeout_s=600)
            drain_s = time.perf_counter() - started
            uploaded = writer.stats().remote.get("uploaded")
            if uploaded != len(keys):  # e.g. eviction took queued blocks: the rate would count bytes never sent
                raise RuntimeError(f"the drain uploaded {uploaded} of {len(keys)} blocks")
            return drain_s
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


def run(bandwidths_mb_s: list[float], blocks: int, runs: int) -> dict[str, Any]:
    register()
    payloads = _payloads(blocks)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ucm-bench-codec-") as tmp:
        scratch = Path(tmp)
        for bandwidth_mb_s in bandwidths_mb_s:
            samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CODECS}
            for n in range(runs):
                for remote_codec in CODECS[n % len(CODECS):] + CODECS[: n % len(CODECS)]:  # rotate the order
                    samples[remote_codec].append(_one_run(scratch, bandwidth_mb_s * 1e6, remote_codec, payloads, n))
            for remote_codec, results in samples.items():
                row: dict[str, Any] = {"bandwidth_mb_s": bandwidth_mb_s, "remote_codec": remote_codec}
                for name in ("upload_raw_mb_s", "drain_raw_mb_s", "read_through_raw_mb_s", "warm_raw_mb_s", "cat_file_mb_s", "stored_ratio"):
                    row[name] = round(statistics.median(r[name] for r in results), 2)
                row["auto_choice"] = [r["auto_choice"] for r in results]
                rows.append(row)
    by = {(r["bandwidth_mb_s"], r["remote_codec"]): r for r in rows}
    ratios = {
        f"{bw:g}": {
            "upload_zstd_over_none": round(by[(bw, "zstd")]["upload_raw_mb_s"] / by[(bw, "none")]["upload_raw_mb_s"], 2),
            "drain_zstd_over_none": round(by[(bw, "zstd")]["drain_raw_mb_s"] / by[(bw, "none")]["drain_raw_mb_s"], 2),
            "read_zstd_over_none": round(by[(bw, "zstd")]["read_through_raw_mb_s"] / by[(bw, "none")]["read_through_raw_mb_s"], 2),
            "upload_auto_over_best": round(by[(bw, "auto")]["upload_raw_mb_s"] / max(
                by[(bw, "zstd")]["upload_raw_mb_s"], by[(bw, "none")]["upload_raw_mb_s"]), 2),
            "read_through_none_over_cat_file": round(
                by[(bw, "none")]["read_through_raw_mb_s"] / by[(bw, "none")]["cat_file_mb_s"], 2),
            "warm_none_over_cat_file": round(by[(bw, "none")]["warm_raw_mb_s"] / by[(bw, "none")]["cat_file_mb_s"], 2),
        }
        for bw in bandwidths_mb_s
    }
    return {"blocks": blocks, "block_bytes": BLOCK_BYTES, "runs": runs, "rows": rows, "ratios": ratios}


@click.command("remote-codec", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bandwidth-mb-s", default="100,400", show_default=True, help="comma list of link bandwidths (MB/s)")
@click.option("--blocks", type=click.IntRange(min=4), default=48, show_default=True, help="2 MiB blocks per run")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="runs per row; medians reported")
@click.option("--auth", is_flag=True, help="instead: read-through with vs without remote_auth_key_file (tools/bench/remote_auth.py)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(bandwidth_mb_s: str, blocks: int, runs: int, auth: bool, as_json: bool) -> None:
    """Remote codec none vs zstd vs auto on a bandwidth-limited remote (local tier: codec none).

    \b
    Example:
        ucm-db bench remote-codec --bandwidth-mb-s 100,400 --runs 3
        ucm-db bench remote-codec --auth --bandwidth-mb-s 400 --runs 5
    """
    bandwidths = [float(x) for x in bandwidth_mb_s.split(",") if x.strip()]
    if auth:
        _auth_command(bandwidths, blocks, runs, as_json)
        return
    result = run(bandwidths, blocks, runs)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{blocks} blocks of {BLOCK_BYTES >> 20} MiB real bf16 K/V, median of {runs} runs")
    click.echo(f"{'link MB/s':>10} {'codec':>6} {'upload raw MB/s':>16} {'drain raw MB/s':>15} {'read-through raw MB/s':>22} {'warm raw MB/s':>14} "
               f"{'cat_file MB/s':>14} {'ratio':>6}  auto chose")
    for row in result["rows"]:
        click.echo(f"{row['bandwidth_mb_s']:>10g} {row['remote_codec']:>6} {row['upload_raw_mb_s']:>16.1f} {row['drain_raw_mb_s']:>15.1f} "
                   f"{row['read_through_raw_mb_s']:>22.1f} {row['warm_raw_mb_s']:>14.1f} {row['cat_file_mb_s']:>14.1f} {row['stored_ratio']:>6.2f}  "
                   f"{','.join(row['auto_choice']) if row['remote_codec'] == 'auto' else ''}")
    for bandwidth, ratio in result["ratios"].items():
        click.echo(f"{bandwidth} MB/s: " + ", ".join(f"{k} {v}x" for k, v in ratio.items()))


def _auth_command(bandwidths: list[float], blocks: int, runs: int, as_json: bool) -> None:
    from ucm_db.tools.bench import remote_auth

    result = remote_auth.run(bandwidths, blocks, runs)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{blocks} blocks of {BLOCK_BYTES >> 20} MiB real bf16 K/V, codec none, median of {runs} runs")
    click.echo(f"{'link':>14} {'auth':>4} {'upload raw MB/s':>16} {'read-through raw MB/s':>22} {'warm raw MB/s':>14}  read-through samples")
    for row in result["rows"]:
        click.echo(f"{row['link']:>14} {row['auth']:>4} {row['upload_raw_mb_s']:>16.1f} {row['read_through_raw_mb_s']:>22.1f} "
                   f"{row['warm_raw_mb_s']:>14.1f}  {row['read_through_samples']}")
    for link, ratio in result["ratios"].items():
        click.echo(f"{link}: " + ", ".join(f"{k} {v}x" for k, v in ratio.items()))
    click.echo("one verified fetch of a 2 MiB object from the page cache (ms, min/median): " + ", ".join(
        f"auth {mode} {v['min_ms']}/{v['median_ms']}" for mode, v in result["fetch_2mib_ms"].items()))
    click.echo(f"HMAC-SHA256 (the MAC) on one core: {result['mac_mb_s_per_core']} MB/s; {result['cpus']} CPUs, "
               f"load average {', '.join(f'{x:.1f}' for x in result['load_average'])} at the end")
