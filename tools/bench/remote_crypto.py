"""What encrypting remote objects costs: ``ucm-db bench remote-crypto``.

* Per-core throughput (one thread, best of ``--passes``) of the product's
  sealing (:class:`ucm_db.components.SealingKeys`: AES-256-GCM with the
  object's associated data) and opening, beside HMAC-SHA256
  (:func:`ucm_db.components.auth_mac`, the MAC as the product computes it),
  on objects of 64 KiB to 2 MiB (each pass covers ``--mib`` MiB of them).
* Read-through with vs without ``remote_encryption_key_file``: a writer
  uploads a chain of ``--blocks`` 2 MiB blocks (random bytes, codec
  ``none`` on both tiers so the codec does not hide the cipher); an empty
  local tier then reads every block with ``get`` (fetch, decrypt when
  keyed, verify, promote, decode); raw bytes / seconds, through a
  ``throttled://`` remote of each ``--bandwidth-mb-s`` and an unthrottled
  ``file://`` directory. Medians of ``--runs`` runs, encryption on and off
  alternating first; the ratio of interest is on over off at 400 MB/s
  (issue 46 target >= 0.95x).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

import ucm_db
from ucm_db import Namespace
from ucm_db.components import SealingKeys, auth_mac
from ucm_db.tools.bench.remote_auth import LOCAL, remote_link
from ucm_db.tools.bench.throttle import register

NAMESPACE = Namespace(model="bench/remote-crypto", kv_dtype="bfloat16", block_size=16)
BLOCK_BYTES = 2 << 20
SIZES = (64 << 10, 256 << 10, 1 << 20, 2 << 20)
MODES = ("off", "on")
#: What a remote object's sealing context holds (label, key, envelope): its size, not its bytes, matters here.
_CONTEXT = bytes(17) + bytes(32) + bytes(64)


def _best_gb_s(step: Any, objects: list[bytes], passes: int) -> float:
    best_s = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for obj in objects:
            step(obj)
        best_s = min(best_s, time.perf_counter() - started)
    return round(sum(len(o) for o in objects) / best_s / 1e9, 3)


def per_core(total_mib: int, passes: int) -> list[dict[str, Any]]:
    """GB/s on one thread of seal, open and HMAC-SHA256 per object size."""
    keys = SealingKeys((secrets.token_bytes(32),), "bench")
    mac_key = secrets.token_bytes(32)
    rows = []
    for size in SIZES:
        plain = [os.urandom(size) for _ in range(max(1, (total_mib << 20) // size))]
        sealed = [keys.seal(p, _CONTEXT) for p in plain]
        rows.append({
            "object_kib": size >> 10,
            "seal_gb_s": _best_gb_s(lambda p: keys.seal_parts(p, _CONTEXT), plain, passes),
            "open_gb_s": _best_gb_s(lambda s: keys.open(s, _CONTEXT), sealed, passes),
            "hmac_sha256_gb_s": _best_gb_s(lambda p: auth_mac(mac_key, [p], b"bench"), plain, passes),
        })
    return rows


def _one_run(scratch: Path, link: float | str, mode: str, payloads: list[bytes], key_file: Path, run: int) -> float:
    """Read-through raw MB/s of one run."""
    tag = f"{mode}-{str(link).split()[0]}-{run}"
    keyed = {"remote_encryption_key_file": str(key_file)} if mode == "on" else {}
    keys = NAMESPACE.block_keys(list(range(len(payloads) * NAMESPACE.block_size)), extras={"run": tag})
    common = {"codec": "none", "capacity_bytes": 4 << 30, **remote_link(scratch, link, f"remote-{tag}"), **keyed}
    with ucm_db.open(scratch / f"w-{tag}", remote_codec="none", **common) as writer:
        for i in range(0, len(keys), 8):
            writer.put(NAMESPACE, keys[i : i + 8], payloads[i : i + 8])
        writer.flush(upload_timeout_s=600)
    with ucm_db.open(scratch / f"r-{tag}", remote_deadline_s=30, **common) as reader:
        started = time.perf_counter()
        blocks = reader.get(NAMESPACE, keys)
        read_s = time.perf_counter() - started
        if any(b is None for b in blocks):
            raise RuntimeError(f"read-through (encryption {mode}) missed a block the writer uploaded: {reader.stats().remote}")
    return sum(len(p) for p in payloads) / read_s / 1e6


def read_through(bandwidths_mb_s: list[float], blocks: int, runs: int) -> dict[str, Any]:
    """Read-through with encryption on vs off per link: medians, samples, ratios."""
    register()
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(blocks)]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-crypto-") as tmp:
        scratch = Path(tmp)
        key_file = scratch / "encryption.key"
        key_file.write_text(secrets.token_hex(32) + "\n")
        os.chmod(key_file, 0o600)
        for link in [*bandwidths_mb_s, LOCAL]:
            samples: dict[str, list[float]] = {m: [] for m in MODES}
            for n in range(runs):
                for mode in (MODES if n % 2 == 0 else MODES[::-1]):  # alternate which goes first
                    samples[mode].append(_one_run(scratch, link, mode, payloads, key_file, n))
            name = f"{link:g} MB/s" if isinstance(link, float) else link
            medians = {m: round(statistics.median(samples[m]), 1) for m in MODES}
            rows[name] = {"plain_mb_s": medians["off"], "encrypted_mb_s": medians["on"],
                          "encrypted_over_plain": round(medians["on"] / medians["off"], 3),
                          "samples": {m: [round(s, 1) for s in v] for m, v in samples.items()}}
    return rows


@click.command("remote-crypto", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bandwidth-mb-s", default="400", show_default=True, help="comma list of throttled link bandwidths (MB/s)")
@click.option("--blocks", type=click.IntRange(min=4), default=48, show_default=True, help="2 MiB blocks per read-through run")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="read-through runs per mode; medians reported")
@click.option("--mib", type=click.IntRange(min=1), default=64, show_default=True, help="MiB of objects per per-core pass")
@click.option("--passes", type=click.IntRange(min=1), default=5, show_default=True, help="per-core passes; best reported")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(bandwidth_mb_s: str, blocks: int, runs: int, mib: int, passes: int, as_json: bool) -> None:
    """AES-256-GCM sealing/opening vs HMAC-SHA256 per core, and read-through with vs without encryption.

    \b
    Example:
        ucm-db bench remote-crypto --bandwidth-mb-s 400 --runs 5
    """
    bandwidths = [float(x) for x in bandwidth_mb_s.split(",") if x.strip()]
    result = {"per_core": per_core(mib, passes), "read_through": read_through(bandwidths, blocks, runs),
              "blocks": blocks, "block_bytes": BLOCK_BYTES, "runs": runs, "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"one thread, best of {passes} passes over {mib} MiB (GB/s)")
    click.echo(f"{'object KiB':>10} {'AES-GCM seal':>13} {'AES-GCM open':>13} {'HMAC-SHA256':>12}")
    for row in result["per_core"]:
        click.echo(f"{row['object_kib']:>10} {row['seal_gb_s']:>13.3f} {row['open_gb_s']:>13.3f} {row['hmac_sha256_gb_s']:>12.3f}")
    click.echo(f"read-through of {blocks} blocks of {BLOCK_BYTES >> 20} MiB (random bytes, codec none), median of {runs} runs")
    click.echo(f"{'link':>14} {'plain MB/s':>11} {'encrypted MB/s':>15} {'ratio':>6}  samples (off / on)")
    for link, row in result["read_through"].items():
        click.echo(f"{link:>14} {row['plain_mb_s']:>11.1f} {row['encrypted_mb_s']:>15.1f} {row['encrypted_over_plain']:>6.3f}  "
                   f"{row['samples']['off']} / {row['samples']['on']}")
    click.echo(f"{result['cpus']} CPUs, load average {', '.join(f'{x:.1f}' for x in result['load_average'])} at the end")
