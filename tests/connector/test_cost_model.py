"""Load-or-recompute: the cost model's decisions (pure), the ``load_policy``
setting, the worker -> scheduler feedback (worker metadata, step round
trips), and the scheduler over a real store whose remote is a real
``throttled://`` directory at two bandwidths (no engine: the prefill rate is
given as a calibration, the remote's rate is measured by the scheduler's own
timed lookups). tests/vllm/test_cost_policy.py runs the same on a real
engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucm_db.connector.scheduler.cost_model import CostModel, Decision, check_load_policy
from ucm_db.errors import ConfigError


class _Clock:
    """A settable clock for the re-probe interval (the model's own seam)."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_unmeasured_model_loads_every_tier() -> None:
    model = CostModel()
    assert model.faster_than_recompute("ns", "remote") and model.should_ask("ns", "local")
    model.observe_prefill(1000, 1.0)  # prefill known, tiers still unmeasured
    assert model.faster_than_recompute("ns", "remote") and model.faster_than_recompute("ns", "local")


def test_tier_slower_than_prefill_is_not_asked_faster_one_is() -> None:
    model = CostModel(clock=_Clock())
    model.observe_prefill(4000, 1.0)           # 4000 tokens/s
    model.observe_load("ns", "remote", 100, 1.0)  # 100 tokens/s: 40x slower
    model.observe_load("other", "remote", 100_000, 1.0)
    assert not model.should_ask("ns", "remote")
    assert model.skipped["remote"] == 1
    assert model.should_ask("other", "remote")
    assert model.load_rate("ns", "remote") == pytest.approx(100.0)


def test_remote_time_adds_the_local_tier_time() -> None:
    model = CostModel()
    model.observe_prefill(1000, 1.0)  # 1 ms per token
    model.observe_load("ns", "remote", 1500, 1.0)  # 0.67 ms per token alone: faster
    assert model.faster_than_recompute("ns", "remote")
    model.observe_load("ns", "local", 2000, 1.0)  # + 0.5 ms per token: 1.17 ms, slower
    assert model.seconds_per_token("ns", "remote") == pytest.approx(1 / 1500 + 1 / 2000)
    assert not model.faster_than_recompute("ns", "remote")


def test_slow_tier_is_reprobed_and_recovers() -> None:
    clock = _Clock()
    model = CostModel(reprobe_interval_s=30.0, clock=clock, weight=0.5)
    model.observe_prefill(1000, 1.0)
    model.observe_load("ns", "remote", 10, 1.0)
    assert not model.should_ask("ns", "remote")
    clock.now_s += 29.0
    assert not model.should_ask("ns", "remote")
    clock.now_s += 1.0
    assert model.should_ask("ns", "remote")  # re-probe due
    for _ in range(12):  # the link recovered: 100x prefill
        model.observe_load("ns", "remote", 100_000, 1.0)
    assert model.should_ask("ns", "remote") and model.faster_than_recompute("ns", "remote")


def test_unmeasured_tier_is_probed_measured_one_loaded_or_skipped() -> None:
    clock = _Clock()
    model = CostModel(clock=clock, reprobe_interval_s=30.0)
    assert model.decide("ns", "remote") is Decision.PROBE
    assert model.decide("ns", "local", probe_unmeasured=False) is Decision.LOAD
    model.observe_load("ns", "remote", 1000, 1.0)
    assert model.decide("ns", "remote") is Decision.LOAD  # prefill unmeasured: load
    model.observe_prefill(10_000, 1.0)
    assert model.decide("ns", "remote") is Decision.SKIP  # 10x slower than prefill
    clock.now_s += 30.0
    assert model.decide("ns", "remote") is Decision.PROBE  # re-probe due ...
    assert model.decide("ns", "remote") is Decision.SKIP   # ... once per interval, even if it found nothing
    assert model.skipped["remote"] == 2


def test_one_slow_sample_weighs_its_time_not_its_rate() -> None:
    """The estimate averages seconds per token: a 100x slower load after a
    fast one moves the estimate by the time it cost, and the tier is judged
    slower than recompute at once (an average of rates would still say fast)."""
    model = CostModel(weight=0.3)
    model.observe_prefill(1000, 1.0)               # 1 ms per token
    model.observe_load("ns", "remote", 100_000, 1.0)  # 0.01 ms per token
    assert model.decide("ns", "remote") is Decision.LOAD
    model.observe_load("ns", "remote", 100, 1.0)      # the link fell to 10 ms per token
    assert model.seconds_per_token("ns", "remote") == pytest.approx(0.7 * 1e-5 + 0.3 * 1e-2)
    assert model.decide("ns", "remote") is Decision.SKIP


def test_load_fit_separates_fixed_and_per_token_costs() -> None:
    from ucm_db.connector.scheduler.cost_model import LoadFit

    fit = LoadFit(weight=0.2)
    fit.add(512, 0.010 + 512 * 1e-5)
    fit.add(530, 0.010 + 530 * 1e-5)
    assert fit.line() is None  # about one size: the two terms cannot be told apart
    for tokens in (0, 992, 4064, 8128, 480):
        fit.add(tokens, 0.010 + tokens * 1e-5)
    fixed_s, per_token_s = fit.line()
    assert fixed_s == pytest.approx(0.010) and per_token_s == pytest.approx(1e-5)
    falling = LoadFit()
    for tokens, seconds in ((100, 1.0), (1000, 0.5)):  # dearer when longer: no plausible line
        falling.add(tokens, seconds)
    assert falling.line() is None


def test_fixed_cost_recomputes_a_short_claim_and_loads_a_long_one() -> None:
    """Over one link, a 1K-token claim loses to recompute by its fixed cost
    and an 8K-token one wins; the per-token average alone says "load"
    for both (it is dearer than the marginal cost, not the claim's)."""
    model = CostModel()
    model.observe_prefill(1024, 1024 * 20e-6)  # 20 us per token
    for tokens in (0, 512, 480, 0, 512, 4064, 8128):
        model.observe_load("ns", "remote", tokens, 0.008 + tokens * 10e-6)  # 8 ms per lookup + 10 us per token
    assert model.seconds_per_token("ns", "remote") < 20e-6  # the average alone would load everything
    assert model.load_line("ns", "remote") == pytest.approx((0.008, 10e-6))
    assert model.decide("ns", "remote", tokens=992, lookups=2) is Decision.SKIP  # 26 ms against 20 ms
    assert model.decide("ns", "remote", tokens=8128, lookups=2) is Decision.LOAD  # 97 ms against 163 ms
    assert model.decide("ns", "remote", tokens=512, lookups=1) is Decision.SKIP  # 13 ms against 10 ms
    assert model.decide("ns", "remote", tokens=2048, lookups=1) is Decision.LOAD  # 28 ms against 41 ms
    model.observe_load("ns", "local", 992, 0.002)  # the local tier's time is added (no fit yet: its average)
    assert model.claim_seconds("ns", "remote", 2048, 1) == pytest.approx(0.008 + 2048 * 10e-6 + 2048 * 0.002 / 992)
    assert CostModel("always").decide("ns", "remote", tokens=32, lookups=2) is Decision.LOAD


def test_recompute_is_priced_by_the_positions_it_computes() -> None:
    """Attention makes a token at position 8000 dearer than one at 1000.
    With the per-token average of long and short prefills, a short
    recompute looks dearer than it is and a borderline load wins it; priced
    by its positions, it is recomputed, and a long one is still loaded."""
    from ucm_db.connector.scheduler.cost_model import PrefillFit

    def per_token_s(position: float) -> float:
        return 15e-6 + position * 5e-9  # 15 us per token at 0, +5 us per 1000 positions

    model = CostModel(weight=0.3)
    for tokens in (1024, 8160, 2048, 4096, 1024, 8160):  # whole prompts: mean position (n - 1) / 2
        mean_position = (tokens - 1) / 2
        model.observe_prefill(tokens, tokens * per_token_s(mean_position), mean_position)
    assert model.recompute_seconds(1024) == pytest.approx(1024 * per_token_s(511.5))
    assert model.recompute_seconds(64, first_position=2048) == pytest.approx(64 * per_token_s(2048 + 31.5))
    for tokens in (0, 1024, 8160, 2048):
        model.observe_load("ns", "remote", tokens, 0.004 + tokens * 15e-6)  # 4 ms per lookup + 15 us per token
    average_s = model.prefill.value
    assert 1024 * average_s > 0.004 + 1024 * 15e-6  # by the average the 1K-token claim would be loaded
    assert model.decide("ns", "remote", tokens=1024, lookups=1) is Decision.SKIP  # 19.4 ms load against 17.9 ms
    assert model.decide("ns", "remote", tokens=8160, lookups=1) is Decision.LOAD  # 126 ms against 289 ms
    assert model.describe("ns")["prefill_s_per_token_per_position"] == pytest.approx(5e-9)

    flat = PrefillFit()
    for position in (100.0, 1000.0, 4000.0):
        flat.add(position, 20e-6 - position * 1e-9)  # cheaper when longer: no plausible line
    assert flat.line() is None
    no_positions = CostModel()
    no_positions.observe_prefill(1024, 0.02)  # a step whose positions are unknown: the average alone
    assert no_positions.recompute_seconds(512, first_position=4096) == pytest.approx(0.01)


def test_small_steps_are_not_prefill_samples() -> None:
    model = CostModel(min_prefill_tokens=256)
    model.observe_prefill(8, 0.02)  # a decode step: per-step overhead
    assert model.prefill.value is None
    model.observe_prefill(512, 0.1)
    assert model.prefill.rate == pytest.approx(5120.0)


def test_always_policy_and_noise_samples() -> None:
    model = CostModel("always")
    model.observe_prefill(1000, 1.0)
    model.observe_load("ns", "remote", 1, 1.0)
    assert model.should_ask("ns", "remote")
    auto = CostModel()
    auto.observe_prefill(1000, 0.0)      # too short to be a rate
    auto.observe_load("ns", "remote", 0, 1.0)  # nothing promoted: no rate
    assert auto.prefill.value is None and auto.load_rate("ns", "remote") is None
    with pytest.raises(ValueError):
        auto.observe_load("ns", "disk", 1, 1.0)


def test_load_policy_setting() -> None:
    from ucm_db.connector.settings import ConnectorSettings, valid_keys

    assert "load_policy" in valid_keys()
    assert ConnectorSettings.from_extra_config({"path": "/tmp/x"}).load_policy == "auto"
    assert ConnectorSettings.from_extra_config({"path": "/tmp/x", "load_policy": "always"}).load_policy == "always"
    with pytest.raises(ConfigError) as caught:
        ConnectorSettings.from_extra_config({"path": "/tmp/x", "load_policy": "never"})
    assert "load_policy" in caught.value.hint
    with pytest.raises(ConfigError):
        check_load_policy(None)


# -- scheduler over a throttled remote ---------------------------------------------
#: 24 blocks: past the scheduler's first 16-block lookup segment, so a
#: claim covers a remote segment that starts mid-chain (its parent is not None).
BS, BLOCKS, PAYLOAD_BYTES = 32, 24, 16 << 10
#: Calibrated prefill rate of the scheduler tests: a slow link (0.5 MB/s:
#: ~500 tokens/s of these blocks, two 16 KiB units per 32-token block) is
#: below it, a fast one (1 GB/s) far above it even with the lookup's own
#: promotion cost on a 16-block probe (512 ms of budget: 256 ms was
#: exceeded once by a loaded CI host's syncs).
PREFILL_TOKENS_PER_S = 1000.0
#: The same against the fast link alone: a 16-block probe measured faster
#: than a recompute at this rate (4 s) is a fast link whatever the load on
#: the host (the probe takes tens of ms here; the measurement includes the
#: local commit, whose syncs a loaded CI host stretches). The slow-link rows
#: keep PREFILL_TOKENS_PER_S: a link measured slower than it is slower.
FAST_LINK_PREFILL_TOKENS_PER_S = 128.0


def _remote_with(tmp_path: Path, prompts: list[list[int]]) -> Path:
    """A remote directory holding every unit of ``prompts``' blocks,
    uploaded through a real store."""
    import ucm_db
    from ucm_db.connector.identity import grid, namespace, reader_spans
    from ucm_db.tools.bench.throttle import register
    from ucm_db.keys.units import UnitKeys

    register()
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    shape = _shape()
    ns, kv_grid = namespace(shape), grid(shape)
    with ucm_db.open(tmp_path / "writer", remote="throttled://kv",
                     remote_options={"path": str(remote_dir), "bandwidth_bytes_per_s": 1e9}) as store:
        for tokens in prompts:
            keys = ns.block_keys(tokens)
            for span in reader_spans(shape):
                units = list(UnitKeys(keys, kv_grid, span))
                store.put(ns, units, [os.urandom(PAYLOAD_BYTES) for _ in units], parent=None)
        store.flush()
    return remote_dir


def _shape():  # type: ignore[no-untyped-def]
    from ucm_db.connector.identity import KVShape

    return KVShape(model="cost-model", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test",
                   tp_size=1, pp_size=1, kv_heads=2, layers=2)


def _claim(sched, tokens: list[int], req_id: str) -> int:  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, tokens, SamplingParams(max_tokens=4), None)
    ext, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, None, ext)
    return int(ext)


