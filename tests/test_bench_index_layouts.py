"""The index-layout model (``ucm-db bench index-layouts``) runs at a tiny size
and reports one row per layout, with each layout writing the tables it
names. No timing is asserted (benchmarks print figures)."""

from __future__ import annotations

import json

import lmdb
from click.testing import CliRunner

from ucm_db.tools.bench import index_layouts


def test_tiny_run_reports_every_layout(tmp_path) -> None:
    result = CliRunner().invoke(index_layouts.command, [
        "--blocks", "600", "--small-blocks", "100", "--puts", "2", "--store-put-ms", "5", "--dir", str(tmp_path), "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["layout"]: row for row in report["rows"]}
    assert list(rows) == ["format-3", "merged", "by-seq", "one"]
    assert [rows[name]["random_tables"] for name in rows] == [4, 3, 2, 1]
    for row in rows.values():
        assert row["large_put_ms"] > 0 and row["small_put_ms"] > 0
        assert row["ratio"] == round(row["large_put_ms"] / row["small_put_ms"], 2)
        # The store's work outside the tables (5 ms less the model's format-3 put) dilutes every ratio towards 1.
        low, high = sorted((1.0, row["ratio"]))
        assert low - 0.01 <= row["store_model_ratio"] <= high + 0.01
    assert list(tmp_path.iterdir()) == []  # the scratch models are removed


def test_each_layout_writes_the_tables_it_names(tmp_path) -> None:
    expected = {
        "format-3": {"heads": 2, "blocks": 2, "meta": 2, "children": 1, "lru": 2},
        "merged": {"index": 2, "blocks": 2, "children": 1, "lru": 2},
        "by-seq": {"index": 2, "payloads": 2, "children": 1, "lru": 2},
        "one": {"index": 2, "payloads": 2, "lru": 2},
    }
    for layout in index_layouts.layouts():
        model = index_layouts._Model(tmp_path / layout.name, layout)
        model.build(2)  # one chain of two blocks: one child entry
        with model.env.begin() as txn:
            counts = {name: txn.stat(db)["entries"] for name, db in model.dbs.items()}
        model.close()
        assert counts == expected[layout.name], layout.name
