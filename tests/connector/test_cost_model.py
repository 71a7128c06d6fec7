"""Load-or-recompute: the cost model's decisions (pure), the ``load_policy``
setting, and the scheduler over a real store whose remote is a real
``throttled://`` directory at two bandwidths (no engine: the prefill rate is
given as a calibration, the remote's rate is measured by the scheduler's own
timed lookups)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucm_db.connector.cost_model import CostModel, check_load_policy
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
BS, BLOCKS, PAYLOAD_BYTES = 32, 16, 16 << 10
#: Calibrated prefill rate of the scheduler tests: a slow link (0.5 MB/s:
#: ~1000 tokens/s of these blocks) is far below it, a fast one (1 GB/s) far
#: above it even with the lookup's own promotion cost.
PREFILL_TOKENS_PER_S = 5000.0


def _remote_with(tmp_path: Path, prompts: list[list[int]]) -> Path:
    """A remote directory holding every unit of ``prompts``' blocks,
    uploaded through a real store."""
    import ucm_db
    from ucm_db.connector.identity import grid, namespace, reader_spans
    from ucm_db.tools.bench.throttle import register
    from ucm_db.units import UnitKeys

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
@pytest.mark.parametrize(("bandwidth_bytes_per_s", "policy", "loads"), [
    (0.5e6, "auto", False),   # slower than recompute: recomputed, remote not asked
    (1e9, "auto", True),      # faster: loaded
    (0.5e6, "always", True),  # debugging: always loaded
])
def test_scheduler_claims_a_remote_hit_only_where_it_beats_recompute(
    tmp_path: Path, bandwidth_bytes_per_s: float, policy: str, loads: bool,
) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.scheduler import UcmDbScheduler
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
        sched.cost.observe_prefill(int(PREFILL_TOKENS_PER_S), 1.0)  # calibration
        # Unmeasured remote: asked (and timed) whatever its speed.
        assert _claim(sched, probe, "probe") == BLOCKS * BS
        ns_id = sched._namespace.digest[:16].hex()
        assert sched.cost.load_rate(ns_id, "remote") is not None
        got = _claim(sched, second, "second")
        assert got == (BLOCKS * BS if loads else 0)
        from ucm_db.connector.identity import grid, reader_spans
        from ucm_db.units import UnitKeys

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


@pytest.mark.vllm
def test_scheduler_measures_prefill_rate_from_step_timings(tmp_path: Path) -> None:
    """The tokens one step scheduled over the time until the next step is
    planned become a prefill-rate sample."""
    pytest.importorskip("vllm")
    import time

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from ucm_db.connector.scheduler import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    def step(tokens: int) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={}, total_num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
        )

    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        sched.build_connector_meta(step(0))  # idle step: no sample
        sched.build_connector_meta(step(2000))
        assert sched.cost.prefill.value is None
        started = time.perf_counter()
        time.sleep(0.2)
        sched.build_connector_meta(step(0))
        elapsed_s = time.perf_counter() - started
        rate = sched.cost.prefill.value
        assert rate is not None and 2000 / (elapsed_s + 0.05) <= rate <= 2000 / 0.2
    finally:
        sched.shutdown()
