"""``ucm-db bench lmdb-floor`` runs at a tiny size and reports every unit
size under both settings, with the host probe; bad sizes are refused by
name. No timing is asserted (benchmarks print figures)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ucm_db.engines.lmdb import malloc
from ucm_db.tools.bench import lmdb_floor


def test_tiny_run_reports_every_size_and_setting(tmp_path) -> None:
    result = CliRunner().invoke(lmdb_floor.command, [
        "--unit-kib", "8,32", "--live-mib", "1", "--txns", "3", "--repeat", "1", "--dir", str(tmp_path), "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {(row["unit_kib"], row["setting"]): row for row in report["rows"]}
    assert list(rows) == [(8, "pwrite"), (8, "writemap"), (32, "pwrite"), (32, "writemap")]
    for (kib, _), row in rows.items():
        assert row["units_per_txn"] == lmdb_floor.units_per_txn(kib << 10)
        assert row["gb_s_per_cpu_s"] > 0 and row["user_us_a_unit"] + row["sys_us_a_unit"] > 0
    assert rows[(32, "pwrite")]["x_largest"] == rows[(32, "writemap")]["x_largest"] == 1.0
    assert report["host_page_write_sys_us"] >= 0 and report["malloc_keeps_freed_memory"] in (True, False)
    assert list(tmp_path.iterdir()) == []  # every scratch file is removed


def test_the_model_keeps_its_live_set_and_writes_each_record(tmp_path) -> None:
    """The deletes hold the live set, taking every record of a unit with it
    (its child link too): what is left after a run is exactly the live units'."""
    for setting in lmdb_floor.SETTINGS:
        run = lmdb_floor.floor_once(64 << 10, setting, 8 << 20, 5, tmp_path)
        live_units = (8 << 20) // (64 << 10)  # two transactions' units: the deletes run in every timed one
        assert run.units == 5 * lmdb_floor.units_per_txn(64 << 10)
        assert run.records == dict.fromkeys(("heads", "blocks", "meta", "lru", "children"), live_units)
    growing = lmdb_floor.floor_once(64 << 10, "pwrite", 0, 2, tmp_path)  # --live-mib 0: nothing deleted
    written = (lmdb_floor.GROWING_WARM_TXNS + 2) * lmdb_floor.units_per_txn(64 << 10)
    assert growing.records == dict(dict.fromkeys(("heads", "blocks", "meta", "lru"), written), children=written - 1)
    assert list(tmp_path.iterdir()) == []


def test_body_records_write_the_body_alone(tmp_path) -> None:
    """``--records body`` keeps the live set with the body table alone: every
    other table stays empty, and the report says which records it wrote."""
    run = lmdb_floor.floor_once(64 << 10, "pwrite", 8 << 20, 5, tmp_path, "body")
    assert run.records == dict(dict.fromkeys(("heads", "meta", "lru", "children"), 0), blocks=(8 << 20) // (64 << 10))
    result = CliRunner().invoke(lmdb_floor.command, [
        "--unit-kib", "8,32", "--live-mib", "1", "--txns", "2", "--repeat", "1", "--records", "body", "--dir", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    assert "the body alone a unit" in result.output
    bad = CliRunner().invoke(lmdb_floor.command, ["--records", "one", "--dir", str(tmp_path)])
    assert bad.exit_code != 0 and "--records" in bad.output
    assert list(tmp_path.iterdir()) == []


def test_folded_records_write_one_record_beside_recency_and_child_link(tmp_path) -> None:
    """``--records folded`` (head and metadata inside the body's record):
    no head or metadata table, the body's value holds all three, and the
    deletes keep recency and child links with the live set."""
    run = lmdb_floor.floor_once(64 << 10, "pwrite", 8 << 20, 5, tmp_path, "folded")
    live_units = (8 << 20) // (64 << 10)
    assert run.records == dict(heads=0, meta=0, blocks=live_units, lru=live_units, children=live_units)
    result = CliRunner().invoke(lmdb_floor.command, [
        "--unit-kib", "8,32", "--live-mib", "1", "--txns", "2", "--repeat", "1", "--records", "folded", "--dir", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    assert "--records folded" in result.output
    assert list(tmp_path.iterdir()) == []


def test_headmeta_records_fold_the_head_into_the_metadata_record(tmp_path) -> None:
    """``--records headmeta``: no head table; the body alone in ``blocks``,
    the metadata record holds the head too; deletes keep every table at the live set."""
    run = lmdb_floor.floor_once(64 << 10, "pwrite", 8 << 20, 5, tmp_path, "headmeta")
    live_units = (8 << 20) // (64 << 10)
    assert run.records == dict(heads=0, meta=live_units, blocks=live_units, lru=live_units, children=live_units)
    result = CliRunner().invoke(lmdb_floor.command, [
        "--unit-kib", "8,32", "--live-mib", "1", "--txns", "2", "--repeat", "1", "--records", "headmeta", "--dir", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    assert "--records headmeta" in result.output
    assert list(tmp_path.iterdir()) == []


def test_bad_unit_sizes_are_refused_by_name(tmp_path) -> None:
    for bad in ("abc", "2", "", "16,0"):
        result = CliRunner().invoke(lmdb_floor.command, ["--unit-kib", bad, "--dir", str(tmp_path)])
        assert result.exit_code != 0
        assert "--unit-kib" in result.output


def test_malloc_thresholds_are_the_engines() -> None:
    """The bench keeps freed memory as the store's LMDB engine does; its own
    copy of the thresholds (it imports nothing of the store) may not drift."""
    assert (lmdb_floor._M_TRIM_THRESHOLD, lmdb_floor._M_MMAP_THRESHOLD) == (malloc._M_TRIM_THRESHOLD, malloc._M_MMAP_THRESHOLD)
    assert (lmdb_floor._MMAP_THRESHOLD_BYTES, lmdb_floor._TRIM_THRESHOLD_BYTES) == (
        malloc._MALLOC_MMAP_THRESHOLD_BYTES, malloc._MALLOC_TRIM_THRESHOLD_BYTES)
