"""Staged loads, as a list of rows against slabs over them: ``ucm-db bench staged``.

    ucm-db bench staged [--unit-kib 16,64,256] [--codec none --codec zstd] [--data bf16|random] [--rounds 9] [--json]

Where units cannot go straight into the KV cache (``load_mode: "layer"``,
every GPU layout), the connector reads them into staging rows of one array
and scatters them after. This times that read, ``Store.get_into`` of 64 MiB
of units into the rows, given as a list of row views (the connector before
bf3291f: a row needed only room) against :class:`ucm_db.ScatterSlabs` over
the same rows (since: a unit must fill its row, and the read takes the
native batch path). GB/s of unit bytes, medians of ``--rounds``, the two in
turns within each round; ``--data bf16`` is normal floats as bf16 (K/V's
byte statistics: zstd's byte planes compress), ``random`` incompressible.

Invariants:
    * Only ucm-db's public API; every read is checked loaded (all True).
    * Scratch stores are removed.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from typing import Any

import click
import numpy as np

import ucm_db
from ucm_db.tools.bench.common import int_list

TOTAL_BYTES = 64 << 20
PUT_UNITS = 64


def _payloads(unit_bytes: int, data: str, count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    if data == "random":
        return [rng.integers(0, 256, unit_bytes, dtype=np.uint8).tobytes() for _ in range(count)]
    floats = (rng.standard_normal(unit_bytes // 2 * count, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return [floats[i * (unit_bytes // 2):(i + 1) * (unit_bytes // 2)].tobytes() for i in range(count)]


def run_once(unit_kib: int, codec: str, data: str, rounds: int) -> dict[str, Any]:
    """One unit size and codec: ``{"list_GBps", "slabs_GBps", "ratio"}``."""
    unit_bytes = unit_kib << 10
    units = max(2, TOTAL_BYTES // unit_bytes)
    ns = ucm_db.Namespace(model="bench/staged", kv_dtype="bfloat16", block_size=16)
    keys = ns.block_keys(list(range(ns.block_size * units)))
    payload = _payloads(unit_bytes, data, min(units, PUT_UNITS))
    path = tempfile.mkdtemp(prefix="ucm-db-bench-staged-")
    try:
        with ucm_db.open(path, codec=codec, capacity_bytes=4 * TOTAL_BYTES + (256 << 20)) as store:
            for at in range(0, units, PUT_UNITS):
                chunk = keys[at:at + PUT_UNITS]
                store.put(ns, chunk, payload[:len(chunk)], parent=keys[at - 1] if at else None)
            store.flush()
            rows = np.zeros((units, unit_bytes), np.uint8)  # touched: fresh memory is backed lazily on this VM
            ways = {"list": [rows[i] for i in range(units)],
                    "slabs": ucm_db.ScatterSlabs([memoryview(rows.reshape(-1))], [unit_bytes], range(units))}
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for round_index in range(rounds + 2):  # two untimed rounds: the frame tables learned, pages cached
                for name, buffers in ways.items():
                    started = time.perf_counter()
                    loaded = store.get_into(ns, keys, buffers)
                    elapsed = time.perf_counter() - started
                    if not all(loaded):
                        raise RuntimeError(f"{name}: {loaded.count(False)} of {units} units not loaded")
                    if round_index >= 2:
                        seconds[name].append(elapsed)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    gbps = {name: units * unit_bytes / statistics.median(times) / 1e9 for name, times in seconds.items()}
    return {"unit_kib": unit_kib, "codec": codec, "data": data, "list_GBps": gbps["list"], "slabs_GBps": gbps["slabs"],
            "ratio": gbps["slabs"] / gbps["list"]}


@click.command("staged", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--unit-kib", default="16,64,256", show_default=True, callback=int_list, help="unit sizes, comma-separated")
@click.option("--codec", "codecs", type=click.Choice(["none", "zstd"]), multiple=True, default=("none", "zstd"),
              show_default=True, help="store codec (repeat the option for several)")
@click.option("--data", type=click.Choice(["bf16", "random"]), default="bf16", show_default=True,
              help="bf16: normal floats as bf16 (K/V-like); random: incompressible bytes")
@click.option("--rounds", type=click.IntRange(min=1), default=9, show_default=True, help="timed rounds (medians)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(unit_kib: list[int], codecs: tuple[str, ...], data: str, rounds: int, as_json: bool) -> None:
    """Staged loads: get_into a list of staging rows against ScatterSlabs over them.

    \b
    Example:
        ucm-db bench staged
        ucm-db bench staged --unit-kib 64 --codec zstd --data random --rounds 5
    """
    rows = [run_once(kib, codec, data, rounds) for kib in unit_kib for codec in codecs]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(f"{row['unit_kib']:>4} KiB {row['codec']:<4} {row['data']}: list {row['list_GBps']:.2f} GB/s, "
                   f"slabs {row['slabs_GBps']:.2f} GB/s, slabs / list {row['ratio']:.2f}x")


if __name__ == "__main__":
    command()
