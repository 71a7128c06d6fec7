"""The remote benchmark runs end to end at toy sizes (figures not checked:
benchmarks are scripts, not timed tests)."""

from __future__ import annotations

import pytest

from ucm_db.tools.bench import remote as bench_remote

pytestmark = pytest.mark.timeout(120)


def test_bench_remote_runs_on_a_file_remote(tmp_path) -> None:
    results = bench_remote.run({"targets": "file", "blocks": 4, "block_kib": 8, "repeat": 1,
                                "lookup_blocks": 100, "scratch_dir": str(tmp_path)})
    lookup = results["file"]["lookup"]
    assert [lookup[x]["found"] for x in ("empty", "half", "full")] == [0, 50, 100]
    assert lookup["full"]["round_trips"] == 1
    assert lookup["lookup_with_promotion"]["blocks_local_after"] == 100
    transfer = results["file"]["transfer"]
    assert {"upload", "raw_pipe", "fetch", "download", "raw_cat"} <= set(transfer)
    assert results["remote_down"]["local_hits_served"] is True
    assert "s3" not in results
    assert "lookup" in bench_remote._human(results)
