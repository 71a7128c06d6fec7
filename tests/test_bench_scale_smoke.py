"""The scale benchmark (``ucm-db bench scale``) runs at a tiny size and reports
every figure it promises, with verdicts computed from its own figures.

No timing is asserted (benchmarks print figures; BENCHMARKS.md records
them). The stores are real LMDB stores; open and first hit run in a new
process, verify and compact through the real CLI.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db.tools.bench import scale

FIGURES = ("open_s", "first_hit_s", "import_s", "lookup_ms", "put_ms", "put_real_ms", "verify_sample_s", "compact_s", "put_real_compacted_ms")
COUNTS = ("put_minor_faults",)  # may be 0 on a small store


def test_tiny_run_reports_every_figure_and_honest_verdicts(tmp_path) -> None:
    result = CliRunner().invoke(scale.command, [
        "--blocks", "384", "--small-blocks", "128", "--chain-blocks", "64", "--payload-bytes", "32", "--real-put-bytes", "4096", "--runs", "1",
        "--verify-sample", "16", "--dir", str(tmp_path), "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for store in ("large", "small"):
        for figure in FIGURES:
            assert len(report["runs"][store][figure]) == 1 and report["medians"][store][figure] > 0, (store, figure)
        for figure in COUNTS:
            assert len(report["runs"][store][figure]) == 1 and report["medians"][store][figure] >= 0, (store, figure)
        assert report["build"][store]["store_bytes"] > 0
    assert report["build"]["large"]["chains"] == 6 and report["build"]["small"]["chains"] == 2
    medians, ratios = report["medians"], report["ratios"]
    assert ratios["lookup_ms"] == pytest.approx(medians["large"]["lookup_ms"] / medians["small"]["lookup_ms"])
    verdicts = {t["target"]: t["met"] for t in report["targets"]}
    assert verdicts["first hit within 1 s of open, large store"] == (medians["large"]["first_hit_s"] <= 1.0)
    assert verdicts["put_ms large / small"] == (ratios["put_ms"] <= 1.5)
    assert "open -> first hit" in scale.format_table(report)
    assert not list(tmp_path.iterdir()), "the scratch stores are removed"


def test_built_store_holds_every_chain_and_a_missing_chain_stops_the_probe(tmp_path) -> None:
    figures = scale.build_store(tmp_path / "s", 200, 16, chain_blocks=64)
    assert figures["chains"] == 4  # 64 + 64 + 64 + 8
    with ucm_db.open(tmp_path / "s") as store:
        assert [store.lookup(scale.NAMESPACE, scale.chain_keys(seed, 64)) for seed in range(4)] == [64, 64, 64, 8]
    assert scale.probe_open(tmp_path / "s", 2, chain_blocks=64)["found"] == 64
    with pytest.raises(RuntimeError, match="first lookup after open found 0 of 64"):
        scale.probe_open(tmp_path / "s", 99, chain_blocks=64)


def test_a_store_smaller_than_a_chain_is_a_usage_error() -> None:
    result = CliRunner().invoke(scale.command, ["--blocks", "100", "--small-blocks", "10", "--chain-blocks", "64"])
    assert result.exit_code == 2 and "at least one whole chain" in result.output
