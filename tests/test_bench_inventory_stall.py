"""`ucm-db bench inventory-stall` runs on both engines and reports what
BENCHMARKS.md quotes (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.tools.bench.inventory_stall import CHAIN_BLOCKS, command


def test_inventory_stall_reports_the_walk_and_the_puts_beside_it_on_each_engine() -> None:
    result = CliRunner().invoke(command, ["--blocks", str(CHAIN_BLOCKS), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert [f["engine"] for f in figures] == ["lmdb", "rocksdb"]
    for f in figures:
        assert f["records"] >= CHAIN_BLOCKS and f["walk_ms"] > 0
        assert f["alone"]["puts"] > 0 and f["during"]["puts"] > 0
        assert f["during"]["max_ms"] >= f["during"]["median_ms"] > 0
