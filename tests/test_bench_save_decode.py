"""The save_decode benchmark (tools/bench/save_decode.py): its prompts are the
workloads it names, its ideal is what a cache could serve, and a ``--quick``
run on a real vLLM engine with save_decode on serves that ideal.

The pure parts run without an engine; the ``--quick`` run (marked ``vllm``,
``slow``) starts one tiny engine (save_decode true), about 35 s on a 2-core
host; ``ucm-db bench save-decode --quick`` runs both values.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ucm_db.tools.bench import save_decode as bench
from ucm_db.tools.bench.save_decode import BLOCK_SIZE, ideal_hits, messages, next_prompt


def test_chat_sends_the_reply_back_and_reasoning_drops_it() -> None:
    prompt, output, message = [5, 6, 7], [8, 9], [10, 11]
    assert next_prompt("chat", prompt, output, message) == [5, 6, 7, 8, 9, 10, 11]
    assert next_prompt("reasoning", prompt, output, message) == [5, 6, 7, 10, 11]
    assert prompt == [5, 6, 7]  # the previous prompt is not changed in place
    with pytest.raises(ValueError, match="unknown workload"):
        next_prompt("summary", prompt, output, message)


def test_messages_are_seeded_sized_and_apart_between_workloads() -> None:
    chat = messages("chat", conversations=3, turns=4, first_tokens=50, user_tokens=20, seed=1)
    assert [[len(m) for m in conv] for conv in chat] == [[50, 20, 20, 20]] * 3
    assert chat == messages("chat", 3, 4, 50, 20, seed=1)
    reasoning = messages("reasoning", 3, 4, 50, 20, seed=1)
    firsts = {tuple(conv[0][:BLOCK_SIZE]) for conv in chat + reasoning}
    assert len(firsts) == 6  # no conversation can hit another's first block, in or across workloads
    assert all(3 <= t < bench.VOCAB for conv in chat for m in conv for t in m)


def test_ideal_hits_count_earlier_batches_kv_in_whole_blocks() -> None:
    prompt, output = list(range(100, 110)), list(range(200, 206))  # KV computed for 10 + 5 tokens
    chat = next_prompt("chat", prompt, output, [300, 301, 302])  # 19 tokens
    reasoning = next_prompt("reasoning", prompt, output, [300, 301, 302])  # 13 tokens
    again = list(range(100, 108))  # 8 tokens, all computed before: the last is computed anyway
    hits = ideal_hits([[(prompt, output), (prompt, output)], [(chat, []), (reasoning, []), (again, [])]], block_size=4)
    assert hits[0] == [0, 0]  # a batch is sent together: neither reuses the other
    assert hits[1] == [12, 8, 4]  # 15 shared -> 12; 10 shared -> 8; min(8, 8 - 1) -> 4


def test_ideal_of_a_conversation_is_its_reply_for_chat_and_its_prompt_for_reasoning() -> None:
    chats = messages("chat", 1, 3, 90, 40, seed=3)
    outputs = [[7] * 64, [8] * 64, [9] * 64]  # a reply never starts like the next message ([7]*..., random ids)
    for workload, expected in (("chat", [0, (90 + 63) // 32 * 32, (194 + 63) // 32 * 32]), ("reasoning", [0, 64, 128])):
        prompt, batches = chats[0][0], []
        for turn in range(3):
            batches.append([(prompt, outputs[turn])])
            if turn < 2:
                prompt = next_prompt(workload, prompt, outputs[turn], chats[0][turn + 1])
        # chat: the previous prompt and its reply less the last token (90 + 63, then 194 + 63);
        # reasoning: the previous prompt only (90, then 130).
        assert [h for (h,) in ideal_hits(batches, BLOCK_SIZE)] == expected


@pytest.mark.parametrize(("args", "message"), [
    (["--save-decode", "maybe"], "comma list of distinct values"),
    (["--workloads", "chat,chat"], "comma list of distinct values"),
    (["--turns", "1"], "x>=2"),
])
def test_bad_options_are_usage_errors_before_any_engine_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench.command, args)
    assert result.exit_code == 2 and message in result.output


def test_max_model_len_holds_the_last_chat_prompt_and_its_reply() -> None:
    sizes = dict(bench.SIZES)
    longest = sizes["first_tokens"] + (sizes["turns"] - 1) * (sizes["output_tokens"] + sizes["user_tokens"]) + sizes["output_tokens"]
    assert longest <= bench.max_model_len(sizes) < longest + BLOCK_SIZE and bench.max_model_len(sizes) % BLOCK_SIZE == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_run_with_save_decode_serves_what_an_ideal_cache_would() -> None:
    # One engine (save_decode true, the default): about 35 s on a loaded 2-core host;
    # both values would double it. Its chat rows reaching the ideal show the
    # reply's decode blocks stored and committed before the next turn, and the
    # ideal reachable (not an overestimate).
    result = CliRunner().invoke(bench.command, ["--quick", "--save-decode", "true", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {r["workload"]: r for r in report["rows"]}
    assert set(rows) == set(bench.WORKLOADS) and all(r["save_decode"] is True for r in rows.values())
    for row in rows.values():
        assert row["hit_tokens"] == row["vllm_cached_tokens"]  # vLLM's own cache emptied: every hit is ucm-db's
        assert row["prefilled_tokens"] == row["prompt_tokens"] - row["hit_tokens"] and row["stored_bytes"] > 0
        assert row["hit_tokens"] == row["ideal_hit_tokens"] > 0 and row["hit_share_of_ideal"] == 1.0
    conversations = report["sizes"]["conversations"]
    prompts = [turn["prompt_tokens"] // conversations for turn in rows["chat"]["per_turn"]]
    # In chat the hits reach past each previous prompt into its reply (what save_decode false gives up).
    assert rows["chat"]["hit_tokens"] > conversations * sum(p // BLOCK_SIZE * BLOCK_SIZE for p in prompts[:-1])
