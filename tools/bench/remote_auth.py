"""What authenticating remote objects costs: ``ucm-db bench remote-codec --auth``.

For each link (a ``throttled://`` remote of the given bandwidths, and an
unthrottled ``file://`` directory on the local disk), with the local tier
and the remote on codec ``none`` (so the codec's cost does not hide the
MAC's), and with and without ``remote_auth_key_file``:

* read-through: an empty local tier reads every block of a chain with
  ``get`` (fetch, MAC check when a key is set, verify, promote, decode);
  raw bytes / seconds;
* warm: another empty local tier pulls the chain with ``Store.warm``
  (fetch, MAC, verify, promote); raw bytes / seconds;
* upload: write-back puts of the chain until the uploader drained it
  (signing happens here); raw bytes / seconds;
* one fetch: a 2 MiB object read from a ``file://`` directory in the page
  cache and verified (the remote tier's own fetch, one thread), with and
  without its MAC check: min and median of 15 passes over 16 objects;
* the MAC alone: HMAC-SHA256 (:func:`ucm_db.components.auth_mac`, as the product computes it)
  over 64 MiB on one core, best of 5: what one core can authenticate.

Figures are medians of ``--runs`` runs, auth on and off alternating first;
the ratio of interest is read-through with auth over without (issue 26
target >= 0.95x at 400 MB/s).
"""

from __future__ import annotations

import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db import Namespace
from ucm_db.components import AuthKeys, RemoteRoot, auth_mac, codec
from ucm_db.tools.bench.throttle import register

NAMESPACE = Namespace(model="bench/remote-auth", kv_dtype="bfloat16", block_size=16)
BLOCK_BYTES = 2 << 20

LOCAL = "local file://"
MODES = ("off", "on")


def _payloads(count: int) -> list[memoryview]:
    from ucm_db.tools.bench.kv_sample import capture_kv_in_subprocess, kv_blocks

    stream = capture_kv_in_subprocess()
    return [memoryview(block) for block in kv_blocks(stream, BLOCK_BYTES, count)]


def remote_link(scratch: Path, link: float | str, name: str) -> dict[str, Any]:
    """Store options of a fresh remote under ``scratch``: a ``file://``
    directory for :data:`LOCAL`, else a ``throttled://`` one at ``link`` MB/s."""
    directory = scratch / name
    directory.mkdir()
    if link == LOCAL:
        return {"remote": f"file://{directory}"}
    return {"remote": "throttled://kv", "remote_options": {"path": str(directory), "bandwidth_bytes_per_s": float(link) * 1e6}}


def _one_run(scratch: Path, link: float | str, mode: str, payloads: list[memoryview], key_file: Path, run: int) -> dict[str, float]:
    tag = f"{mode}-{str(link).split()[0]}-{run}"
    remote = remote_link(scratch, link, f"remote-{tag}")
    auth = {"remote_auth_key_file": str(key_file)} if mode == "on" else {}
    keys = NAMESPACE.block_keys(list(range(len(payloads) * NAMESPACE.block_size)), extras={"run": tag})
    raw_bytes = sum(len(p) for p in payloads)
    common = {"codec": "none", "capacity_bytes": 4 << 30, **remote, **auth}
    with ucm_db.open(scratch / f"w-{tag}", remote_codec="none", **common) as writer:
        started = time.perf_counter()
        for i in range(0, len(keys), 8):
            writer.put(NAMESPACE, keys[i : i + 8], payloads[i : i + 8])
        writer.flush(upload_timeout_s=600)
        upload_s = time.perf_counter() - started
    with ucm_db.open(scratch / f"r-{tag}", remote_deadline_s=30, **common) as reader:
        started = time.perf_counter()
        blocks = reader.get(NAMESPACE, keys)
        read_s = time.perf_counter() - started
        if any(b is None for b in blocks):
            raise RuntimeError(f"read-through (auth {mode}) missed a block the writer uploaded: {reader.stats().remote}")
    with ucm_db.open(scratch / f"m-{tag}", remote_deadline_s=30, **common) as warmer:
        started = time.perf_counter()
        warmer.warm(NAMESPACE, keys=keys)
        warm_s = time.perf_counter() - started
        if warmer.lookup(NAMESPACE, keys, remote=False) != len(keys):
            raise RuntimeError(f"warm (auth {mode}) left blocks on the remote")
    return {"upload_raw_mb_s": raw_bytes / upload_s / 1e6, "read_through_raw_mb_s": raw_bytes / read_s / 1e6,
            "warm_raw_mb_s": raw_bytes / warm_s / 1e6}


