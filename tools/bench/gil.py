"""What a thread beside the model's costs it, in one process.

A vLLM-CPU worker runs the model's forward on one thread: eager PyTorch, a
Python call per op, and each op gives up the GIL while it computes and must
win it back. This benchmark times a loop of such small ops (a decode step
of a 768-wide, 8-layer model at batch 4) alone, and beside one other thread
of the same process doing, in turn:

* ``recency``: the store's recency writes (``Store.touch`` of a load's
  units, then ``Store.flush``): Python between LMDB calls, what a worker's
  maintenance thread ran for every load before the scheduler took the
  touches over (connector/scheduler/lookups.py);
* ``saves``: what the connector's background writer runs for unique
  prompts: ``Store.put_segments`` of chains of 8 units of 16 KiB, codec
  none, into a full store (every put evicts), their keys made beforehand
  (Python between LMDB calls; the checksum and LMDB's puts in C without
  the GIL);
* ``saves-process``: the same puts committed by a commit process
  (:mod:`ucm_db.committer`, the connector's ``save_process``): the thread
  beside the model only sends each put's keys and waits for the answer,
  the units in a shared buffer;
* ``python``: a loop of pure Python (no call that releases the GIL): the
  bound of any Python work beside the model;
* ``gil-free``: SHA-256 of 1 MiB buffers, C code that releases the GIL for
  its whole run (as ``batch_loads``' native call and zstd do).

``--switch-interval-s`` runs every mode under each of several
``sys.setswitchinterval`` values (CPython's default is 0.005): how long a
thread that wants the GIL back waits before it asks the holder to drop it.

Figures: median seconds per step in each mode (modes take turns within
each repeat) and the ratio to ``alone`` (1.0: the thread beside cost the
model nothing).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

import ucm_db
from ucm_db.committer import CommitProcess, SharedChain
from ucm_db.keys import BlockKeys, Namespace

_NS = Namespace(model="bench-gil", kv_dtype="bfloat16", block_size=32)
MODES = ("alone", "recency", "saves", "saves-process", "python", "gil-free")
#: Units of one ``saves`` put, and their bytes (a 2-layer model's head unit).
SAVE_UNITS, SAVE_UNIT_BYTES = 8, 16 << 10
#: Chains the ``saves`` thread cycles through, into a store of
#: :data:`SAVE_STORE_BYTES`: a chain is evicted long before it comes back, so
#: every put stores (and evicts, as a full store does).
SAVE_CHAINS, SAVE_STORE_BYTES = 1024, 32 << 20
#: Longest one measurement of a mode runs (it stops after the step that passes it).
MEASURE_MAX_S = 3.0


def model_step(hidden: int, layers: int) -> Callable[[], None]:
    """One decode step's worth of small bf16 ops (4 rows x ``hidden``)."""
    x = torch.randn(4, hidden, dtype=torch.bfloat16)
    w_in = torch.randn(hidden, 2 * hidden, dtype=torch.bfloat16) / hidden**0.5
    w_out = torch.randn(2 * hidden, hidden, dtype=torch.bfloat16) / hidden**0.5

    def step() -> None:
        y = x
        for _ in range(layers):
            h = torch.nn.functional.silu(y @ w_in)
            y = torch.nn.functional.layer_norm(y + h @ w_out, (hidden,))
    return step


def _recency_work(store: ucm_db.Store, keys: list[bytes], stop: threading.Event) -> None:
    while not stop.is_set():
        store.touch(_NS, keys)
        store.flush()


def _saves_work(store: ucm_db.Store, chains: list[BlockKeys], stop: threading.Event) -> None:
    payload = bytes(SAVE_UNIT_BYTES)
    for keys in itertools.cycle(chains):
        if stop.is_set():
            return
        store.put_segments(_NS, [(keys, [payload] * len(keys))])


def _saves_process_work(committer: CommitProcess, chains: list[BlockKeys], stop: threading.Event) -> None:
    buffer = committer.share(SAVE_UNITS * SAVE_UNIT_BYTES)
    for keys in itertools.cycle(chains):
        if stop.is_set():
            return
        committer.put_segments(_NS, [SharedChain(keys, buffer.id, 0, SAVE_UNIT_BYTES, SAVE_UNIT_BYTES)])


def save_chains(count: int) -> list[BlockKeys]:
    """``count`` chains of :data:`SAVE_UNITS` keys, made before any
    measurement (the writer is handed its keys: hashing them is the model
    thread's work, not the writer's)."""
    return [_NS.block_keys([chain] * 32 * SAVE_UNITS) for chain in range(count)]


