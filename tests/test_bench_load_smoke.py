"""``ucm-db bench load`` runs and reports every figure it promises.

No timing is asserted (benchmarks print figures); this checks that the
script drives the connector worker's real load and save paths at a tiny
size, for both codecs, warm and cold, and prints each path's fields.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.tools.bench import load as bench
from ucm_db.tools.cli_bench import bench_group


def test_tiny_run_reports_every_path_of_both_codecs(tmp_path) -> None:
    args = ["--unit-kib", "16", "--total-mib", "1", "--repeats", "1", "--save-blocks", "2", "--scratch-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(bench.command, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["codec"], r["unit_bytes"]) for r in rows] == [("none", 16 << 10), ("zstd", 16 << 10)]
    for row in rows:
        assert row["layers"] == 2 and row["bytes"] == row["blocks"] * bench.KV_HEADS * row["unit_bytes"]
        for path in ("memcpy", "save", "save_calls", "put", "load_warm", "load_cold"):
            assert row[path]["GBps"] > 0 and row[path]["cpu_GBps"] > 0
        for path in ("save", "save_calls", "put", "load_warm", "load_cold"):
            assert row[path]["x_memcpy"] == row[path]["GBps"] / row["memcpy"]["GBps"]
        assert row["save"]["x_put"] == row["save"]["GBps"] / row["put"]["GBps"]  # the saves' same-run baseline
        assert row["save_calls"]["s"] <= row["save"]["s"]  # the caller's share of the same saves
    assert list(tmp_path.iterdir()) == []  # scratch stores removed


def test_table_output_through_the_bench_group_names_each_path(tmp_path) -> None:
    args = ["load", "--codec", "none", "--unit-kib", "8", "--total-mib", "1", "--repeats", "1", "--no-cold",
            "--scratch-dir", str(tmp_path)]
    result = CliRunner().invoke(bench_group, args)
    assert result.exit_code == 0, result.output
    for field in ("GB/s", "GB/s/CPU", "x memcpy", "load_warm", "save", "save_calls", "put", "save/put"):
        assert field in result.output
    assert "load_cold" not in result.output
