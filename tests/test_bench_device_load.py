"""``ucm-db bench device-load`` runs at a tiny size on the CPU through the
CLI: every way is reported and the loaded blocks equal the saved ones; no
timing is asserted (benchmarks print figures). On a GPU host the same
command measures the CUDA path (BENCHMARKS.md)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.tools.bench import device_load


def test_a_tiny_cpu_run_reports_every_way_and_loads_exact_bits() -> None:
    args = ["--device", "cpu", "--layers", "2", "--blocks", "4", "--rounds", "1", "--json"]
    result = CliRunner().invoke(device_load.command, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["layers"], r["codec"], r["unit_kib"]) for r in rows] == [(2, "none", 16), (2, "zstd", 16)]
    for row in rows:
        assert row["exact"] is True and row["pinned"] is False
        assert all(row[f"{way}_GBps"] > 0 for way in (*device_load.WAYS, "read1", "read8"))
        assert row["save_exact"] is True and all(row[f"{k}_ms"] > 0 for k in ("forward", "wait_save", "queue_save", "wait_step", "queue_step"))


def test_the_save_check_fails_when_a_queued_save_misses_its_bytes(monkeypatch) -> None:
    """``save_exact`` can fail: a queued save whose copy never lands (a
    stand-in that only returns the handle) leaves its zeroed rows."""
    from ucm_db.connector import device_saves
    from ucm_db.connector.layouts import KVLayout

    real = KVLayout.gather_units_async
    monkeypatch.setattr(KVLayout, "gather_units", lambda self, block_ids, staging: real(self, block_ids, staging).wait())
    monkeypatch.setattr(KVLayout, "gather_units_async", lambda self, block_ids, staging: device_saves.done())
    result = CliRunner().invoke(device_load.command, ["--device", "cpu", "--layers", "2", "--blocks", "4", "--rounds", "1",
                                                      "--codec", "none", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["save_exact"] is False
