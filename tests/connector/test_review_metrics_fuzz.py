"""Randomised scenarios (test_review_save_fuzz.draw) checking that ucm-db's
reported metrics add up against what vLLM's real Scheduler and the worker did.

Invariants, per engine of each seeded scenario (TP=1: one writing rank):
    * hit tokens: ``hit_tokens`` is the sum of the ``num_external_tokens`` vLLM
      passed to ``update_state_after_alloc`` after a lookup (claimed at lookup),
      equal to vLLM's own connector prefix-cache hits, whose split by tier
      (``get_external_cache_hit_sources``, here only ``disk``) sums to them;
    * loads: every planned load block is counted loaded or a load error, and
      ``loaded_bytes`` is loaded blocks x a block's bytes; claimed tokens are
      the planned load blocks' tokens;
    * saves: every planned save block is counted saved, dropped, voided,
      preempted or a save error; ``saved_bytes`` is saved blocks x a block's
      raw bytes; the namespace's raw stored bytes never exceed the saved bytes;
    * lookups: counted once per lookup vLLM allocated after, except a request
      that may load nothing; every histogram's count is its observations;
      no counter is negative;
    * what vLLM ships (``take`` per step, ``build_kv_connector_stats``,
      ``aggregate``) and what Prometheus reports equal the counters' totals.

Real parts: vLLM's Scheduler/AsyncScheduler, both connector halves, LMDB
stores in tmp_path; spies only record the scheduler's calls into the connector.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.v1.metrics.stats import CacheHitSource, PrefixCacheStats  # noqa: E402

from stand_in_engine import BS, StandInEngine  # noqa: E402
from test_review_save_fuzz import BLOCK_BYTES, Outcome, Scenario, _Driver, _engine, draw  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metrics import _PROM, _PROM_HISTOGRAMS, COUNTERS, HISTOGRAMS, UcmDbConnectorStats  # noqa: E402

SEEDS = range(1, 25)
LABELS = {"model_name": "tiny", "engine": "0"}


@dataclass
class GroundTruth:
    """What one engine's scheduler and worker were seen to do (spies on vLLM's calls)."""

    asked: dict[str, int] = field(default_factory=dict)  # req_id -> num_computed_tokens of its pending lookup
    lookups: int = 0  # allocations after a lookup, of requests that may load a block
    prompt_tokens: int = 0  # their prompts' tokens
    claimed_tokens: int = 0  # num_external_tokens vLLM passed after a lookup
    planned_load_blocks: int = 0
    planned_save_blocks: int = 0
    shipped: UcmDbConnectorStats = field(default_factory=UcmDbConnectorStats)  # per-step stats, as vLLM aggregates them


def _may_load(request: Any) -> bool:
    """Whether the request's controls let it load a block (the Prometheus help of ``lookups``, metrics.py)."""
    params = (request.sampling_params.extra_args or {}).get("kv_transfer_params", {}).get("ucm_db", {})
    return params.get("load", True) is not False and params.get("max_load_tokens", BS) >= BS


def _spy(engine: StandInEngine, truth: GroundTruth) -> None:
    """Records the scheduler's lookups and allocations, and every step's plan and shipped stats."""
    connector = engine.sched.connector
    asked, allocated = connector.get_num_new_matched_tokens, connector.update_state_after_alloc

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
        truth.asked[request.request_id] = num_computed_tokens
        return asked(request, num_computed_tokens)

    def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if truth.asked.pop(request.request_id, None) is not None:
            truth.claimed_tokens += num_external_tokens
            if _may_load(request):
                truth.lookups += 1
                truth.prompt_tokens += request.num_prompt_tokens
            else:
                assert num_external_tokens == 0, request.request_id
        allocated(request, blocks, num_external_tokens)

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.update_state_after_alloc = update_state_after_alloc
    engine.sched.connector_prefix_cache_stats = PrefixCacheStats()  # vLLM's log_stats: it asks the hit sources
    engine.post_execute.append(lambda eng, so, out: _observe_step(eng, so, truth))


