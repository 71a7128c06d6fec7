"""The serving benchmark's shared parts (:mod:`.serve`'s prefix_repetition
rows and :mod:`.serve_chat`'s conversation rows): the rows, the sizes of a
run, the ucm-db connector's options, a pass's connector counters, medians.

Invariants:
    * A pass's counters are differences of the server's counters read
      before and after it; medians are taken key by key over runs, and
      over the passes of a warm row repeated on its server
      (``warm_passes``), whose every request throughput is kept too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_db.tools.bench.serve_server import BLOCK_SIZE, LoadSpec

ROWS = {
    "no-conn-capped": "no connector, capped, first pass",
    "cold-bound": "cold bound: no connector, bound, first pass",
    "warm-bound": "warm bound: no connector, bound, second pass",
    "ucm-first": "ucm-db, capped, first pass (store empty)",
    "ucm-second": "ucm-db, capped, second pass (store warm)",
    "ucm-restart": "ucm-db, capped, new engine on the warm store",
    "ucm-remote": "ucm-db, capped, empty local tier over warm file:// remote",
    "ucm-remote-s3": "ucm-db, capped, empty local tier over warm S3 (moto)",
}
#: The rows that read the remote the other ucm-db rows wrote.
REMOTE_ROWS = frozenset({"ucm-remote", "ucm-remote-s3"})


@dataclass(frozen=True)
class ServeOptions:
    """Sizes of one benchmark run (defaults: the issue's setup)."""

    load: LoadSpec = LoadSpec()
    layers: int = 8
    capped_blocks: int = 256
    bound_blocks: int = 1200
    runs: int = 1
    rows: tuple[str, ...] = tuple(ROWS)
    scratch_dir: str | None = None
    enforce_eager: bool = False
    start_timeout_s: float = 1200.0
    codec: str = "zstd"  # the ucm-db stores' (local tier) codec
    load_mode: str = "block"  # the ucm-db rows' connector load_mode
    remote_lookup: str = "inline"  # the ucm-db rows' connector remote_lookup
    write_back: bool = False  # the ucm-db rows upload to a file:// remote even when no remote row reads it
    warm_passes: int = 1  # passes of each warm row (warm-bound, ucm-second) on its server; medians kept
    paired: bool = False  # warm-bound and ucm-second passes in turns, both servers up (serve_paired.py)
    capacity_bytes: int = 16 << 30  # the ucm-db stores' capacity_bytes (small: a store evicting from the start)
    admit_after: int | str = 1  # the ucm-db rows' connector admit_after (an N, or "auto")

    @property
    def uses_remote(self) -> bool:
        """Whether the ucm-db rows write back to a ``file://`` remote: a
        remote row reads what they wrote, or ``write_back`` asks for it."""
        return self.write_back or bool(REMOTE_ROWS & set(self.rows))

    @property
    def max_model_len(self) -> int:
        return -(-(self.load.request_tokens + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE

    @property
    def working_set_blocks(self) -> int:
        """Blocks of every prefix and every request's own tail (what 'bound' must hold)."""
        per_prompt_tail = -(-(self.load.suffix_len + self.load.output_len) // BLOCK_SIZE)
        return self.load.num_prefixes * (self.load.prefix_len // BLOCK_SIZE) + self.load.num_prompts * per_prompt_tail


Progress = Callable[[str], None]




def connector_options(store: Path, remote_url: str | None, options: ServeOptions, **extra: Any) -> dict[str, Any]:
    """Connector options of a ucm-db row: local tier in the options' codec,
    the options' load mode and remote lookup; with ``remote_url``, that
    remote behind it, its objects zstd (None: the local tier alone); the
    options' ``admit_after`` where it is not the default 1."""
    admission = {} if options.admit_after == 1 else {"admit_after": options.admit_after}
    local = {"path": str(store), "capacity_bytes": options.capacity_bytes, "codec": options.codec, "load_mode": options.load_mode,
             "remote_lookup": options.remote_lookup, **admission, **extra}
    return local if remote_url is None else {**local, "remote": remote_url, "remote_codec": "zstd"}


def pass_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the connector did during one pass (the difference of its
    ``/metrics`` counters): tokens looked up and loaded, bytes and seconds
    of loads, lookups that recomputed by the cost model's choice, bytes the
    writer committed with its commit seconds (wall, and the writer thread's
    CPU) and the forward pass's copy-out seconds (commits still queued when
    the pass ends count in the next)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    return {"query_tokens": delta("query_tokens"), "hit_tokens": delta("hit_tokens"),
            "loaded_MB": round(delta("loaded_bytes") / 1e6, 3), "load_s": round(delta("load_seconds"), 3),
            "cost_skips": delta("cost_skips"), "load_errors": delta("load_errors"),
            "saved_MB": round(delta("saved_bytes") / 1e6, 3), "save_commit_s": round(delta("save_commit_seconds"), 3),
            "save_commit_cpu_s": round(delta("save_commit_cpu_seconds"), 3),
            "save_copy_s": round(delta("save_copy_seconds"), 3)}


#: Rows measured on a server that is already warm: ``--warm-passes`` repeats
#: them there (a pass of one server varies by up to 14% on this host).
WARM_ROWS = frozenset({"warm-bound", "ucm-second"})


def repeated_row(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from several passes on the same server: the key by key
    medians, plus every pass's request throughput (``pass_throughputs``)."""
    row = medians(passes)
    if len(passes) > 1:
        row["pass_throughputs"] = [p.get("request_throughput", 0.0) for p in passes]
    return row


def medians(per_run: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key median of one row's runs; nested dicts (the connector's
    counters) key by key too; lists (every pass's figure) joined."""
    out: dict[str, Any] = {}
    for key, first in per_run[0].items():
        values = [r[key] for r in per_run if key in r]
        if isinstance(first, dict):
            out[key] = medians(values)
        elif isinstance(first, list):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = statistics.median(values)
    return out
