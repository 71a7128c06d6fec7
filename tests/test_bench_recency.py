"""``ucm-db bench recency`` runs at a tiny size and reports every phase's
figure; the maintenance thread it times is the store's. No timing is
asserted (benchmarks print figures)."""

from __future__ import annotations

import json
import threading

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


def test_the_timed_thread_is_the_stores_maintenance_thread(tmp_path) -> None:
    """The bench finds the thread by its OS name: the store's maintenance
    thread carries it (and no other thread of the process does)."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 26, sync_interval_s=0.05):
        names = [t.name for t in threading.enumerate()]
        assert any(name[:15] == recency.MAINTENANCE_COMM for name in names)
        assert recency._thread_cpu_ns(recency.MAINTENANCE_COMM) >= 0


def test_skipping_the_aged_phase_leaves_its_figures_out() -> None:
    result = CliRunner().invoke(recency.command, ["--chains", "1", "--blocks", "4", "--aged-s", "0", "--rounds", "1",
                                                  "--interval-s", "0.05", "--seconds", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    assert "aged_flush_ms" not in json.loads(result.stdout)
