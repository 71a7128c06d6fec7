"""``ucm-db bench staged`` runs at a tiny size through the CLI and reports
both ways for every unit size and codec; no timing is asserted
(benchmarks print figures)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.tools.bench import staged


def test_a_tiny_run_reports_both_ways(monkeypatch) -> None:
    monkeypatch.setattr(staged, "TOTAL_BYTES", 1 << 20)
    result = CliRunner().invoke(staged.command, ["--unit-kib", "16", "--rounds", "1", "--data", "random", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["unit_kib"], r["codec"]) for r in rows] == [(16, "none"), (16, "zstd")]
    assert all(r["list_GBps"] > 0 and r["slabs_GBps"] > 0 and r["ratio"] > 0 for r in rows)
