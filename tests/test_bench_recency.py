"""``ucm-db bench recency`` runs at a tiny size and reports every phase's
figure; the maintenance thread it times is the store's. No timing is
asserted (benchmarks print figures)."""

from __future__ import annotations

import json

import ucm_db
from click.testing import CliRunner

from ucm_db.tools.bench import recency


def test_tiny_run_reports_every_phase() -> None:
    result = CliRunner().invoke(recency.command, [
        "--chains", "2", "--blocks", "8", "--aged-s", "0.01", "--rounds", "2", "--interval-s", "0.05", "--seconds", "0.5",
        "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["aged_flush_ms"] > 0 and report["again_flush_ms"] > 0
    assert report["written_us_per_touch"] > 0 and len(report["written_runs"]) == 2
    assert report["kept_back_touches"] >= 16 and report["kept_back_touches"] % 16 == 0
    assert report["kept_back_us_per_touch"] >= 0 and report["kept_back_over_written"] >= 0


def test_the_timed_thread_is_the_new_stores_own_maintenance_thread(tmp_path) -> None:
    """The bench times the maintenance thread its store started, found
    beside those of stores already open in the process (as in a test run)."""
    with ucm_db.open(tmp_path / "a", capacity_bytes=1 << 26, sync_interval_s=0.05):
        before = recency.maintenance_tids()
        assert len(before) >= 1
        with ucm_db.open(tmp_path / "b", capacity_bytes=1 << 26, sync_interval_s=0.05):
            mine = recency.maintenance_tids() - before
            assert len(mine) == 1 and recency.thread_cpu_ns(next(iter(mine))) >= 0
        result = CliRunner().invoke(recency.command, ["--chains", "1", "--blocks", "4", "--aged-s", "0", "--rounds", "1",
                                                      "--interval-s", "0.05", "--seconds", "0.5", "--json"])
        assert result.exit_code == 0, result.output  # another store open beside the bench's


def test_skipping_the_aged_phase_leaves_its_figures_out() -> None:
    result = CliRunner().invoke(recency.command, ["--chains", "1", "--blocks", "4", "--aged-s", "0", "--rounds", "1",
                                                  "--interval-s", "0.05", "--seconds", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    assert "aged_flush_ms" not in json.loads(result.stdout)