def fetch_ms(scratch: Path, payload: memoryview, passes: int = 15, objects: int = 16) -> dict[str, dict[str, float]]:
    """Milliseconds of one verified fetch of a ``payload``-sized object, MAC off and on."""
    keys = AuthKeys((secrets.token_bytes(32),), "bench")
    namespace_id = NAMESPACE.id
    block_keys = [secrets.token_bytes(32) for _ in range(objects)]
    tiers = {}
    for mode in MODES:
        root = RemoteRoot.from_url(f"file://{scratch / ('fetch-' + mode)}", {})
        root.auth = keys if mode == "on" else None
        tiers[mode] = root.tier(namespace_id)
        for key in block_keys:
            tiers[mode].store(key, None, codec.encode(key, payload, codec="none"))
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for n in range(passes):
        for mode in (MODES if n % 2 == 0 else MODES[::-1]):
            started = time.perf_counter()
            if any(tiers[mode].fetch(key) is None for key in block_keys):
                raise RuntimeError(f"fetch (auth {mode}) missed an object it just wrote")
            samples[mode].append((time.perf_counter() - started) / objects * 1e3)
    return {m: {"min_ms": round(min(v), 3), "median_ms": round(statistics.median(v), 3)} for m, v in samples.items()}


def mac_mb_s_per_core() -> float:
    """The product's MAC throughput on one core (best of 5 over 64 MiB)."""
    data = os.urandom(64 << 20)
    best_s = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        auth_mac(secrets.token_bytes(32), [data], b"bench")
        best_s = min(best_s, time.perf_counter() - started)
    return round(len(data) / best_s / 1e6, 1)


def run(bandwidths_mb_s: list[float], blocks: int, runs: int) -> dict[str, Any]:
    """Auth on vs off per link; medians and ratios (module docstring)."""
    register()
    payloads = _payloads(blocks)
    links: list[float | str] = [*bandwidths_mb_s, LOCAL]
    rows: list[dict[str, Any]] = []
    ratios: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-auth-") as tmp:
        scratch = Path(tmp)
        key_file = scratch / "auth.key"
        key_file.write_text(secrets.token_hex(32) + "\n")
        os.chmod(key_file, 0o600)
        for link in links:
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for n in range(runs):
                for mode in (MODES if n % 2 == 0 else MODES[::-1]):  # alternate which goes first
                    samples[mode].append(_one_run(scratch, link, mode, payloads, key_file, n))
            medians = {m: {k: round(statistics.median(s[k] for s in samples[m]), 1) for k in samples[m][0]} for m in MODES}
            for mode in MODES:
                rows.append({"link": f"{link:g} MB/s" if isinstance(link, float) else link, "auth": mode, **medians[mode],
                             "read_through_samples": [round(s["read_through_raw_mb_s"], 1) for s in samples[mode]]})
            ratios[rows[-1]["link"]] = {f"{k.removesuffix('_raw_mb_s')}_auth_over_none": round(medians["on"][k] / medians["off"][k], 3)
                                        for k in medians["on"]}
        fetch = fetch_ms(scratch, payloads[0])
    return {"blocks": blocks, "block_bytes": len(payloads[0]), "runs": runs, "rows": rows, "ratios": ratios,
            "fetch_2mib_ms": fetch,
            "mac_mb_s_per_core": mac_mb_s_per_core(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