@pytest.mark.vllm
@pytest.mark.parametrize(("bandwidth_bytes_per_s", "prefill_tokens_per_s", "policy", "loads"), [
    (0.5e6, PREFILL_TOKENS_PER_S, "auto", False),          # slower than recompute: recomputed, remote not asked
    (1e9, FAST_LINK_PREFILL_TOKENS_PER_S, "auto", True),   # faster: loaded
    (0.5e6, PREFILL_TOKENS_PER_S, "always", True),         # debugging: always loaded
])
def test_scheduler_claims_a_remote_hit_only_where_it_beats_recompute(
    tmp_path: Path, bandwidth_bytes_per_s: float, prefill_tokens_per_s: float, policy: str, loads: bool,
) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    probe, second = (list(range(1 + s, BS * BLOCKS + 5 + s)) for s in (0, 10_000))
    remote_dir = _remote_with(tmp_path, [probe, second])
    settings = ConnectorSettings.from_extra_config({
        "path": str(tmp_path / "reader"), "load_policy": policy, "remote": "throttled://kv",
        "remote_options": {"path": str(remote_dir), "bandwidth_bytes_per_s": bandwidth_bytes_per_s},
        "remote_deadline_s": 5.0,
    })
    sched = UcmDbScheduler(settings, _shape())
    try:
        sched.cost.observe_prefill(int(prefill_tokens_per_s), 1.0)  # calibration
        # Unmeasured remote: probed (a few blocks, timed) whatever its speed;
        # "always" loads everything at once.
        from ucm_db.connector.scheduler.lookups import PROBE_BLOCKS as _PROBE_BLOCKS

        # A probe that measures the link fast goes on to load the rest of its prompt.
        assert _claim(sched, probe, "probe") == (BLOCKS if policy == "always" or loads else _PROBE_BLOCKS) * BS
        ns_id = sched._namespace.digest[:16].hex()
        assert sched.cost.load_rate(ns_id, "remote") is not None
        skips_after_probe = sched.counters.totals.data["cost_skips"]
        got = _claim(sched, second, "second")
        assert got == (BLOCKS * BS if loads else 0)
        # A skip is visible to operators (vllm:ucm_db_cost_skips), once per
        # lookup; a load is not one.
        assert sched.counters.totals.data["cost_skips"] - skips_after_probe == (0 if loads else 1)
        assert sched.counters.totals.data["cost_skips"] == 0 or not loads
        from ucm_db.connector.identity import grid, reader_spans
        from ucm_db.keys.units import UnitKeys

        units = UnitKeys(sched.keys_for(_request_for(second), BLOCKS), grid(_shape()), reader_spans(_shape())[0])
        local = sched.store.lookup(sched._namespace, units, remote=False)
        # Not loaded means not even asked: nothing was promoted.
        assert (local > 0) == loads
    finally:
        sched.shutdown()


