"""The admission benchmark's workloads (tools/bench/admission.py): what it
measures must be what it says (no engine is started here)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ucm_db.tools.bench.admission import BS, TAIL_TOKENS, run_one, workloads  # noqa: E402


def test_the_workloads_are_what_they_claim() -> None:
    loads = workloads(prompt_tokens=4 * BS, prompts=5, prefixes=2, repeats=3, chats=2, turns=3, seed=1)
    unique = [tuple(t) for t, _ in loads["no-reuse"]]
    assert len(set(unique)) == 5 and all(len(t) == 4 * BS for t in unique)
    prefixes = [p for _, p in loads["prefix"]]
    assert sorted(prefixes) == ["p0"] * 3 + ["p1"] * 3
    heads = {p: t[: 4 * BS] for t, p in loads["prefix"]}
    assert all(t[: 4 * BS] == heads[p] and len(t) == 4 * BS + TAIL_TOKENS for t, p in loads["prefix"])
    chat0 = [t for t, _ in loads["conversation"][0::2]]
    assert [len(t) for t in chat0] == [TAIL_TOKENS, 3 * TAIL_TOKENS, 5 * TAIL_TOKENS]
    assert chat0[1][: len(chat0[0])] == chat0[0] and chat0[2][: len(chat0[1])] == chat0[1]  # each turn extends the last


def test_admit_after_2_writes_nothing_of_unique_prompts_and_keeps_repeated_prefixes() -> None:
    loads = workloads(prompt_tokens=4 * BS, prompts=4, prefixes=2, repeats=3, chats=1, turns=2, seed=2)
    once, twice = run_one(loads["no-reuse"], 1), run_one(loads["no-reuse"], 2)
    assert once["stored_bytes"] > 0 and twice["stored_bytes"] == 0
    kept1, kept2 = run_one(loads["prefix"], 1), run_one(loads["prefix"], 2)
    assert kept2["hits_after_second_sighting"] == kept1["hits_after_second_sighting"] > 0



def test_the_fleet_workload_carries_its_reuse_only_through_the_store() -> None:
    from ucm_db.tools.bench.admission import fleet_workload, run_fleet

    sent = fleet_workload(prompt_tokens=4 * BS, prompts=4, documents=3, seed=3)
    assert [e for _, e, _ in sent] == [0, 1, 0, 1, 0, 1, 1, 0, 0, 1]  # documents: computed on one engine, asked on the other
    assert [c for _, _, c in sent] == [False] * 4 + [False, True] * 3  # only the questions' hits are counted
    documents, questions = sent[4::2], sent[5::2]
    assert all(q[: 4 * BS] == d and len(q) == 4 * BS + TAIL_TOKENS for (d, _, _), (q, _, _) in zip(documents, questions))
    assert run_fleet(sent, 1)["hit_tokens"] == 3 * 4 * BS  # every document found stored by the engine asked
    assert run_fleet(sent, 2)["hit_tokens"] == 0  # no engine sees a document twice
