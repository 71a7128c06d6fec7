"""What reaches Prometheus (issue 11, item 6): the compression-ratio gauge
of a server that only loads, save errors and save seconds as counters.

Real stores, real scheduler/worker halves, real ``prometheus_client``
metrics in a registry of the test's own; the save error is a real failed
put (the worker's store is open read-only).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import ucm_db  # noqa: E402
from ucm_db.connector.identity import KVShape, namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.metrics import UcmDbConnectorStats, UcmDbPromMetrics  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

BS = 32
SHAPE = KVShape(model="tiny", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test", tp_size=1, pp_size=1,
                kv_heads=2, layers=2)
LABELS = {"model_name": "tiny", "engine": "0"}


def _prom() -> tuple[UcmDbPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role="kv_both"))
    return UcmDbPromMetrics(config, types, list(LABELS), {0: list(LABELS.values())}), registry


def _kv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"layers.{i}.attn": torch.randn((8, 2, BS, 128), generator=gen).to(torch.bfloat16) for i in range(2)}


def _save(worker: UcmDbWorker, blocks: int) -> None:
    keys = tuple(namespace(SHAPE).block_keys(list(range(3, 3 + blocks * BS))))
    worker.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys, tuple(range(blocks)))]))
    worker.drain()


def test_save_errors_and_save_seconds_are_prometheus_counters(tmp_path: Path) -> None:
    ok = UcmDbWorker(ConnectorSettings(tmp_path / "ok"), SHAPE, 8, RolePolicy("kv_both"))
    ok.register_kv_caches(_kv(), 0, 0)
    _save(ok, 3)
    ucm_db.open(tmp_path / "ro").close()  # an existing store, which the next worker opens read-only
    failing = UcmDbWorker(ConnectorSettings(tmp_path / "ro", {"read_only": True}), SHAPE, 8, RolePolicy("kv_both"))
    failing.register_kv_caches(_kv(), 0, 0)
    _save(failing, 2)  # every put raises TierError: counted, logged, the step goes on
    stats = UcmDbConnectorStats()
    for worker in (ok, failing):
        taken = worker.counters.take()
        assert taken is not None
        stats.aggregate(taken)
    ok.shutdown()
    failing.shutdown()
    prom, registry = _prom()
    prom.observe(stats.data)
    assert registry.get_sample_value("vllm:ucm_db_save_errors_total", LABELS) == 2
    assert registry.get_sample_value("vllm:ucm_db_saved_bytes_total", LABELS) == stats.data["saved_bytes"] > 0
    commit_s = registry.get_sample_value("vllm:ucm_db_save_commit_seconds_total", LABELS)
    copy_s = registry.get_sample_value("vllm:ucm_db_save_copy_seconds_total", LABELS)
    assert commit_s is not None and copy_s is not None and commit_s > 0 and copy_s > 0
    cpu_s = registry.get_sample_value("vllm:ucm_db_save_commit_cpu_seconds_total", LABELS)
    assert cpu_s is not None and 0 < cpu_s <= commit_s  # the thread's CPU within the commits' wall time


def test_a_load_only_server_shows_the_stores_ratio_from_its_first_lookup(tmp_path: Path) -> None:
    settings = ConnectorSettings(tmp_path / "store", {"codec": "zstd"})
    writer = UcmDbWorker(settings, SHAPE, 8, RolePolicy("kv_both"))
    writer.register_kv_caches({name: torch.zeros_like(t) for name, t in _kv().items()}, 0, 0)  # compressible KV
    _save(writer, 4)
    writer.shutdown()
    consumer = UcmDbScheduler(settings, SHAPE, RolePolicy("kv_consumer"))
    miss = Request("m", list(range(500, 500 + 3 * BS)), SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
    assert consumer.get_num_new_matched_tokens(miss, 0) == (0, False)
    consumer.update_state_after_alloc(miss, None, 0)  # type: ignore[arg-type]
    stored = consumer.store.stats().namespaces[namespace(SHAPE).digest[:16].hex()]
    stats = consumer.counters.take()
    consumer.shutdown()
    assert stats is not None
    prom, registry = _prom()
    assert registry.get_sample_value("vllm:ucm_db_compression_ratio", LABELS) == 0.0
    prom.observe(stats.data)
    ratio = registry.get_sample_value("vllm:ucm_db_compression_ratio", LABELS)
    assert ratio == pytest.approx(stored.raw_bytes / stored.stored_bytes) and ratio > 1.5


def test_latency_histograms_and_capacity_gauges_reach_prometheus(tmp_path: Path) -> None:
    """Issue 49: lookup, load and save-commit latency as Prometheus
    histograms; the store's stored bytes, capacity and this namespace's
    bytes as gauges (what a fleet sizes capacity by)."""
    settings = ConnectorSettings(tmp_path / "store", {"codec": "none", "capacity_bytes": 64 << 20})
    worker = UcmDbWorker(settings, SHAPE, 8, RolePolicy("kv_both"))
    worker.register_kv_caches(_kv(), 0, 0)
    _save(worker, 3)
    keys = tuple(namespace(SHAPE).block_keys(list(range(3, 3 + 3 * BS))))
    worker.start_load(UcmDbConnectorMetadata(loads=[BlockTransfer("r", keys, (5, 6, 7))]))
    assert worker.take_load_errors() == set()
    scheduler = UcmDbScheduler(settings, SHAPE, RolePolicy("kv_both"))
    request = Request("q", list(range(3, 3 + 3 * BS + 1)), SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    stored = scheduler.store.stats()
    stats = UcmDbConnectorStats()
    for part in (worker, scheduler):
        taken = part.counters.take()
        assert taken is not None
        stats.aggregate(taken)
    worker.shutdown()
    scheduler.shutdown()
    prom, registry = _prom()
    prom.observe(stats.data)
    for metric, count in (("lookup", 1), ("load", 1), ("save_commit", 1)):
        assert registry.get_sample_value(f"vllm:ucm_db_{metric}_latency_seconds_count", LABELS) == count, metric
        assert registry.get_sample_value(f"vllm:ucm_db_{metric}_latency_seconds_bucket", {**LABELS, "le": "+Inf"}) == count
    assert registry.get_sample_value("vllm:ucm_db_store_capacity_bytes", LABELS) == 64 << 20
    assert registry.get_sample_value("vllm:ucm_db_store_stored_bytes", LABELS) == stored.stored_bytes > 0
    ns_bytes = registry.get_sample_value("vllm:ucm_db_namespace_stored_bytes", LABELS)
    assert ns_bytes == stored.namespaces[namespace(SHAPE).digest[:16].hex()].stored_bytes
    assert tokens == 3 * BS