def _request_for(tokens: list[int]):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("keys", tokens, SamplingParams(max_tokens=4), None)


def _step(tokens: int):  # type: ignore[no-untyped-def]
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


@pytest.mark.vllm
def test_a_step_s_mean_position_counts_every_token_it_computes() -> None:
    """A real vLLM SchedulerOutput: a new request computing 512 tokens
    after 1024 loaded ones, and a running one decoding at position 3000."""
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from ucm_db.connector.scheduler.planner import mean_position_of as _mean_position

    request = _request_for(list(range(1, 1600)))
    request.num_computed_tokens = 1024
    step = _step(513)
    step.scheduled_new_reqs = [NewRequestData.from_request(request, ([0],))]
    step.scheduled_cached_reqs = CachedRequestData(
        req_ids=["running"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={}, new_block_ids=[None],
        num_computed_tokens=[3000], num_output_tokens=[5],
    )
    step.num_scheduled_tokens = {request.request_id: 512, "running": 1}
    assert _mean_position(step) == pytest.approx((512 * (1024 + 255.5) + 3000) / 513)
    step.num_scheduled_tokens["unknown"] = 8
    assert _mean_position(step) is None  # a request the output does not describe: no sample
    assert _mean_position(_step(0)) is None


@pytest.mark.vllm
def test_scheduler_learns_prefill_and_local_rates_from_worker_output(tmp_path: Path) -> None:
    """A step's round trip (metadata built -> its workers' output back),
    less the step's loads, is a prefill sample; the loads are the local
    tier's rate. Output of another step, or none, teaches nothing wrong."""
    pytest.importorskip("vllm")
    import time

    from ucm_db.connector.metadata import UcmDbWorkerMetadata
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    ns_id = sched._namespace.digest[:16].hex()
    try:
        idle = sched.build_connector_meta(_step(0))
        sched.observe_output(UcmDbWorkerMetadata(idle.step))  # nothing computed: no sample
        lost = sched.build_connector_meta(_step(2000))         # its output never comes back
        meta = sched.build_connector_meta(_step(2000))
        assert meta.step == lost.step + 1 == idle.step + 2
        started = time.perf_counter()
        time.sleep(0.3)
        sched.observe_output(UcmDbWorkerMetadata(meta.step, {(ns_id, "local"): (1024, 0.1)}))
        elapsed_s = time.perf_counter() - started
        assert sched.cost.load_rate(ns_id, "local") == pytest.approx(10240.0)
        rate = sched.cost.prefill.rate
        # 2000 tokens in the round trip less the 0.1 s of loads
        assert rate is not None and 2000 / (elapsed_s - 0.1 + 0.05) <= rate <= 2000 / 0.2
        assert sched.cost.prefill.samples == 1
        sched.observe_output(UcmDbWorkerMetadata(lost.step))  # dropped as stale: no sample
        sched.observe_output(None)
        assert sched.cost.prefill.samples == 1
    finally:
        sched.shutdown()


def test_worker_metadata_aggregates_ranks_by_the_slowest() -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.metadata import UcmDbWorkerMetadata

    rank0 = UcmDbWorkerMetadata(7, {("ns", "local"): (512, 0.2)})
    rank1 = UcmDbWorkerMetadata(7, {("ns", "local"): (512, 0.3)})
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, UcmDbWorkerMetadata)
    assert merged.step == 7 and merged.loads == {("ns", "local"): (512, 0.3)}