def _ship(engine: StandInEngine, truth: GroundTruth) -> None:
    """vLLM's path for stats: each side's ``take``, rebuilt in the front end and aggregated."""
    for part in (engine.runner.connector, engine.sched.connector):
        taken = part.get_kv_connector_stats()
        if taken is not None:
            truth.shipped.aggregate(UcmDbConnector.build_kv_connector_stats(dict(taken.data)))  # type: ignore[arg-type]


def _observe_step(engine: StandInEngine, so: Any, truth: GroundTruth) -> None:
    meta = so.kv_connector_metadata
    truth.planned_load_blocks += sum(len(t.block_ids) for t in [*meta.loads, *meta.async_loads])
    truth.planned_save_blocks += sum(len(t.block_ids) for t in meta.saves)
    _ship(engine, truth)


def _totals(engine: StandInEngine) -> dict[str, float]:
    """The scheduler's and the worker's counters since start, summed as vLLM sums them."""
    stats = UcmDbConnectorStats()
    stats.aggregate(engine.ours.counters.totals)
    stats.aggregate(engine.runner.connector._worker.counters.totals)  # type: ignore[union-attr]
    return stats.data


def run(root: Path, scenario: Scenario) -> tuple[list[GroundTruth], list[dict[str, float]], Outcome, list[int]]:
    """Runs ``scenario`` as test_review_save_fuzz.run does, with spies; per engine: truth, totals; raw stored bytes."""
    store, outcome, settings = root / f"store-{scenario.seed}", Outcome(), dict(scenario.settings)
    drivers: list[_Driver] = []
    truths = [GroundTruth() for _ in scenario.servers]
    raw_bytes: list[int] = []
    try:
        for server, truth in zip(scenario.servers, truths):
            drivers.append(_Driver(_engine(root, store, server, settings), server, outcome))
            _spy(drivers[-1].engine, truth)
        for d in drivers:  # one after another: each engine's saves are drained before the next starts
            while d.busy and d.clock < d.server.step_bound:
                d.tick()
            d.engine.runner.connector._worker.drain()  # type: ignore[union-attr]
            ours = d.engine.ours
            ns = ours.store.stats().namespaces.get(ours.namespace.id.hex())
            raw_bytes.append(ns.raw_bytes if ns is not None else 0)
        outcome.evicting = drivers[0].engine.ours.store.stats().evictions > 0
        for d in drivers:
            outcome.unfinished += sorted(d.engine.sched.requests) + [r.req_id for r in d.waiting]
    finally:
        for d in drivers:
            d.engine.close()
    totals = []
    for d, truth in zip(drivers, truths):
        truth.vllm_hits = d.engine.sched.connector_prefix_cache_stats  # type: ignore[attr-defined]
        _ship(d.engine, truth)  # what the writer counted after the last step
        totals.append(_totals(d.engine))
    return truths, totals, outcome, raw_bytes


def _hist_count(data: dict[str, float], name: str) -> float:
    return sum(data[f"{name}_hist_{i}"] for i in range(len(HISTOGRAMS[name]) + 1))


def check_engine(truth: GroundTruth, data: dict[str, float], engine: StandInEngine | None = None) -> None:
    """One engine's counters against what it was seen to do."""
    assert all(data[name] >= 0 for name in COUNTERS), {k: v for k, v in data.items() if v < 0}
    # docs/connector.md "## Metrics": "hit tokens (claimed at lookup ...)"; metrics.py _PROM["hit_tokens"].
    assert data["hit_tokens"] == truth.claimed_tokens
    # metrics.py _PROM["lookups"]: a request that may load nothing counts none.
    assert data["lookups"] == truth.lookups
    # docs "## Metrics": vLLM's prompt_tokens_cached_by_source shows ucm-db's local hits as `disk`.
    vllm_hits: PrefixCacheStats = truth.vllm_hits  # type: ignore[attr-defined]
    assert vllm_hits.hits + vllm_hits.preempted_hits == data["hit_tokens"]
    assert set(vllm_hits.hits_by_source) <= {CacheHitSource.DISK}
    assert sum(vllm_hits.hits_by_source.values()) == vllm_hits.hits
    assert data["hit_tokens"] <= data["query_tokens"] <= truth.prompt_tokens  # "Prompt tokens looked up"
    # _PROM["load_errors"]: blocks that failed to load; loaded bytes: "KV bytes loaded into the paged cache".
    assert data["loaded_blocks"] + data["load_errors"] == truth.planned_load_blocks
    assert data["loaded_bytes"] == data["loaded_blocks"] * BLOCK_BYTES
    assert truth.claimed_tokens == truth.planned_load_blocks * BS
    # _PROM["saved_bytes"]: "Raw KV bytes handed to the background writer"; every save block is accounted for
    # (saved, saves_dropped, saves_voided, saves_preempted, save_errors: docs "## Metrics", metrics.py COUNTERS).
    assert data["saved_bytes"] == data["saved_blocks"] * BLOCK_BYTES
    outcomes = ("saved_blocks", "saves_dropped", "saves_voided", "saves_preempted", "save_errors")
    accounted = sum(data[n] for n in outcomes)
    assert accounted == truth.planned_save_blocks, (accounted, truth.planned_save_blocks)
    # docs "## Metrics": histograms with exact bucket counts; the lookup histogram: "one scheduler-side prefix lookup".
    assert _hist_count(data, "lookup") == data["lookups"]
    assert (_hist_count(data, "load") > 0) == (truth.planned_load_blocks > 0)
    assert (_hist_count(data, "save_commit") > 0) == (data["saved_blocks"] > 0)
    assert _hist_count(data, "save_commit") <= data["saved_blocks"]


