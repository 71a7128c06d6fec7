"""``admit_after: "auto"`` (connector/auto_admission.py): chains are stored
from their second sighting while little of the engine's work is reused, and
from the first again once reuse returns; through the real scheduler and
worker on a real store, and the threshold's rule on its own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.test_request_controls import BS, UNITS_PER_BLOCK, Engine, _request, count_sketch_reads  # noqa: E402
from ucm_db.connector import auto_admission  # noqa: E402
from ucm_db.connector.auto_admission import HIGH_SHARE, LOW_SHARE, MIN_EVIDENCE_BLOCKS, AutoThreshold  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402


def test_the_threshold_stays_at_1_until_the_evidence_floor() -> None:
    auto = AutoThreshold()
    assert auto.observe(0, MIN_EVIDENCE_BLOCKS - 1) == 1  # nothing reused, but too little seen
    assert auto.observe(0, 1) == 2


def test_the_threshold_moves_with_the_reuse_share_and_has_a_gap() -> None:
    auto = AutoThreshold()
    assert auto.observe(int(MIN_EVIDENCE_BLOCKS * 0.5), MIN_EVIDENCE_BLOCKS) == 1  # half reused
    for _ in range(40):  # unique traffic: the share decays below LOW_SHARE
        threshold = auto.observe(0, 256)
    assert threshold == 2 and auto.share < LOW_SHARE
    # A share between the two bounds moves nothing either way.
    middle = (LOW_SHARE + HIGH_SHARE) / 2
    for _ in range(200):
        assert auto.observe(round(256 * middle), 256) == 2
    assert LOW_SHARE < auto.share < HIGH_SHARE
    for _ in range(40):
        threshold = auto.observe(128, 256)
    assert threshold == 1 and auto.share >= HIGH_SHARE
    for _ in range(200):
        assert auto.observe(round(256 * middle), 256) == 1


def test_auto_is_a_valid_setting_and_other_words_are_not(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path), "admit_after": "auto"})
    assert settings.admit_after == "auto"
    with pytest.raises(ConfigError, match=r'admit_after must be an integer in \[1, 255\] or "auto"'):
        ConnectorSettings.from_extra_config({"path": str(tmp_path), "admit_after": "adaptive"})


def test_auto_stops_storing_unique_prompts_and_resumes_when_they_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A small floor and half-life, so a few 4-block prompts decide (the rule is the same).
    monkeypatch.setattr(auto_admission, "MIN_EVIDENCE_BLOCKS", 8)
    monkeypatch.setattr(auto_admission, "HALF_LIFE_BLOCKS", 16)
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": "auto",
                                                      "load_policy": "always"}))
    caplog.set_level(logging.INFO, logger="vllm")
    try:
        prompts = [[1000 * p + i for i in range(4 * BS)] + [1] for p in range(1, 6)]  # 4 whole blocks each, unique
        assert eng.prefill(_request(prompts[0]))[1] == [(0, 1, 2, 3)]  # threshold 1: stored at first sight
        # 8 blocks observed, none seen before: the threshold moves to 2 as prompt 1's are counted.
        assert eng.prefill(_request(prompts[1])) == (0, [])
        assert eng.scheduler.counters.totals.data["admit_after"] == 1  # the gauge, as of prompt 1's lookup
        assert any("stored from their second sighting" in r.getMessage() for r in caplog.records)
        assert eng.prefill(_request(prompts[2])) == (0, [])  # a unique prompt is no longer written
        assert eng.scheduler.counters.totals.data["admit_after"] == 2
        assert eng.stored_units() == 4 * UNITS_PER_BLOCK
        # Prompt 2 again: its second sighting is admitted, and the reuse turns storing on for all.
        assert eng.prefill(_request(prompts[2]))[1] == [(0, 1, 2, 3)]
        assert any("every chain is stored again" in r.getMessage() for r in caplog.records)
        assert eng.prefill(_request(prompts[3]))[1] == [(0, 1, 2, 3)]  # unique, but reuse is back: stored
        # Blocks found stored count as reuse: prompt 0 grown by 2 blocks hits 4, stores 2.
        grown = prompts[0][:-1] + [5] * 2 * BS + [1]
        assert eng.prefill(_request(grown)) == (4 * BS, [(4, 5)])
        assert eng.scheduler._admission.auto is not None and eng.scheduler._admission.auto.share > HIGH_SHARE
        assert eng.prefill(_request(prompts[4]))[1] == [(0, 1, 2, 3)]
        assert eng.stored_units() == 18 * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_fixed_settings_keep_their_behaviour(tmp_path: Path) -> None:
    """``admit_after: 1`` keeps no sketch; 2 never moves (only "auto" does)."""
    one = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "a"), "load_policy": "always"}))
    two = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "b"), "admit_after": 2, "load_policy": "always"}))
    try:
        assert one.scheduler._admission.sketch is None and one.scheduler._admission.auto is None
        prompt = [7] * 4 * BS + [1]
        assert two.prefill(_request(prompt))[1] == []
        assert two.prefill(_request(prompt))[1] == [(0, 1, 2, 3)]
        assert two.scheduler._admission.admit_after == 2
    finally:
        one.close()
        two.close()


def test_a_producer_stores_every_chain_under_auto(tmp_path: Path) -> None:
    """A kv_producer's consumers read what it stores, and its own traffic
    shows them no reuse: "auto" is 1 there."""
    from tests.connector.test_request_controls import SHAPE
    from ucm_db.connector.roles import RolePolicy
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": "auto"})
    producer = UcmDbScheduler(settings, SHAPE, RolePolicy("kv_producer"))
    try:
        assert producer._admission.auto is None and producer._admission.admit_after == 1
    finally:
        producer.shutdown()


def test_auto_reads_the_sighting_counts_once_a_save_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reuse share and the refusal read one range of counts together
    (the scheduler plans saves every step)."""
    monkeypatch.setattr(auto_admission, "MIN_EVIDENCE_BLOCKS", 4)
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": "auto",
                                                      "load_policy": "always"}))
    try:
        reads = count_sketch_reads(eng)
        assert eng.prefill(_request([3] * 4 * BS + [1]))[1] == []  # 4 unique blocks: N moves to 2, they are refused
        assert eng.scheduler._admission.admit_after == 2 and reads == [4]
        assert eng.prefill(_request([3] * 4 * BS + [1]))[1] == [(0, 1, 2, 3)]  # seen again: admitted
        assert reads == [4, 4]
    finally:
        eng.close()