@pytest.mark.vllm
def test_local_hit_judged_slower_than_recompute_is_not_claimed(tmp_path: Path) -> None:
    """A slow local tier (as its workers' timings report it) loses its
    claims, except for a re-probe; ``always`` keeps loading."""
    pytest.importorskip("vllm")
    import ucm_db
    from ucm_db.connector.identity import grid, namespace, reader_spans
    from ucm_db.connector.metadata import UcmDbWorkerMetadata
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.keys.units import UnitKeys

    tokens = list(range(1, BS * BLOCKS + 5))
    shape = _shape()
    with ucm_db.open(tmp_path / "s") as store:
        keys = namespace(shape).block_keys(tokens)
        for span in reader_spans(shape):
            units = list(UnitKeys(keys, grid(shape), span))
            store.put(namespace(shape), units, [os.urandom(PAYLOAD_BYTES) for _ in units], parent=None)
    for policy, claimed in (("auto", 0), ("always", BLOCKS * BS)):
        sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "load_policy": policy}), shape)
        try:
            assert _claim(sched, tokens, "first") == BLOCKS * BS  # unmeasured: loaded
            sched.cost.observe_prefill(10_000, 1.0)
            meta = sched.build_connector_meta(_step(0))
            sched.observe_output(UcmDbWorkerMetadata(meta.step, {(sched._ns_id, "local"): (512, 1.0)}))  # 512 tokens/s
            assert _claim(sched, tokens, "second") == claimed
            assert sched.counters.totals.data["cost_skips"] == (1 if claimed == 0 else 0)
        finally:
            sched.shutdown()


