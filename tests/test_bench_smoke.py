"""The core benchmark runs and reports every figure it promises.

No timing is asserted here (benchmarks print figures; BENCHMARKS.md records
them); these tests only check that the script works and is honest about its
inputs: real K/V activations, verdicts computed from this run's figures.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from ucm_db import codec
from ucm_db.tools.bench import codec_frames
from ucm_db.tools.bench import core as bench
from ucm_db.tools.bench.common import BenchOptions


def test_quick_index_sections_report_figures_and_verdicts() -> None:
    result = CliRunner().invoke(bench.command, ["--quick", "--only", "lookup,keys", "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    figures = report["figures"]
    for name in ("lookup_8192_all", "lookup_8192_half", "lookup_8192_none", "block_keys_128k_list_wall"):
        assert figures[name]["value"] > 0
    verdicts = {t["target"]: t for t in report["targets"]}
    lookup = verdicts["lookup 8192 present (ms)"]
    assert lookup["measured"] == round(figures["lookup_8192_all"]["value"], 4)
    assert lookup["met"] == (lookup["measured"] <= 0.2)


def test_unknown_section_is_a_usage_error() -> None:
    result = CliRunner().invoke(bench.command, ["--only", "nonsense"])
    assert result.exit_code == 2 and "unknown section" in result.output


def test_table_output_lists_targets() -> None:
    report = bench.run(BenchOptions(quick=True, repeat=1, only=("keys",)))
    table = bench.format_table(report)
    assert "block_keys_128k_list_cpu" in table and "block_keys 128K tokens" in table


@pytest.mark.slow
def test_captured_kv_is_real_bf16_and_compressible() -> None:
    from ucm_db.tools.bench.kv_sample import capture_kv_in_subprocess, kv_blocks

    stream = capture_kv_in_subprocess()
    # 6 layers x (k, v) x 16 tokens x 384 hidden per token block
    assert stream.dtype == np.uint16 and len(stream) % (6 * 2 * 16 * 384) == 0
    values = (stream.astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(values).all() and values.std() > 0.01
    blocks = kv_blocks(stream, 2 << 20, 3)
    assert all(len(b) == 2 << 20 for b in blocks) and not np.array_equal(blocks[0], blocks[1])
    high_bytes = blocks[0][1::2].tobytes()  # sign and exponent: compressible unless the data were random
    assert len(zstandard.ZstdCompressor(level=1).compress(high_bytes)) < 0.6 * len(high_bytes)


def test_codec_frames_reports_each_configuration_and_restores_the_group_size() -> None:
    result = CliRunner().invoke(codec_frames.command, ["--frame-kib", "8", "--block-kib", "64", "--runs", "1", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["frame_bytes"] == 8 << 10 and row["block_bytes"] == 64 << 10
    for config in ("grouped", "alone", "none"):
        assert row[config]["decode_MBps"] > 0 and row[config]["encode_MBps"] > 0
    # Grouping 8 KiB frames never costs ratio (one Huffman table per group,
    # not per frame); the measured speeds are not asserted.
    assert row["grouped"]["ratio"] >= row["alone"]["ratio"] > 1.2
    assert codec.ZSTD_GROUP_BYTES == 256 << 10


def test_codec_frames_refuses_frames_that_do_not_divide_the_block() -> None:
    result = CliRunner().invoke(codec_frames.command, ["--frame-kib", "24", "--block-kib", "64"])
    assert result.exit_code == 2 and "do not divide" in result.output


def test_gil_reports_every_mode_against_the_model_alone() -> None:
    from ucm_db.tools.bench import gil

    result = CliRunner().invoke(gil.command, ["--units", "64", "--steps", "3", "--repeats", "2", "--hidden", "64", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["step_s"]) == set(gil.MODES) and report["ratio_to_alone"]["alone"] == 1.0
    assert all(len(runs) == 2 and min(runs) > 0 for runs in report["runs_s"].values())


def test_gil_runs_every_mode_under_each_switch_interval_and_restores_it() -> None:
    import sys

    from ucm_db.tools.bench import gil

    before = sys.getswitchinterval()
    result = CliRunner().invoke(gil.command, ["--units", "8", "--steps", "2", "--repeats", "1", "--hidden", "32",
                                              "--switch-interval-s", "0.001", "--switch-interval-s", "0.0002", "--json"])
    assert result.exit_code == 0, result.output
    reports = json.loads(result.output)
    assert [r["switch_interval_s"] for r in reports] == [0.001, 0.0002]
    assert all(set(r["step_s"]) == set(gil.MODES) for r in reports)
    assert sys.getswitchinterval() == before

    one = CliRunner().invoke(gil.command, ["--units", "8", "--steps", "2", "--repeats", "1", "--hidden", "32",
                                           "--switch-interval-s", "0.001", "--json"])
    assert one.exit_code == 0, one.output
    assert [r["switch_interval_s"] for r in json.loads(one.output)] == [0.001]
