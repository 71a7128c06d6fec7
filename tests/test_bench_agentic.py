"""``ucm-db bench agentic``'s workload without an engine: the trace format
(round trip, clear errors per bad line), the seeded generator's sessions,
the token ids derived from hash ids, the ideal reuse, the replay's gate,
and the command's ``--no-run`` through ``CliRunner``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ucm_db.tools.bench import agentic_trace as at
from ucm_db.tools.bench.agentic import command
from ucm_db.tools.bench.serve_server import BLOCK_SIZE

SPEC = at.AgenticSpec()  # the command's defaults: 16 sessions x 8 turns to 8192 tokens
GOOD = {"session": "s1", "arrival_s": 0.5, "input_len": 1000, "output_len": 16, "hash_ids": [0, 1]}


@pytest.fixture(scope="module")
def generated() -> list[at.TraceRequest]:
    return at.generate(SPEC)


def _by_session(requests: list[at.TraceRequest]) -> dict[str, list[at.TraceRequest]]:
    out: dict[str, list[at.TraceRequest]] = {}
    for r in requests:
        out.setdefault(r.session, []).append(r)
    return out


def test_write_then_read_gives_the_same_requests(tmp_path: Path, generated: list[at.TraceRequest]) -> None:
    path = tmp_path / "trace.jsonl"
    at.write_trace(path, generated)
    assert len(path.read_text().splitlines()) == len(generated)
    assert at.read_trace(path, SPEC.block_tokens) == generated


def test_read_sorts_by_arrival_keeping_ties_in_file_order(tmp_path: Path) -> None:
    lines = [{**GOOD, "session": "b", "arrival_s": 2.0}, {**GOOD, "session": "a", "arrival_s": 1.0},
             {**GOOD, "session": "c", "arrival_s": 2.0}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")  # a blank line is skipped
    assert [r.session for r in at.read_trace(path)] == ["a", "b", "c"]


def test_sessions_grow_to_the_context_with_short_answers(generated: list[at.TraceRequest]) -> None:
    sessions = _by_session(generated)
    assert len(sessions) == SPEC.sessions and all(len(turns) == SPEC.turns for turns in sessions.values())
    for turns in sessions.values():
        assert turns[-1].input_len >= 8192
        lengths = [r.input_len for r in turns]
        assert lengths == sorted(set(lengths))  # grows every turn
        assert all(16 <= r.output_len <= 32 for r in turns)


def test_each_prompt_is_a_prefix_of_the_sessions_next(generated: list[at.TraceRequest]) -> None:
    for turns in _by_session(generated).values():
        for turn, after in zip(turns, turns[1:]):
            assert after.hash_ids[:len(turn.hash_ids)] == turn.hash_ids
            assert after.arrival_s - turn.arrival_s == pytest.approx(SPEC.gap_s)
    prompts = at.request_tokens(generated, SPEC.block_tokens, SPEC.seed)
    index = {id(r): i for i, r in enumerate(generated)}
    first, second = _by_session(generated)["s003"][:2]
    a, b = prompts[index[id(first)]], prompts[index[id(second)]]
    assert b[:len(a)] == a and len(b) == second.input_len


def test_more_sessions_than_the_capped_cache_holds(generated: list[at.TraceRequest]) -> None:
    capped = -(-5 * 4 * (at.longest_session_blocks(generated, BLOCK_SIZE) + 1) // 4)  # the command's default at concurrency 4
    assert at.sessions_held(generated, capped, BLOCK_SIZE) < SPEC.sessions
    assert at.working_set_blocks(generated, SPEC.block_tokens, BLOCK_SIZE) > 2 * capped


def test_every_session_shares_the_system_prompt(generated: list[at.TraceRequest]) -> None:
    shared = tuple(range(SPEC.shared_blocks))
    assert all(r.hash_ids[:len(shared)] == shared for r in generated)
    own = [set(r.hash_ids[len(shared):]) for r in (turns[-1] for turns in _by_session(generated).values())]
    assert all(not (a & b) for i, a in enumerate(own) for b in own[i + 1:])  # nothing else shared across sessions


def test_sessions_take_turns_in_arrival_order(generated: list[at.TraceRequest]) -> None:
    turn_of = {}
    order = []
    for r in generated:
        turn_of[r.session] = turn_of.get(r.session, -1) + 1
        order.append(turn_of[r.session])
    assert order == sorted(order)  # every session's turn k arrives before any session's turn k + 1


def test_same_seed_same_workload_other_seed_other() -> None:
    small = at.AgenticSpec(sessions=3, turns=3, context_tokens=2048, shared_tokens=0, seed=1)
    assert at.generate(small) == at.generate(small)
    other = at.generate(at.AgenticSpec(sessions=3, turns=3, context_tokens=2048, shared_tokens=0, seed=2))
    assert other != at.generate(small)
    assert at.request_tokens(at.generate(small), 512, 1) == at.request_tokens(at.generate(small), 512, 1)


def test_equal_hash_ids_give_equal_token_blocks() -> None:
    requests = [at.TraceRequest("a", 0.0, 96, 4, (5, 9, 7)), at.TraceRequest("b", 1.0, 80, 4, (5, 9, 8)),
                at.TraceRequest("c", 2.0, 40, 4, (6,))]
    a, b, c = at.request_tokens(requests, 32, seed=3)
    assert (len(a), len(b), len(c)) == (96, 80, 40)
    assert a[:64] == b[:64]  # hash ids 5, 9 shared
    assert a[64:80] != b[64:80]  # 7 against 8
    assert c[:32] != a[:32] and c[32:] != b[64:]  # 6 against 5; c's own tokens past its one id
    assert all(at._LOW_ID <= t < at.VOCAB_SIZE for t in a + b + c)
    assert at.hash_block(5, 32, seed=3).tolist() == a[:32]
    assert at.hash_block(5, 32, seed=4).tolist() != a[:32]


def test_reusable_tokens_follow_the_shared_hash_prefix() -> None:
    requests = [at.TraceRequest("a", 0.0, 1024, 4, (1, 2)), at.TraceRequest("a", 1.0, 1536, 4, (1, 2, 3)),
                at.TraceRequest("b", 2.0, 1000, 4, (1, 4)), at.TraceRequest("c", 3.0, 512, 4, (1,))]
    cold = at.reusable_tokens(requests, 512, BLOCK_SIZE, warm=False)
    assert cold == [0, 1024, 512, 480]  # the last one: never the prompt's last token's block
    warm = at.reusable_tokens(requests, 512, BLOCK_SIZE, warm=True)
    assert warm == [992, 1504, 992, 480]


@pytest.mark.parametrize(("line", "problem", "fix"), [
    ("{not json", "not JSON", "one JSON object per line"),
    ("[1, 2]", "a JSON list, not an object", "one JSON object per line"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing field 'hash_ids'", "add 'hash_ids'"),
    (json.dumps({**{k: v for k, v in GOOD.items() if k != "arrival_s"}, "timestamp": 5}), "missing field 'arrival_s'",
     "rename 'timestamp' to 'arrival_s'"),
    (json.dumps({**GOOD, "input_len": -5}), "input_len -5 is not an integer >= 1", "token count of at least 1"),
    (json.dumps({**GOOD, "output_len": 0}), "output_len 0", "at least 1"),
    (json.dumps({**GOOD, "output_len": 1.5}), "output_len 1.5", "at least 1"),
    (json.dumps({**GOOD, "arrival_s": -1}), "arrival_s -1", "seconds since the trace's start"),
    (json.dumps({**GOOD, "session": 3}), "session 3 is not a non-empty string", "as a string"),
    (json.dumps({**GOOD, "hash_ids": [0, -1]}), "hash_ids is not a list of integers >= 0", "block ids"),
    (json.dumps({**GOOD, "hash_ids": [0, 1, 2]}), "3 hash_ids for input_len 1000", "--hash-block-tokens"),
])
def test_a_bad_line_names_its_line_the_problem_and_the_fix(tmp_path: Path, line: str, problem: str, fix: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(at.TraceError) as caught:
        at.read_trace(path, 512)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and problem in message and fix in message and fix in caught.value.hint


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(at.TraceError, match="no requests"):
        at.read_trace(path)


def test_a_spec_too_short_for_its_turns_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise context_tokens"):
        at.AgenticSpec(turns=8, context_tokens=2048, shared_tokens=1024)


def test_the_gate_hands_a_freed_slot_to_the_earliest_arrival() -> None:
    from ucm_db.tools.bench.agentic_run import _Gate

    async def main() -> list[str]:
        gate, order = _Gate(1), []
        release = asyncio.Event()

        async def holder() -> None:
            async with gate.slot((0.0, 0)):
                await release.wait()

        async def waiter(name: str, key: tuple[float, int]) -> None:
            async with gate.slot(key):
                order.append(name)

        tasks = [asyncio.create_task(holder())]
        await asyncio.sleep(0)
        for name, key in (("late", (5.0, 1)), ("early", (1.0, 2))):  # "late" waits first
            tasks.append(asyncio.create_task(waiter(name, key)))
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["early", "late"]


def test_the_command_writes_the_trace_without_a_server(tmp_path: Path) -> None:
    out = tmp_path / "gen.jsonl"
    result = CliRunner().invoke(command, ["--no-run", "--write-trace", str(out), "--sessions", "4", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == 32 and summary["sessions"] == 4 and summary["longest_prompt_tokens"] >= 8192
    replayed = CliRunner().invoke(command, ["--no-run", "--trace", str(out), "--json"])
    assert replayed.exit_code == 0 and json.loads(replayed.stdout) == summary
    out.write_text(out.read_text() + '{"session": "x"}\n')
    bad = CliRunner().invoke(command, ["--no-run", "--trace", str(out)])
    assert bad.exit_code == 2 and f"{out}:33: missing field 'arrival_s'" in bad.output
