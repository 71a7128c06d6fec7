"""``admit_after: "auto"`` on engines that share a store (connector/auto_admission.py): at threshold 2 the chains
:func:`~ucm_db.connector.auto_admission.sampled` picks are still stored from their first sighting, so reuse that
only another engine sees (a chain computed on one engine, read on another) is found stored and turns storing on
again. Before, engines that each saw a chain once all stopped storing it for good. The threshold's rule on its own,
then two real schedulers and workers on one real store."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.test_request_controls import BS, Engine, _request  # noqa: E402
from ucm_db.connector import auto_admission  # noqa: E402
from ucm_db.connector.auto_admission import HIGH_SHARE, MIN_EVIDENCE_BLOCKS, MIN_SAMPLED_BLOCKS, AutoThreshold  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402


def at_threshold_2() -> AutoThreshold:
    auto = AutoThreshold()
    assert auto.observe(0, MIN_EVIDENCE_BLOCKS) == 2
    return auto


def test_the_sampled_chains_reuse_moves_the_threshold_back_while_the_share_of_all_stays_low() -> None:
    auto = at_threshold_2()
    for _ in range(4):
        auto.observe(0, 4096)  # unsampled chains, nothing reused: the share of all stays near 0
    reused = round(64 * 2 * HIGH_SHARE)  # a fifth of each sampled chain's blocks found stored
    for _ in range(MIN_SAMPLED_BLOCKS // 64 - 1):
        assert auto.observe(reused, 64, sampled=True) == 2  # under the sample's evidence floor
    assert auto.share < HIGH_SHARE and auto.sampled_share >= HIGH_SHARE
    assert auto.observe(reused, 64, sampled=True) == 1
    assert auto.share >= HIGH_SHARE  # the sample's estimate stands for all: no move back at the next request
    assert auto.observe(0, 64) == 1


def test_a_sample_with_little_reuse_and_unsampled_reuse_move_nothing() -> None:
    auto = at_threshold_2()
    for _ in range(4 * MIN_SAMPLED_BLOCKS // 64):
        assert auto.observe(2, 64, sampled=True) == 2  # 3% of the sampled blocks reused
    assert auto.sampled_share < HIGH_SHARE


def test_sampled_observations_at_threshold_1_are_not_kept() -> None:
    auto = AutoThreshold()
    auto.observe(64, 64, sampled=True)
    assert auto.threshold == 1 and auto.sampled_share == 0.0


def test_the_sample_is_a_sixteenth_of_chains_decided_by_their_first_tokens() -> None:
    import random

    rng = random.Random(5)
    prompts = [[rng.randrange(50_000) for _ in range(40)] for _ in range(16_000)]
    picked = [p for p in prompts if auto_admission.sampled(p)]
    assert 800 < len(picked) < 1200  # 1000 expected
    assert all(auto_admission.sampled(p[:16]) and auto_admission.sampled(p[:16] + [7] * 100) for p in picked)
    assert not any(auto_admission.sampled(p[:15]) for p in picked)  # fewer than 16 tokens: not (yet) sampled


def test_a_hybrid_models_groups_sample_the_same_chains() -> None:
    """Each KV cache group keys the same tokens under its own namespace: the sample follows the tokens, so every
    group stores the same chains (a hit needs every group's)."""
    from ucm_db.connector.admission import Admission

    @dataclass
    class Marks:
        stored_blocks: int = 0
        sighted_blocks: int = 0
        admitted_blocks: int = 0
        admission_checked_blocks: int = 0

    tokens = next(t for t in ([i, *range(100, 131)] for i in range(1000)) if auto_admission.sampled(t))
    groups = [Admission(True, "auto") for _ in range(2)]
    for group in groups:
        assert group.auto is not None
        group.auto.observe(0, MIN_EVIDENCE_BLOCKS)  # threshold 2
    admitted = [g.admit(Marks(), [bytes([g_i, b]) * 16 for b in range(2)], 2, tokens) for g_i, g in enumerate(groups)]
    assert admitted == [2, 2]  # keys differ by group; the tokens decide


@pytest.fixture
def small_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floors and half-life small enough for 4-block prompts to decide; one chain in 2 sampled (the rules are the
    same)."""
    monkeypatch.setattr(auto_admission, "MIN_EVIDENCE_BLOCKS", 8)
    monkeypatch.setattr(auto_admission, "HALF_LIFE_BLOCKS", 4096)
    monkeypatch.setattr(auto_admission, "SAMPLE_ONE_IN", 2)
    monkeypatch.setattr(auto_admission, "MIN_SAMPLED_BLOCKS", 8)


def unique_prompts(start: int) -> Iterator[list[int]]:
    p = start
    while True:
        p += 1
        yield [1000 * p + i for i in range(4 * BS)] + [1]  # 4 whole blocks


def grown(prompt: list[int]) -> list[int]:
    """The prompt's next turn: two more blocks after its four."""
    return prompt[:-1] + [7] * 2 * BS + [1]


@pytest.mark.parametrize("sampling", [True, False])
def test_an_engine_that_reads_what_another_computed_stores_again(
    tmp_path: Path, small_rules: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    sampling: bool,
) -> None:
    """Engines A and B on one store, both at threshold 2 after unique traffic; A computes chains once, B serves
    their next turns. With the sample, B finds A's sampled chains stored and stores every chain again; without it
    (the old rule) neither engine ever sees the reuse."""
    if not sampling:
        monkeypatch.setattr(auto_admission, "sampled", lambda _key: False)
    settings = {"path": str(tmp_path / "store"), "admit_after": "auto", "load_policy": "always"}
    a = Engine(ConnectorSettings.from_extra_config(settings))
    b = Engine(ConnectorSettings.from_extra_config(settings))
    caplog.set_level(logging.INFO, logger="vllm")
    try:
        fresh = unique_prompts(0)
        for eng in (a, b):
            for _ in range(2):
                eng.prefill(_request(next(fresh)))
            assert eng.scheduler._admission.admit_after == 2
        for _ in range(12):  # B's own traffic: nothing reused, the share of all stays low
            b.prefill(_request(next(fresh)))
        hits = []
        for _ in range(8):  # chains A computes once, whose next turns come to B
            prompt = next(fresh)
            a.prefill(_request(prompt))
            hit, _saves = b.prefill(_request(grown(prompt)))
            hits.append(hit)
        assert a.scheduler._admission.admit_after == 2  # A's own traffic shows no reuse
        auto_b = b.scheduler._admission.auto
        assert auto_b is not None
        if sampling:
            assert any(hits), "B found none of A's sampled chains stored"
            assert b.scheduler._admission.admit_after == 1
            assert any("still stored at 2" in r.getMessage() for r in caplog.records)
            assert b.prefill(_request(next(fresh)))[1] == [(0, 1, 2, 3)]  # B stores from the first sighting again
        else:
            assert not any(hits) and b.scheduler._admission.admit_after == 2
    finally:
        a.close()
        b.close()
