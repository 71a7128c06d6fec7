"""``ucm-db bench gil``: every mode is measured, the commit process's
mode included, each against the model alone (a smoke test: how much a
mode slows the model is a figure for BENCHMARKS.md, never asserted here; a
bound on it failed whenever the host was loaded)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from ucm_db.tools.bench import gil  # noqa: E402


def test_every_mode_is_timed_against_the_model_alone() -> None:
    report = gil.measure(units=64, steps=20, repeats=1, hidden=64, layers=2)
    assert set(report["step_s"]) == set(gil.MODES) and "saves-process" in gil.MODES
    assert all(seconds > 0 for seconds in report["step_s"].values())
    assert report["ratio_to_alone"]["alone"] == 1.0
    assert set(report["ratio_to_alone"]) == set(gil.MODES) and all(r > 0 for r in report["ratio_to_alone"].values())
