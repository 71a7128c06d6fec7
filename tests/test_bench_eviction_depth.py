"""``ucm-db bench eviction-depth`` runs on real stores and reports each depth (no timing asserted)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.tools.cli_bench import bench_group


def test_a_tiny_run_reports_every_depth_and_leaves_no_store(tmp_path) -> None:
    args = ["eviction-depth", "--depths", "8,64", "--capacity-blocks", "600", "--puts", "10", "--repeat", "1",
            "--dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(bench_group, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [row["depth"] for row in report["rows"]] == [8, 64]
    assert all(row["put_cpu_ms"] > 0 and len(row["runs"]) == 1 for row in report["rows"])
    assert list(tmp_path.iterdir()) == []


def test_a_chain_deeper_than_the_store_is_refused_with_the_fix() -> None:
    result = CliRunner().invoke(bench_group, ["eviction-depth", "--depths", "600", "--capacity-blocks", "600", "--puts", "10"])
    assert result.exit_code != 0
    assert "raise --capacity-blocks" in result.output