def _python_work(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i


def _gil_free_work(stop: threading.Event) -> None:
    data = bytes(1 << 20)
    while not stop.is_set():
        hashlib.sha256(data).digest()


def measure(
    units: int, steps: int, repeats: int, hidden: int, layers: int, switch_interval_s: float | None = None,
) -> dict[str, Any]:
    """Median seconds per step in each mode, and each ratio to ``alone``,
    under ``sys.setswitchinterval(switch_interval_s)`` (None: as it is);
    the interval is restored after."""
    torch.set_num_threads(1)
    step = model_step(hidden, layers)
    for _ in range(steps):
        step()  # warm-up
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    interval_before = sys.getswitchinterval()
    chains = save_chains(SAVE_CHAINS)
    with tempfile.TemporaryDirectory(prefix="ucm-bench-gil-") as tmp:
        options: dict[str, Any] = {"codec": "none", "sync_interval_s": 3600.0}
        with ucm_db.open(Path(tmp) / "recency", capacity_bytes=1 << 30, **options) as store, \
                ucm_db.open(Path(tmp) / "saves", capacity_bytes=SAVE_STORE_BYTES, **options) as saves, \
                ucm_db.open(Path(tmp) / "child", capacity_bytes=SAVE_STORE_BYTES, **options), \
                CommitProcess(Path(tmp) / "child", {"capacity_bytes": SAVE_STORE_BYTES, **options}) as committer:
            keys = list(_NS.block_keys(list(range(32 * units))))
            store.put(_NS, keys, [b"\0" * 64] * units, parent=None)
            work: dict[str, Callable[[threading.Event], None]] = {
                "recency": lambda stop: _recency_work(store, keys, stop),
                "saves": lambda stop: _saves_work(saves, chains, stop),
                "saves-process": lambda stop: _saves_process_work(committer, chains, stop),
                "python": _python_work, "gil-free": _gil_free_work}
            try:
                if switch_interval_s is not None:
                    sys.setswitchinterval(switch_interval_s)
                for _ in range(repeats):
                    for mode in MODES:
                        per_mode[mode].append(_time_steps(work.get(mode), step, steps))
            finally:
                sys.setswitchinterval(interval_before)
    medians = {mode: statistics.median(values) for mode, values in per_mode.items()}
    return {
        "step_s": medians,
        "ratio_to_alone": {mode: medians[mode] / medians["alone"] for mode in MODES},
        "runs_s": per_mode,
        "switch_interval_s": interval_before if switch_interval_s is None else switch_interval_s,
        "units": units, "steps": steps, "repeats": repeats, "hidden": hidden, "layers": layers,
    }


def _time_steps(work: Callable[[threading.Event], None] | None, step: Callable[[], None], steps: int) -> float:
    """Seconds per model step with ``work`` running beside it on a thread
    until told to stop (None: the model alone): ``steps`` steps, or as many
    as end within :data:`MEASURE_MAX_S` (beside pure Python a step takes
    over 100x its time alone)."""
    stop = threading.Event()
    thread = None if work is None else threading.Thread(target=work, args=(stop,), daemon=True)
    if thread is not None:
        thread.start()
        time.sleep(0.05)
    started = time.perf_counter()
    done, elapsed_s = 0, 0.0
    while done < steps and elapsed_s < MEASURE_MAX_S:
        step()
        done += 1
        elapsed_s = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    return elapsed_s / done


@click.command("gil")
@click.option("--units", type=click.IntRange(min=1), default=4096, show_default=True, help="keys touched per recency round")
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True, help="model steps per measurement")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="rounds of every mode (medians)")
@click.option("--hidden", type=click.IntRange(min=8), default=768, show_default=True, help="model width")
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True, help="model layers")
@click.option("--switch-interval-s", "switch_intervals_s", type=click.FloatRange(min=1e-6), multiple=True,
              help="sys.setswitchinterval for a run of every mode (repeat for several; --json then prints a list of "
                   "runs; default: as it is, 0.005)")
@click.option("--json", "as_json", is_flag=True, help="print every run as JSON")
def command(
    units: int, steps: int, repeats: int, hidden: int, layers: int, switch_intervals_s: tuple[float, ...], as_json: bool,
) -> None:
    """A model thread's step time alone and beside store work in one process.

    \b
    Example:
        ucm-db bench gil --repeats 5
        ucm-db bench gil --switch-interval-s 0.005 --switch-interval-s 0.0005
    """
    reports = [measure(units, steps, repeats, hidden, layers, interval) for interval in (switch_intervals_s or (None,))]
    if as_json:
        click.echo(json.dumps(reports if switch_intervals_s else reports[0], indent=2))
        return
    for report in reports:
        click.echo(f"switch interval {report['switch_interval_s'] * 1e3:.3f} ms")
        for mode in MODES:
            step_ms, ratio = report["step_s"][mode] * 1e3, report["ratio_to_alone"][mode]
            click.echo(f"  {mode:13s} {step_ms:8.3f} ms per step  {ratio:.2f}x alone")
