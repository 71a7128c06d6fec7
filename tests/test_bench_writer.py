"""``ucm-db bench writer`` runs the connector's saves and reports every figure it promises.

No timing is asserted (benchmarks print figures). A tiny run (2 layers, 12
jobs, one repetition) drives a real connector worker and its background
writer into a real store, beside ``bench core``'s durable put. The real K/V
capture (about 10 s) is replaced by bf16 bits of normal noise: the codec is
``none``, so the bytes' content changes no figure of this run. Importing
the connector (vLLM) takes about 10 s of its own on a 2-core host.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import ucm_db

from ucm_db.tools.bench import writer as bench
from ucm_db.tools.bench.common import BLOCK_BYTES
from ucm_db.tools.cli_bench import bench_group

PER_CPU = ("writer", "commit", "off_engine")


def _noise(count: int) -> list[memoryview]:
    rng = np.random.default_rng(0)
    return [memoryview(rng.standard_normal(BLOCK_BYTES // 2, dtype=np.float32).view(np.uint16)[1::2].copy())
            for _ in range(min(count, 4))]  # the baseline cycles its payloads, as bench core's put does


@pytest.mark.parametrize("store", ["full", "fresh"])
def test_tiny_run_reports_every_figure_of_both_modes(tmp_path, monkeypatch, store) -> None:
    monkeypatch.setattr(bench, "load_payloads", _noise)
    args = ["writer", "--quick", "--layers", "2", "--jobs", "12", "--repeat", "1", "--dir", str(tmp_path), "--json",
            "--store", store]
    result = CliRunner().invoke(bench_group, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # torch may warn on stderr
    assert report["target"] == bench.TARGET
    assert report["baseline"]["put_gbps"]["value"] > 0 and report["baseline"]["put_gbps_per_cpu_s"]["value"] > 0
    assert [(r["case"], r["mode"]) for r in report["rows"]] == [("2L_backlog", "backlog"), ("2L_paced", "paced"), ("2L_steps", "steps")]
    jobs_bytes = sum([1, 2] * 6) * bench.KV_HEADS * 2 * bench.LAYER_UNIT_BYTES  # job blocks 1,2 cycled, 4 heads, 2 layers
    assert report["options"]["store"] == store
    for row in report["rows"]:
        assert row["saved_bytes"] == jobs_bytes and row["unit_bytes"] == 2 * bench.LAYER_UNIT_BYTES
        units = jobs_bytes // row["unit_bytes"]
        # at capacity the timed saves evict about what they store (the filler's units); a fresh store evicts nothing
        assert (units - 2 * bench.KV_HEADS <= row["evicted_units"] <= units) if store == "full" else row["evicted_units"] == 0
        assert row["wall_gbps"]["value"] > 0 and row["writer_cpu_ms_per_commit"]["value"] > 0
        for name in PER_CPU:
            assert row[f"{name}_gbps_per_cpu_s"]["value"] > 0 and row[f"{name}_x_put"]["value"] > 0
        assert row["target"]["measured"] == round(row["writer_x_put"]["value"], 4)
        assert row["target"]["met"] == (row["target"]["measured"] >= bench.TARGET)
        # LMDB writes every saved byte at least once, and more: records of other tables, B-tree pages, overflow headers
        assert 1.0 < row["written_x_saved"]["value"] < 20
    paced = report["rows"][1]
    assert paced["commits"] == 12  # one job per transaction
    assert report["rows"][0]["commits"] <= 12  # queued jobs may coalesce (how many: the threads' scheduling)
    assert report["rows"][2]["commits"] <= 12  # saves 2 ms apart: the writer's linger may join them
    assert list(tmp_path.iterdir()) == []  # scratch stores removed


def test_plan_continues_each_requests_chain() -> None:
    metas = bench.plan(layers=2, jobs=2 * bench.REQUESTS, job_blocks=[1, 2])
    transfers = [meta.saves[0] for meta in metas]
    assert [len(t.keys) for t in transfers] == [1, 2] * bench.REQUESTS
    for first, second in zip(transfers, transfers[bench.REQUESTS:]):
        assert first.req_id == second.req_id and first.parent is None
        assert second.parent == first.keys[-1]  # the next step's save continues the chain
    assert all(0 <= i < bench.CACHE_BLOCKS for t in transfers for i in t.block_ids)


def test_a_filler_plan_saves_the_same_jobs_under_other_keys() -> None:
    metas, filler = bench.plan(2, 12, [1, 2]), bench.plan(2, 12, [1, 2], seed=1)
    pairs = [(m.saves[0], f.saves[0]) for m, f in zip(metas, filler)]
    assert all(len(a.keys) == len(b.keys) and a.block_ids == b.block_ids for a, b in pairs)
    assert not {k for a, _ in pairs for k in a.keys} & {k for _, b in pairs for k in b.keys}


def test_the_baseline_keeps_the_put_of_median_cpu_time() -> None:
    assert bench.BASELINE_PUTS % 2 == 1  # a true median
    assert bench.median_by_cpu([(0.1, 0.9), (0.5, 0.2), (0.3, 0.4)]) == (0.3, 0.4)
    assert bench.median_by_cpu([(1.0, 1.0)]) == (1.0, 1.0)


def test_engine_rocksdb_saves_into_a_rocksdb_store(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "load_payloads", _noise)
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)  # keep the scratch stores to look at them
    args = ["writer", "--quick", "--layers", "2", "--jobs", "6", "--repeat", "1", "--backlog", "on", "--store", "fresh",
            "--engine", "rocksdb", "--dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(bench_group, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["options"]["engine"] == "rocksdb"
    assert report["rows"][0]["saved_bytes"] == sum([1, 2] * 3) * bench.KV_HEADS * 2 * bench.LAYER_UNIT_BYTES
    [saves] = [p for p in tmp_path.glob("*/ucm-bench-writer-2L_backlog-*") if p.is_dir()][-1:]
    with ucm_db.open(saves, read_only=True) as store:
        assert store.config.engine == "rocksdb" and store.stats().blocks > 0
