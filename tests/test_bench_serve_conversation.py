"""The conversation workload of the serving benchmark (issue 29 item 5),
the parts that run without a vLLM server: the seeded conversations, the
prefix-hit accounting read from Prometheus text, and the verdicts.

The workload against real servers is ``ucm-db bench serve --workload
conversation`` (a script that prints figures; its runs are in the reports).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from ucm_db.tools.bench import serve, serve_chat
from ucm_db.tools.bench.serve_chat_client import summarize
from ucm_db.tools.bench.serve_conversation import (ConversationSpec, conversations, ideal_hits, parse_vllm_counters,
                                                   pass_hits, recovered_hits, reusable_tokens)
from ucm_db.tools.bench.serve_model import SPECIAL_TOKENS, VOCAB_SIZE


def test_seeded_conversations_are_deterministic_and_grow_a_turn_at_a_time() -> None:
    spec = ConversationSpec(conversations=5, turns=4, turn_tokens=40, output_tokens=7, seed=3)
    first = conversations(spec)
    assert first == conversations(spec)  # same seed, same token ids
    assert first != conversations(ConversationSpec(conversations=5, turns=4, turn_tokens=40, output_tokens=7, seed=4))
    assert len(first) == 5 and all(len(turns) == 4 for turns in first)
    for turns in first:
        for k, prompt in enumerate(turns):
            assert len(prompt) == (k + 1) * 40 + k * 7  # user messages and the assistant blocks between them
            assert all(len(SPECIAL_TOKENS) <= t < VOCAB_SIZE for t in prompt)
            if k:
                assert prompt[:len(turns[k - 1])] == turns[k - 1], "a turn's prompt extends the previous one"
    assert first[0][0] != first[1][0], "conversations share nothing"
    assert len(first[0][-1]) == spec.last_prompt_tokens and spec.request_tokens == spec.last_prompt_tokens + 7


def test_reusable_prefix_is_the_previous_prompts_whole_blocks() -> None:
    assert reusable_tokens(100, 0, 32) == 0  # a first turn has nothing before it
    assert reusable_tokens(150, 100, 32) == 96  # the previous prompt's whole blocks: its partial block held an answer
    assert reusable_tokens(128, 128, 32) == 96  # a repeated prompt: never its last token (vLLM computes it)
    spec = ConversationSpec(conversations=3, turns=3, turn_tokens=40, output_tokens=8)
    # prompts 40, 88, 136 tokens: cold reuses 0 + 32 + 64; warm 32 + 64 + 128 per conversation.
    assert ideal_hits(spec, 32, warm=False) == 3 * (0 + 32 + 64)
    assert ideal_hits(spec, 32, warm=True) == 3 * (32 + 64 + 128)
    assert spec.working_set_blocks(32) == 3 * 5  # 136 + 8 tokens: 5 blocks each


def test_prefix_hits_are_read_from_prometheus_text_and_differenced() -> None:
    page = "\n".join([
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 4096.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="bench"} 1.7e+09',
        'vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 9000.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 512.0',
        'vllm:gpu_prefix_cache_hits_total{engine="0"} 7.0',
        'vllm:prompt_tokens_total{engine="0",model_name="bench"} 9999.0',
    ])
    assert parse_vllm_counters(page) == {"prefix_cache_hits": 4096.0, "prefix_cache_queries": 9000.0,
                                         "external_prefix_cache_hits": 512.0}
    before = {"prefix_cache_hits": 96.0, "hit_tokens": 10.0}
    hits = pass_hits(before, {**parse_vllm_counters(page), "hit_tokens": 522.0})
    assert hits == {"vllm_queries": 9000.0, "vllm_hits": 4000.0, "external_hits": 512.0, "ucm_hit_tokens": 512.0}


def test_recovered_hits_and_verdicts_come_from_the_rows_figures() -> None:
    def row(rps: float, vllm_hits: float, ucm: float | None = None) -> dict:
        r = {"request_throughput": rps, "median_ttft_ms": 50.0, "p99_ttft_ms": 90.0,
             "hits": {"vllm_queries": 0.0, "vllm_hits": vllm_hits, "external_hits": ucm or 0.0,
                      "ucm_hit_tokens": ucm or 0.0}}
        return r if ucm is None else {**r, "ucm_db": {"hit_tokens": ucm}}

    assert recovered_hits(row(1, 10, 0)["hits"], row(1, 0)["hits"]) == 1.0  # nothing to recover
    assert recovered_hits(row(1, 300, 690)["hits"], row(1, 1000)["hits"]) == 0.99
    runs = [{"cold-bound": row(2.0, 1000), "no-conn-capped": row(1.0, 200), "ucm-first": row(1.96, 300, 695),
             "warm-bound": row(4.0, 2000), "ucm-second": row(3.9, 100, 1800)}]
    options = serve_chat.ChatOptions(spec=ConversationSpec(), serve=serve.ServeOptions())
    report = serve_chat.report(options, runs, elapsed_s=1.0)
    verdicts = {t["row"]: t for t in report["targets"]}
    assert verdicts["ucm-first"] == {"row": "ucm-first", "bound": "cold-bound", "recovered_hits": 0.995,
                                     "rps_ratio": 0.98, "met": True}
    assert verdicts["ucm-second"]["recovered_hits"] == 0.95 and verdicts["ucm-second"]["met"] is False
    assert verdicts["no-conn-capped"]["recovered_hits"] == 0.2 and verdicts["no-conn-capped"]["met"] is None
    assert "ucm-restart" not in verdicts  # no figure, no verdict
    table = serve_chat.format_table(report)
    assert "vLLM alone, capped, first pass" in table and "MISSED" in table
    # Paired warm passes (--paired): the req/s verdict is the median of the
    # pairs' ratios, not 3.9 / 4.0.
    runs[0]["ucm-second"]["paired_ratios"] = [0.93, 0.96, 0.97]
    paired = serve_chat.report(replace(options, serve=serve.ServeOptions(warm_passes=3, paired=True)), runs, elapsed_s=1.0)
    assert {t["row"]: t for t in paired["targets"]}["ucm-second"]["rps_ratio"] == 0.96
    assert "3 paired warm passes" in serve_chat.format_table(paired)


def test_pass_figures_are_percentiles_of_the_requests() -> None:
    figures = summarize([0.1] * 98 + [1.0, 2.0], duration_s=10.0, cached_tokens=64)
    assert figures["completed"] == 100 and figures["request_throughput"] == 10.0
    assert figures["median_ttft_ms"] == pytest.approx(100.0) and figures["p99_ttft_ms"] == pytest.approx(1010.0)


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "ucm-first,ucm-remote"], "unknown row(s) ucm-remote for --workload conversation"),
    (["--capped-blocks", "10", "--turn-tokens", "256"], "cannot hold one conversation's last turn"),
])
def test_bad_conversation_sizes_are_usage_errors_before_any_server_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve.command, ["--workload", "conversation", *args])
    assert result.exit_code == 2 and message in result.output