def check_prometheus(data: dict[str, float]) -> None:
    """Prometheus (UcmDbPromMetrics, as build_prom_metrics makes it) fed the totals reports them."""
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    from vllm.config import KVTransferConfig, VllmConfig
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector",
                                kv_role="kv_both")
    config = VllmConfig(kv_transfer_config=transfer)
    prom = UcmDbConnector.build_prom_metrics(config, types, list(LABELS), {0: list(LABELS.values())})
    assert prom is not None
    prom.observe(data)
    for name, (metric, _) in _PROM.items():
        got = registry.get_sample_value(f"vllm:{metric}_total", LABELS) or 0.0
        assert math.isclose(got, data[name], rel_tol=1e-9, abs_tol=1e-12), name
    for name, (metric, _) in _PROM_HISTOGRAMS.items():  # docs: "exact bucket counts"
        assert registry.get_sample_value(f"vllm:{metric}_count", LABELS) == _hist_count(data, name), name
        for i, bound in enumerate(HISTOGRAMS[name]):
            below = sum(data[f"{name}_hist_{j}"] for j in range(i + 1))
            assert registry.get_sample_value(f"vllm:{metric}_bucket", {**LABELS, "le": str(bound)}) == below


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metrics-fuzz")


_EXERCISED: dict[int, list[dict[str, float]]] = {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", SEEDS)
def test_metrics_add_up_against_what_the_engines_did(root: Path, seed: int) -> None:
    scenario = draw(seed)
    truths, totals, outcome, raw_bytes = run(root, scenario)
    _EXERCISED[seed] = totals
    assert not outcome.unfinished, scenario
    for truth, data in zip(truths, totals):
        check_engine(truth, data)
        for name in COUNTERS:  # what vLLM shipped step by step adds up to the totals
            assert math.isclose(truth.shipped.data[name], data[name], rel_tol=1e-9, abs_tol=1e-12), name
        check_prometheus(truth.shipped.data)
    if not outcome.evicting:  # every stored raw byte was handed to a writer (docs "## Metrics": saved bytes)
        assert raw_bytes[-1] <= sum(d["saved_bytes"] for d in totals), (raw_bytes, scenario)


def test_the_seeds_exercise_the_counters(root: Path) -> None:
    """Not vacuous: hits, loads, saves and preemptions occur across the seeds."""
    for seed in SEEDS:
        if seed not in _EXERCISED:
            test_metrics_add_up_against_what_the_engines_did(root, seed)
    seen = {name: sum(any(d[name] for d in totals) for totals in _EXERCISED.values())
            for name in ("hit_tokens", "loaded_blocks", "saved_blocks", "preempted_requests", "saves_preempted")}
    assert seen["hit_tokens"] >= len(SEEDS) // 3 and seen["saved_blocks"] >= len(SEEDS) // 2, seen
    assert seen["loaded_blocks"] >= len(SEEDS) // 3 and seen["preempted_requests"] >= 2, seen
