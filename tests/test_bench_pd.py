"""The PD benchmark's pure parts (no engine, nothing timed): prompts, the
expected hit, medians without the warm-up, the stream reader, the report and
its verdicts, and the server command lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucm_db.tools.bench import pd, pd_serve
from ucm_db.tools.bench.pd_engine import PUBLISH_WAIT_METRIC, publish_wait_total_s, transfer_config


def test_prompts_are_reproducible_and_avoid_special_ids() -> None:
    prompts = pd.make_prompts(3, 2, 100)
    assert prompts == pd.make_prompts(3, 2, 100) and prompts[0] != prompts[1]
    assert all(len(p) == 100 and min(p) >= 4 and max(p) < pd.VOCAB_SIZE for p in prompts)


@pytest.mark.parametrize(("tokens", "hit"), [(2048, 2016), (2000, 1984), (33, 32), (32, 0)])
def test_expected_hit_leaves_the_block_of_the_last_token(tokens: int, hit: int) -> None:
    assert pd.expected_hit_tokens(tokens, 32) == hit


def test_median_leaves_the_warm_up_out() -> None:
    assert pd.median_after_warmup([100.0, 1.0, 3.0, 2.0]) == 2.0
    assert pd.median_after_warmup([5.0]) == 5.0


def test_stream_reader_times_the_first_token_and_reads_usage() -> None:
    clock = iter([1.5, 9.0]).__next__
    lines = [
        "", 'data: {"choices": [{"text": ""}]}',
        'data: {"choices": [{"text": "ab"}]}', 'data: {"choices": [{"text": " cd"}]}',
        'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 2016}}}', "data: [DONE]",
    ]
    result = pd_serve.read_stream(lines, started=1.0, clock=clock)
    assert result == {"ttft_s": 0.5, "text": "ab cd", "cached_tokens": 2016}
    with pytest.raises(RuntimeError, match="without a completion token"):
        pd_serve.read_stream(["data: [DONE]"], started=0.0)


def test_publish_wait_reads_only_its_counter() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    assert publish_wait_total_s(registry) == 0.0
    wait = Counter(PUBLISH_WAIT_METRIC, "wait", ["engine"], registry=registry)
    wait.labels("0").inc(0.25)
    wait.labels("1").inc(0.5)
    Counter("vllm:other", "other", registry=registry).inc(9)
    assert publish_wait_total_s(registry) == 0.75


def _offline(consumer_s: list[float], recompute_s: list[float], wait_s: list[float]) -> dict:
    params = [{"ucm_db": {"blocks": 64}}] * len(wait_s)
    return {
        "consumer": {"latency_s": consumer_s, "recompute_latency_s": recompute_s, "cached": [2016] * len(consumer_s)},
        "producer": {"publish_wait_s": wait_s, "latency_s": [5.0] * len(wait_s), "params": params,
                     "save_copy_s": [0.001] * len(wait_s), "save_commit_s": [0.002] * len(wait_s)},
        "load_avg": {"before": [1.0, 1.0, 1.0], "after": [2.0, 2.0, 2.0]},
    }


def test_summary_computes_ratios_and_verdicts() -> None:
    options = pd.PdOptions(prompts=3, remote=False, serve=False)
    report = pd.summarise(options, _offline([9.0, 1.0, 2.0], [20.0, 10.0, 10.0], [1.0, 0.02, 0.04]), None)
    consumer, local = report["consumer"], report["publish"]["local"]
    assert consumer["ratio"] == 0.15 and consumer["met"] and consumer["every_published_block_hit"]
    assert local["median_wait_ms"] == 30.0 and local["met"] and local["published_blocks"] == [64, 64, 64]
    assert (local["median_save_copy_ms"], local["median_save_commit_ms"]) == (1.0, 2.0)
    slow = pd.summarise(options, _offline([9.0, 4.0, 4.0], [9.0, 10.0, 10.0], [0.0, 0.06, 0.08]), None)
    assert not slow["consumer"]["met"] and not slow["publish"]["local"]["met"]
    assert "NOT met" in pd.format_report({**slow, "elapsed_s": 1.0})
    json.dumps(report)


def test_summary_of_the_serving_part() -> None:
    options = pd.PdOptions(prompts=2, remote=False)
    serving = {
        "pd": [{"ttft_s": 3.0, "prefill_ms": 900.0, "prefill": "ok", "cached_tokens": 2016, "text": "a"}] * 2,
        "single": [{"ttft_s": 2.0, "prefill_ms": None, "prefill": None, "cached_tokens": 0, "text": "a"}] * 2,
        "load_avg": {"before": [1.0], "after": [1.0]},
    }
    report = pd.summarise(options, _offline([1.0, 1.0], [4.0, 4.0], [0.01, 0.01]), serving)
    assert report["serve"]["ratio"] == 1.5 and report["serve"]["same_text_as_single"] == [True, True]
    assert "(c) end-to-end TTFT" in pd.format_report({**report, "elapsed_s": 1.0})


def test_server_command_lines() -> None:
    producer = pd_serve.ServerSpec(Path("/m"), None, 2112, {"path": "/s"}, enforce_eager=True, role="kv_producer")
    argv = producer.argv(8100)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == transfer_config("kv_producer", {"path": "/s"}) and "--enforce-eager" in argv
    assert "--kv-transfer-config" not in pd_serve.ServerSpec(Path("/m"), None, 2112).argv(8100)
    assert "--num-gpu-blocks-override" not in argv
    proxy = pd_serve.ProxySpec("http://a:1", "http://b:2").argv(8000)
    assert proxy[1:3] == ["-m", "ucm_db.tools.proxy"] and "--port" in proxy