def test_load_fit_needs_recent_hits_and_clamps_a_negative_fixed_cost() -> None:
    from ucm_db.connector.scheduler.cost_model import LoadFit

    fit = LoadFit(weight=0.15)
    for tokens in (512, 4096, 1024, 8192):
        fit.add(tokens, 0.002 + tokens * 1e-5)
    assert fit.line() == pytest.approx((0.002, 1e-5))
    for _ in range(200):  # a long run of misses: the hits' weight decays away
        fit.add(0, 0.002)
    assert fit.line() is None  # not a slope resting on nothing
    noisy = LoadFit()
    for tokens, seconds in ((100, 0.0009), (1000, 0.0101), (2000, 0.0199)):  # no fixed cost: noise below zero
        noisy.add(tokens, seconds)
    fixed_s, per_token_s = noisy.line()
    assert fixed_s == 0.0 and per_token_s == pytest.approx(1e-5, rel=0.02)


def test_lookups_that_asked_nothing_are_no_samples() -> None:
    model = CostModel()
    for tokens in (512, 4096):
        model.observe_load("ns", "remote", tokens, 0.002 + tokens * 1e-5)
    model.observe_load("ns", "remote", 0, 2e-5)  # breaker open: answered at once, nothing asked
    assert model.load_line("ns", "remote") == pytest.approx((0.002, 1e-5))
