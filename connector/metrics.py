"""Connector metrics: vLLM ``KVConnectorStats`` and Prometheus metrics.

Counters are plain numbers in a dict (vLLM ships them from the workers and
the scheduler to the front-end process, where ``build_kv_connector_stats``
rebuilds them). Every counter is a sum over the interval except the gauges in
:data:`GAUGES`, which keep the latest non-zero value.

Invariants:
    * ``data`` holds only the names in :data:`COUNTERS` and :data:`GAUGES`;
      unknown names from a peer are ignored, not trusted.
    * Stats objects are never shared between threads: the owner swaps in a
      fresh one under its own lock (:meth:`Counters.take`).
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = (
    "lookups", "lookup_s", "query_tokens", "hit_tokens",
    "loaded_blocks", "loaded_bytes", "load_s", "load_errors",
    "saved_blocks", "saved_bytes", "save_copy_s", "save_commit_s", "save_commit_cpu_s", "save_errors", "saves_dropped",
    # saves computed over a block that failed to load: dropped by the worker
    # that saw the failure, deleted by the others a step later
    "saves_voided",
    # preemptions (preemptions.py): requests vLLM preempted (scheduler), blocks
    # of their saves dropped before the copy because their blocks were freed (workers)
    "preempted_requests", "saves_preempted",
    # prefill/decode (roles.py): producer's in-step commit wait, blocks it
    # announced; consumer's wait for them and announced blocks still missing
    # at its deadline (read-after-write misses)
    "publish_wait_s", "published_blocks", "publication_wait_s", "publication_misses",
    # load_policy auto (cost_model.py): lookups whose stored KV was left to
    # recompute because loading it was expected to be slower
    "cost_skips",
)
#: Gauges: the latest non-zero value wins. The capacity gauges describe the
#: store the scheduler reads (every scheduler of a store reports the same).
GAUGES = ("compression_ratio", "store_stored_bytes", "store_capacity_bytes", "namespace_stored_bytes", "admit_after")
#: Latency histograms, by name: bucket upper bounds in seconds. Each ships
#: as per-bucket counts (``<name>_hist_<i>``, the last bucket +Inf), summed
#: over the interval like the counters; Prometheus gets them as histograms
#: (each observation placed at its bucket's upper bound, so ``_sum`` is an
#: upper bound and the bucket counts are exact).
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "lookup": (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    "load": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
    "save_commit": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
}
BUCKETS = tuple(f"{name}_hist_{i}" for name, bounds in HISTOGRAMS.items() for i in range(len(bounds) + 1))
COUNTERS = COUNTERS + BUCKETS


def bucket_of(name: str, seconds: float) -> str:
    """The stats key of the bucket ``seconds`` falls in for histogram ``name``."""
    return f"{name}_hist_{bisect.bisect_left(HISTOGRAMS[name], seconds)}"


@dataclass
class UcmDbConnectorStats(KVConnectorStats):
    """ucm-db's counters in vLLM's stats protocol."""

    def __post_init__(self) -> None:  # KVConnectorStats is a dataclass
        clean = {name: float(self.data.get(name, 0) or 0) for name in COUNTERS + GAUGES}
        self.data = clean

    def reset(self) -> None:
        self.data = {name: 0.0 for name in COUNTERS + GAUGES}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += float(other.data.get(name, 0) or 0)
        for name in GAUGES:
            value = float(other.data.get(name, 0) or 0)
            if value:
                self.data[name] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "lookups": int(d["lookups"]),
            "hit_tokens": int(d["hit_tokens"]),
            "hit_rate": round(d["hit_tokens"] / d["query_tokens"], 4) if d["query_tokens"] else 0.0,
            "avg_lookup_ms": round(1e3 * d["lookup_s"] / d["lookups"], 3) if d["lookups"] else 0.0,
            "loaded_MB": round(d["loaded_bytes"] / 1e6, 3),
            "load_GBps": round(d["loaded_bytes"] / d["load_s"] / 1e9, 3) if d["load_s"] else 0.0,
            "load_errors": int(d["load_errors"]),
            "saved_MB": round(d["saved_bytes"] / 1e6, 3),
            "save_commit_s": round(d["save_commit_s"], 4),
            "save_commit_cpu_s": round(d["save_commit_cpu_s"], 4),
            "save_errors": int(d["save_errors"]),
            "saves_dropped": int(d["saves_dropped"]),
            "saves_voided": int(d["saves_voided"]),
            "preempted_requests": int(d["preempted_requests"]),
            "saves_preempted": int(d["saves_preempted"]),
            "compression_ratio": round(d["compression_ratio"], 3),
            "cost_skips": int(d["cost_skips"]),
        }
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS)


class Counters:
    """Thread-safe accumulator that hands out :class:`UcmDbConnectorStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = UcmDbConnectorStats()
        self._added = False  # anything added since the last take: vLLM takes at every step, most find nothing
        self.totals = UcmDbConnectorStats()  # since start, for tests and the demo

    def add(self, **values: float) -> None:
        with self._lock:
            self._added = True
            for name, value in values.items():
                if name in GAUGES:
                    self._stats.data[name] = float(value)
                    self.totals.data[name] = float(value)
                else:
                    self._stats.data[name] += value
                    self.totals.data[name] += value

    def observe(self, name: str, seconds: float) -> None:
        """One latency observation of histogram ``name`` (:data:`HISTOGRAMS`)."""
        self.add(**{bucket_of(name, seconds): 1})

    def take(self) -> UcmDbConnectorStats | None:
        """The interval's stats (None if nothing happened), reset to zero."""
        with self._lock:
            if not self._added:
                return None  # without a pass over every counter
            self._added = False
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, UcmDbConnectorStats()
        return out


class LogLimit:
    """One repeating failure's log line, let through at most once per
    ``interval_s`` (a full disk fails every writer round, a dead store every
    load: one line a minute, not one per engine step; the metrics count
    every failure). A line says how many failures were held back since the
    one before; :meth:`ended` says, once, that they stopped after a line was
    let through, so a flapping fault logs at most two lines an interval.
    Thread-safe."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last_s = float("-inf")
        self._held = 0  # failures since the last line let through
        self._failures = 0  # failures since the last :meth:`ended` that reported
        self._announced = False  # a line was let through since then

    def due(self) -> int | None:
        """Counts a failure; the failures held back before it if its line
        is due now, else None (log nothing)."""
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            if now - self._last_s < self._interval_s:
                self._held += 1
                return None
            held, self._held, self._last_s, self._announced = self._held, 0, now, True
            return held

    def ended(self) -> int:
        """A success: the failures since the last report, if a failure's
        line was let through since (log that they stopped), else 0."""
        with self._lock:
            if not self._announced:
                return 0
            failures, self._failures, self._announced = self._failures, 0, False
            return failures


class StoreGauges:
    """The store's gauges (compression ratio, stored bytes, capacity, the
    namespace's bytes), read from ``Store.stats()`` at most every
    :data:`GAUGE_INTERVAL_S`: a server that only loads (a kv_consumer) has
    no writer to report them."""

    def __init__(self, counters: Counters, namespace_id: str) -> None:
        self._counters = counters
        self._namespace_id = namespace_id
        self._at_s = float("-inf")

    def report(self, store: Any) -> None:
        now = time.monotonic()
        if now - self._at_s < GAUGE_INTERVAL_S:
            return
        self._at_s = now
        stats = store.stats()
        self._counters.add(store_stored_bytes=stats.stored_bytes, store_capacity_bytes=stats.capacity_bytes)
        ns = stats.namespaces.get(self._namespace_id)
        if ns is not None and ns.stored_bytes:
            self._counters.add(compression_ratio=ns.raw_bytes / ns.stored_bytes, namespace_stored_bytes=ns.stored_bytes)


#: Shortest interval between two reads of the store's gauges.
GAUGE_INTERVAL_S = 2.0


_PROM = {
    "lookups": ("ucm_db_lookups", "Scheduler-side prefix lookups (a request that may load nothing, load false or "
                                  "max_load_tokens below one block, counts none here; vLLM's "
                                  "external_prefix_cache_queries still counts it)"),
    "hit_tokens": ("ucm_db_hit_tokens", "Prompt tokens claimed from ucm-db at lookup (a claim whose load fails is recomputed: see load_errors)"),
    "query_tokens": ("ucm_db_query_tokens", "Prompt tokens looked up in ucm-db"),
    "loaded_bytes": ("ucm_db_loaded_bytes", "KV bytes loaded into the paged cache"),
    "load_s": ("ucm_db_load_seconds", "Seconds spent loading KV blocks"),
    "load_errors": ("ucm_db_load_errors", "Blocks that failed to load (missing or corrupt) and were recomputed"),
    "saved_bytes": ("ucm_db_saved_bytes", "Raw KV bytes handed to the background writer"),
    "save_commit_s": ("ucm_db_save_commit_seconds", "Seconds the background writer spent encoding and committing"),
    "save_commit_cpu_s": ("ucm_db_save_commit_cpu_seconds",
                          "CPU seconds of the background writer's thread in those commits (the rest waited for the disk, a core or the GIL)"),
    "save_copy_s": ("ucm_db_save_copy_seconds", "Seconds the forward pass spent copying blocks out for saving (on an accelerator: queueing the copies)"),
    "save_errors": ("ucm_db_save_errors", "Blocks whose save failed (logged; a future miss, never wrong KV)"),
    "saves_dropped": ("ucm_db_saves_dropped", "Blocks not saved because the writer queue was full"),
    "saves_voided": ("ucm_db_saves_voided", "Blocks not saved (or deleted a step later) because their KV was computed over a block that failed to load"),
    "preempted_requests": ("ucm_db_preempted_requests", "Requests vLLM preempted (their KV blocks freed)"),
    "saves_preempted": ("ucm_db_saves_preempted", "Blocks not saved because their request was preempted before the copy"),
    "publish_wait_s": ("ucm_db_publish_wait_seconds", "Seconds a kv_producer's steps waited for their blocks to commit (and upload)"),
    "published_blocks": ("ucm_db_published_blocks", "Blocks a kv_producer announced to consumers"),
    "publication_wait_s": ("ucm_db_publication_wait_seconds", "Seconds consumers' requests waited for announced blocks"),
    "publication_misses": ("ucm_db_publication_misses", "Announced blocks not visible by the consumer's deadline (recomputed)"),
    "cost_skips": ("ucm_db_cost_skips", "Lookups that left a store tier unasked or its hit unclaimed: recomputing was expected faster (load_policy auto)"),
}


_PROM_GAUGES = {
    "compression_ratio": ("ucm_db_compression_ratio", "Raw / stored bytes of this model's stored KV blocks"),
    "store_stored_bytes": ("ucm_db_store_stored_bytes", "Bytes the store's local tier holds (all namespaces)"),
    "store_capacity_bytes": ("ucm_db_store_capacity_bytes", "The store's capacity_bytes"),
    "namespace_stored_bytes": ("ucm_db_namespace_stored_bytes", "Bytes the store holds of this engine's namespace"),
    "admit_after": ("ucm_db_admit_after", "Sightings of a chain before its blocks are stored (admit_after; \"auto\" moves it between 1 and 2)"),
}
_PROM_HISTOGRAMS = {
    "lookup": ("ucm_db_lookup_latency_seconds", "Seconds of one scheduler-side prefix lookup (local and remote)"),
    "load": ("ucm_db_load_latency_seconds", "Seconds of one step's loads into the paged KV cache"),
    "save_commit": ("ucm_db_save_commit_latency_seconds", "Seconds of one background save commit (encode and commit)"),
}


class UcmDbPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters per engine, the gauges of :data:`GAUGES` and the
    latency histograms of :data:`HISTOGRAMS`."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, (metric, doc) in _PROM.items():
            counter = self._counter_cls(name=f"vllm:{metric}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, (metric, doc) in _PROM_GAUGES.items():
            gauge = self._gauge_cls(name=f"vllm:{metric}", documentation=doc, labelnames=labelnames)
            self._gauges[name] = {idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, (metric, doc) in _PROM_HISTOGRAMS.items():
            histogram = self._histogram_cls(name=f"vllm:{metric}", documentation=doc, labelnames=labelnames,
                                            buckets=list(HISTOGRAMS[name]))
            self._histograms[name] = {idx: histogram.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = float(transfer_stats_data.get(name, 0) or 0)
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        for name, per_engine in self._gauges.items():
            value = float(transfer_stats_data.get(name, 0) or 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].set(value)
        for name, per_engine in self._histograms.items():
            if engine_idx not in per_engine:
                continue
            bounds = HISTOGRAMS[name]
            for i, at in enumerate((*bounds, 2 * bounds[-1])):  # +Inf: placed past the last bound
                for _ in range(int(transfer_stats_data.get(f"{name}_hist_{i}", 0) or 0)):
                    per_engine[engine_idx].observe(at)
