"""Remote tier benchmark: ``ucm-db bench remote`` (also ``python -m ucm_db.tools.bench remote``).

Measures, against a ``file://`` directory and a real S3 API (moto's
ThreadedMotoServer on 127.0.0.1, started here):

* upload: the write-back uploader draining N queued blocks (LMDB read,
  envelope, whole-object write, dequeue) vs raw fsspec ``pipe_file`` of the
  same object bytes with the same number of threads;
* download: the remote read path (fetch + verify, the read pool's
  threads) and warming those blocks into an empty store (fetch, verify,
  promote into LMDB), each vs raw fsspec ``cat_file`` of the same objects
  with the same number of threads;
* lookup: the remote prefix search over an 8192-block chain, counting
  sequential round trips and requests, for a full, half and empty remote;
* remote down: lookup latency against the deadline when every request
  hangs (``ucmbench-down://``, :mod:`ucm_db.tools.bench.down_remote`), with the
  local prefix still served.

Every figure is the median of ``--repeat`` runs; ratios compare runs made
in the same process, interleaved.

Invariants:
    * Scratch stores and remote roots live in a temp directory removed at
      the end; the moto server is stopped.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import Namespace
from ucm_db.components import (
    READ_THREADS,
    BlockEntry,
    RemoteLink,
    RemoteRoot,
    Uploader,
    codec,
    is_local_fs,
    local_tier,
    pack_object,
    remote_link,
    write_whole,
)

NAMESPACE = Namespace(model="bench/remote", kv_dtype="bfloat16", block_size=16)
LOOKUP_BLOCKS = 8192
DEFAULTS: dict[str, Any] = {
    "targets": "file,s3", "blocks": 128, "block_kib": 256, "concurrency": 4, "repeat": 3,
    "lookup_blocks": LOOKUP_BLOCKS, "deadline_s": 0.2, "scratch_dir": None,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoS3:
    """A moto S3 server on 127.0.0.1 with one new, empty bucket, ``bucket``
    (context manager). moto keeps its buckets in process-wide state, so each
    server of a process gets a bucket name of its own."""

    def __enter__(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.options = {"endpoint_url": f"http://{host}:{port}", "key": "bench", "secret": "bench", "anon": False}
        import fsspec

        self.bucket = f"ucm-bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3", **self.options, skip_instance_cache=True).mkdir(self.bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def _payloads(n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of ``n`` keys and half-random (so half-compressible) payloads."""
    tokens = list(range(n * NAMESPACE.block_size))
    keys = NAMESPACE.block_keys(tokens)
    return keys, [os.urandom(size // 2) + bytes(size - size // 2) for _ in keys]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _thread_map(threads: int, fn: Callable[[Any], Any], items: list[Any]) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))


def _queued_store(path: Path, keys: list[bytes], payloads: list[bytes]) -> tuple[ucm_db.Store, list[bytes]]:
    """A store (no remote) whose blocks sit in the upload queue, as a
    write-back put leaves them; returns it and the encoded blobs."""
    store = ucm_db.open(path, capacity_bytes=4 << 30)
    blobs = [codec.encode(k, p, codec="zstd") for k, p in zip(keys, payloads)]
    ns_id = NAMESPACE.id
    entries = [BlockEntry.of_blob(k, keys[i - 1] if i else None, b, len(p), ns_id) for i, (k, b, p) in enumerate(zip(keys, blobs, payloads))]
    desc = (ns_id, json.dumps(NAMESPACE.to_dict(), sort_keys=True).encode())
    local_tier(store).put_blocks(entries, namespace_desc=desc, enqueue_upload=True)
    return store, blobs


def bench_transfer(url_of: Callable[[], str], options: dict[str, Any], scratch: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Upload and download throughput: ucm-db vs raw fsspec, interleaved."""
    keys, payloads = _payloads(cfg["blocks"], cfg["block_kib"] * 1024)
    ns_id = NAMESPACE.id
    runs: dict[str, list[float]] = {"upload": [], "raw_pipe": [], "download": [], "fetch": [], "raw_cat": []}
    total_bytes = 0
    raw_pool = ThreadPoolExecutor(READ_THREADS)  # both readers use warm pools of READ_THREADS threads
    list(raw_pool.map(time.sleep, [0.01] * READ_THREADS))
    for rep in range(cfg["repeat"]):
        url = url_of()
        store, blobs = _queued_store(scratch / f"up-{rep}", keys, payloads)
        objects = [pack_object(k, keys[i - 1] if i else None, ns_id, b) for i, (k, b) in enumerate(zip(keys, blobs))]
        total_bytes = sum(len(o) for o in objects)
        root = RemoteRoot.from_url(url, options)
        uploader = Uploader(local_tier(store), root, store.path, concurrency=cfg["concurrency"])
        started = time.perf_counter()
        while uploader.drain_batch()[0]:
            pass
        runs["upload"].append(time.perf_counter() - started)
        assert not local_tier(store).pending_uploads(limit=1), "upload queue not drained"
        store.close()
        raw_root = RemoteRoot.from_url(url_of(), options)
        raw_paths = [raw_root.object_path(ns_id, k) for k in keys]
        for directory in {p.rsplit("/", 1)[0] for p in raw_paths}:
            raw_root.fs.makedirs(directory, exist_ok=True)  # fsspec's local pipe_file needs them; not timed
        started = time.perf_counter()
        _thread_map(cfg["concurrency"], lambda item: raw_root.fs.pipe_file(*item), list(zip(raw_paths, objects)))
        runs["raw_pipe"].append(time.perf_counter() - started)
        if is_local_fs(raw_root.fs):  # the same write made crash-safe: temp file, fsync, rename
            started = time.perf_counter()
            _thread_map(cfg["concurrency"], lambda item: write_whole(raw_root.fs, *item), list(zip(raw_paths, objects)))
            runs.setdefault("raw_atomic", []).append(time.perf_counter() - started)
        with ucm_db.open(scratch / f"down-{rep}", capacity_bytes=4 << 30, remote=url, remote_options=options) as reader:
            started = time.perf_counter()
            report = reader.warm(NAMESPACE, keys=keys)
            runs["download"].append(time.perf_counter() - started)
            assert report.fetched == len(keys), report
        link = RemoteLink(url, options)
        link.fetch_many(ns_id, [bytes(32)] * READ_THREADS, time.monotonic() + 30)  # misses: starts its threads
        started = time.perf_counter()
        fetched = link.fetch_many(ns_id, keys, time.monotonic() + 120)
        runs["fetch"].append(time.perf_counter() - started)
        assert all(obj is not None for obj in fetched)
        link.close()
        started = time.perf_counter()
        list(raw_pool.map(raw_root.fs.cat_file, raw_paths))
        runs["raw_cat"].append(time.perf_counter() - started)
    mb = total_bytes / 1e6
    out = {name: {"median_s": round(_median(v), 4), "MB_per_s": round(mb / _median(v), 1), "runs_s": [round(x, 4) for x in v]}
           for name, v in runs.items()}
    out["object_MB"] = round(mb, 2)
    out["upload_vs_raw"] = round(_median(runs["raw_pipe"]) / _median(runs["upload"]), 2)
    out["download_vs_raw"] = round(_median(runs["raw_cat"]) / _median(runs["download"]), 2)
    out["fetch_vs_raw"] = round(_median(runs["raw_cat"]) / _median(runs["fetch"]), 2)
    raw_pool.shutdown()
    if "raw_atomic" in runs:
        out["upload_vs_raw_atomic"] = round(_median(runs["raw_atomic"]) / _median(runs["upload"]), 2)
    out["upload_threads"], out["download_threads"] = cfg["concurrency"], READ_THREADS
    return out


def bench_lookup(url: str, options: dict[str, Any], scratch: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Round trips of the remote prefix search over a long chain."""
    n = cfg["lookup_blocks"]
    keys, payloads = _payloads(n, 64)
    ns_id = NAMESPACE.id
    root = RemoteRoot.from_url(url, options)
    tier = root.tier(ns_id)
    objects = {tier.path(k): pack_object(k, keys[i - 1] if i else None, ns_id, codec.encode(k, p, codec="none"))
               for i, (k, p) in enumerate(zip(keys, payloads))}
    paths = list(objects)
    out: dict[str, Any] = {"blocks": n}
    with ucm_db.open(scratch / "lookup", capacity_bytes=1 << 30, remote=url, remote_options=options,
                     remote_deadline_s=30.0) as store:
        link = remote_link(store)
        assert link is not None
        written = 0
        for label, present in (("empty", 0), ("half", n // 2), ("full", n)):
            _thread_map(16, lambda p: write_whole(root.fs, p, objects[p]), paths[written:present])
            written = present
            times, result = [], None
            for _ in range(cfg["repeat"]):
                started = time.perf_counter()
                result = link.search(ns_id, keys, time.monotonic() + 30.0)
                times.append(time.perf_counter() - started)
            assert result is not None and result.count == present, (label, result)
            out[label] = {"found": result.count, "round_trips": result.rounds, "requests": result.requests,
                          "median_ms": round(_median(times) * 1e3, 2)}
        started = time.perf_counter()
        promoted = store.lookup(NAMESPACE, keys)
        out["lookup_with_promotion"] = {"blocks_local_after": promoted, "seconds": round(time.perf_counter() - started, 3)}
    return out


def bench_down(scratch: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Lookup latency while every remote request hangs."""
    from ucm_db.tools.bench import down_remote

    down_remote.register()
    keys, payloads = _payloads(64, 1024)
    switch = down_remote.DownSwitch(hang_s=30.0)
    deadline_s = cfg["deadline_s"]
    remote = f"{down_remote.PROTOCOL}://{scratch}/down-remote"
    times = []
    try:
        with ucm_db.open(scratch / "down", capacity_bytes=1 << 30, remote=remote, remote_deadline_s=deadline_s,
                         remote_options={"switch": switch}) as store:
            store.put(NAMESPACE, keys[:32], payloads[:32])
            store.flush()
            switch.take_down()
            for _ in range(max(8, cfg["repeat"])):
                started = time.perf_counter()
                found = store.lookup(NAMESPACE, keys)
                times.append(time.perf_counter() - started)
                assert found == 32, found
                time.sleep(0.06)  # let the breaker half-open so some lookups try the remote again
            local_ok = store.get(NAMESPACE, keys[:32]) == payloads[:32]
    finally:
        switch.heal()
    return {"deadline_s": deadline_s, "lookup_median_ms": round(_median(times) * 1e3, 1),
            "lookup_max_ms": round(max(times) * 1e3, 1), "runs_ms": [round(t * 1e3, 1) for t in times],
            "local_hits_served": local_ok}


def run(args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Runs the remote benchmark (options as in :data:`DEFAULTS`); returns the figures as a dict."""
    given = dict(args or {})
    cfg = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    targets = [t.strip() for t in str(cfg["targets"]).split(",") if t.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="ucm-bench-remote-", dir=cfg["scratch_dir"]))
    results: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if k != "scratch_dir"}}
    try:
        if "file" in targets:
            results["file"] = {
                "transfer": bench_transfer(lambda: f"file://{scratch}/remote-{uuid.uuid4().hex[:8]}", {}, scratch / "f", cfg),
                "lookup": bench_lookup(f"file://{scratch}/lookup-remote", {}, scratch / "fl", cfg),
            }
        if "s3" in targets:
            with MotoS3() as s3:
                results["s3"] = {
                    "transfer": bench_transfer(lambda: f"s3://{s3.bucket}/{uuid.uuid4().hex[:8]}", s3.options, scratch / "s", cfg),
                    "lookup": bench_lookup(f"s3://{s3.bucket}/lookup", s3.options, scratch / "sl", cfg),
                }
        results["remote_down"] = bench_down(scratch, cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


@click.command("remote", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--targets", help="comma list of file, s3 (default: file,s3)")
@click.option("--blocks", type=click.IntRange(min=1), help="blocks per transfer run (default 128)")
@click.option("--block-kib", type=click.IntRange(min=1), help="raw KiB per block (default 256)")
@click.option("--concurrency", type=click.IntRange(min=1), help="upload threads, ucm-db and raw fsspec alike (default 4)")
@click.option("--repeat", type=click.IntRange(min=1), help="runs per figure; the median is reported (default 3)")
@click.option("--lookup-blocks", type=click.IntRange(min=2), help="chain length of the lookup test (default 8192)")
@click.option("--deadline-s", type=click.FloatRange(min=0, min_open=True), help="remote_deadline_s for the remote-down test (default 0.2)")
@click.option("--scratch-dir", type=click.Path(file_okay=False), help="parent of the scratch stores")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(as_json: bool, **options: Any) -> None:
    """The remote tier against raw fsspec: upload, download, lookup round trips, a remote that is down.

    \b
    Example:
        ucm-db bench remote --targets file --repeat 3
    """
    results = run(options)
    click.echo(json.dumps(results, indent=2) if as_json else _human(results))


def _human(results: dict[str, Any]) -> str:
    lines = []
    for target in ("file", "s3"):
        if target not in results:
            continue
        t, lk = results[target]["transfer"], results[target]["lookup"]
        lines.append(f"[{target}] {t['object_MB']} MB of objects")
        lines.append(f"  upload   {t['upload']['MB_per_s']:>8} MB/s vs raw pipe_file {t['raw_pipe']['MB_per_s']:>8} MB/s"
                     f" ({t['upload_threads']} threads): {t['upload_vs_raw']}x")
        if "raw_atomic" in t:
            lines.append(f"  upload vs raw temp+fsync+rename {t['raw_atomic']['MB_per_s']:>8} MB/s: {t['upload_vs_raw_atomic']}x")
        lines.append(f"  fetch+verify {t['fetch']['MB_per_s']:>8} MB/s vs raw cat_file {t['raw_cat']['MB_per_s']:>8} MB/s"
                     f" ({t['download_threads']} threads): {t['fetch_vs_raw']}x")
        lines.append(f"  download into the local tier (warm: fetch, verify, LMDB commit) {t['download']['MB_per_s']:>8} MB/s:"
                     f" {t['download_vs_raw']}x raw cat_file")
        for label in ("full", "half", "empty"):
            r = lk[label]
            lines.append(f"  lookup {lk['blocks']} blocks, remote {label:5}: found {r['found']}, {r['round_trips']} round trips,"
                         f" {r['requests']} requests, {r['median_ms']} ms")
    down = results["remote_down"]
    lines.append(f"[remote down] lookup median {down['lookup_median_ms']} ms, max {down['lookup_max_ms']} ms"
                 f" (deadline {down['deadline_s'] * 1e3:.0f} ms); local hits served: {down['local_hits_served']}")
    return "\n".join(lines)

