"""``reset_prefix_cache(reset_connector=True)`` on a real vLLM CPU engine:
the model's namespace epoch moves on in the store, so no engine serves the
KV stored before it (this one, a second one on the same store, a restarted
one), and what is computed again is stored again and served; what the
engine that reset computes afterwards (its weights may have been updated
in place) is served to it alone.

One scenario for the module (engine starts dominate the cost):

1. ``first`` (this process, vLLM's engine core and worker too): prompts
   Q1, Q2, Q3 stored; Q1 hits; reset; Q1 again: 0 hit tokens, stored again;
   Q1 once more: hits.
2. ``second`` (new process, ``first`` still up, same store): Q2: 0 hit
   tokens (stored before the reset), stored again.
3. ``restarted`` (new process after ``first`` shut down): Q3 (never stored
   again): 0 hit tokens; Q1 (stored again by ``first`` after its reset): 0,
   stored again; Q2 (stored again by ``second``): hit.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import ucm_db

from e2e_helpers import BLOCK_SIZE, StoreCounter, one_process_engine, start_engine_process, wait_for_new_blocks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 4
PROMPT_TOKENS = 200
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the prompt's last token's


def _prompts() -> dict[str, dict[str, Any]]:
    rng = random.Random(27)
    return {name: {"ids": [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]} for name in ("q1", "q2", "q3")}


def _spec(model: Path, store: Path, names: list[str]) -> dict[str, Any]:
    prompts = _prompts()
    return {"model": str(model), "prefix_caching": False, "max_tokens": MAX_TOKENS, "enforce_eager": True,
            "connector": {"path": str(store)}, "prompts": [prompts[n] for n in names]}


@pytest.fixture(scope="module")
def scenario(tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model, _ = tiny_models
    work = tmp_path_factory.mktemp("reset")
    store = work / "store"
    prompts = _prompts()
    first: dict[str, Any] = {}
    with StoreCounter() as count_blocks, one_process_engine(_spec(model, store, [])) as llm:
        import engine_job  # imported by in_process_engine

        def run(name: str) -> tuple[int, list[int]]:
            result = engine_job.run_prompts(llm, [prompts[name]], MAX_TOKENS)
            return result["cached"][0], result["outputs"][0]

        blocks = 0
        for name in ("q1", "q2", "q3"):
            first[f"{name}_stored"] = run(name)
            blocks = wait_for_new_blocks(store, blocks, count_blocks=count_blocks)
        first["q1_before_reset"] = run("q1")
        first["reset"] = llm.reset_prefix_cache(reset_connector=True)
        first["q1_after_reset"] = run("q1")
        blocks = wait_for_new_blocks(store, blocks, count_blocks=count_blocks)
        first["q1_stored_again"] = run("q1")
        second = start_engine_process(_spec(model, store, ["q2"]), work, "second").wait()
    restarted = start_engine_process(_spec(model, store, ["q3", "q1", "q2"]), work, "restarted").wait()
    with ucm_db.open(store) as opened:
        (description,) = opened._tier.namespace_descriptions().values()
        epoch = opened.epoch(ucm_db.Namespace.from_dict(description))
        blocks_after = opened.stats().blocks
    return {"first": first, "second": second, "restarted": restarted, "epoch": epoch, "blocks": blocks_after}


def test_reset_reaches_the_store_and_hits_stop_in_this_engine(scenario: dict[str, Any]) -> None:
    first = scenario["first"]
    assert first["reset"] is True and scenario["epoch"] == 1
    assert first["q1_stored"][0] == 0 and first["q1_before_reset"][0] == HIT_TOKENS
    assert first["q1_after_reset"][0] == 0  # 0 stale hits in the engine that reset
    assert first["q1_stored_again"][0] == HIT_TOKENS  # computed again, stored again, served


def test_a_second_engine_on_the_store_serves_no_old_kv(scenario: dict[str, Any]) -> None:
    assert scenario["second"]["cached"] == [0]


def test_a_restarted_engine_serves_only_what_engines_on_the_files_stored_after_the_reset(scenario: dict[str, Any]) -> None:
    restarted, first = scenario["restarted"], scenario["first"]
    # Q1 was stored again by the engine that reset, keyed apart: it may have run updated weights.
    assert restarted["cached"] == [0, 0, HIT_TOKENS]
    # Same weights throughout: whatever was loaded gives the outputs computed before.
    assert restarted["outputs"] == [first["q3_stored"][1], first["q1_stored"][1], scenario["second"]["outputs"][0]]
    assert first["q1_after_reset"][1] == first["q1_stored"][1] == first["q1_stored_again"][1]


def test_old_blocks_are_not_deleted_by_the_reset(scenario: dict[str, Any]) -> None:
    # Each storing of a prompt: its 6 full blocks (203 tokens computed) x 2 KV heads (units). Stored: Q1, Q2, Q3
    # before the reset, then again Q1 (first, keyed apart), Q2 (second), Q3 and Q1 (restarted): the old ones are all
    # still there, never served; LRU eviction collects them.
    units_per_prompt = (PROMPT_TOKENS + MAX_TOKENS - 1) // BLOCK_SIZE * 2
    assert scenario["blocks"] == 7 * units_per_prompt
