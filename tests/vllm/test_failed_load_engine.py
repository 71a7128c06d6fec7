"""A request aborted while its failed load's step runs leaves no stale KV,
on a real vLLM CPU engine (audit finding 1; the scheduler-level scenarios,
an abort and a preemption, are tests/connector/test_failed_load_leaves.py).

One engine (this process, vLLM's engine core and worker too: the test
reaches its scheduler), a tiny random float32 Llama (``initializer_range``
0.2, so its outputs depend on its KV), token-id prompts:

1. ``W`` (PROMPT, 56 tokens) computes PROMPT and stores its blocks; vLLM's
   own prefix cache is then emptied (``reset_prefix_cache``), and ``U`` (an
   unrelated prompt) leaves other KV in the freed blocks.
2. ``A`` (PROMPT) claims PROMPT's 5 blocks from the store; between the
   lookup and the load one unit of block 2 is deleted (another engine's
   eviction), so blocks 2-4 fail to load, and the client aborts ``A`` while
   that step runs (``EngineCore.step`` takes aborts between executing a step
   and processing its output, emulated by aborting at the start of
   ``update_from_output``).
3. ``D`` (PROMPT, 40 tokens): before the fix it took blocks 2-4, stale, from
   vLLM's prefix cache, gave other tokens than ``W``, and ucm-db stored what
   it computed over them; now it computes them again.
4. ``X`` (PROMPT and ``W``'s first 40 tokens, 16 more), vLLM's prefix cache
   emptied again: it loads from the store what ``D`` saved, and continues as ``W``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import BLOCK_SIZE, one_process_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_RNG = random.Random(31)
PROMPT = [_RNG.randrange(3, 1000) for _ in range(5 * BLOCK_SIZE + 3)]  # 5 whole blocks
OTHER = [_RNG.randrange(3, 1000) for _ in range(12 * BLOCK_SIZE)]


def _float32_model(out_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def _generate(llm: Any, req_id: str, prompt: list[int], max_tokens: int) -> list[int] | None:
    """Steps the engine until ``req_id`` ends; its tokens (None: aborted)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id.startswith(req_id) and out.outputs[0].finish_reason != "abort":
                tokens = list(out.outputs[0].token_ids)
    return tokens


def _settled(store: Any, before: int, timeout_s: float = 60) -> int:
    """Waits until the store grew past ``before`` blocks and stopped growing (the writer commits in the background)."""
    deadline, last, since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = store.stats().blocks
        if count != last:
            last, since = count, time.monotonic()
        elif count > before and time.monotonic() - since > 0.5:
            return count
        time.sleep(0.1)
    raise AssertionError(f"the store did not grow past {before} blocks")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ucm_db.keys.units import unit_key

    work = tmp_path_factory.mktemp("failed-load")
    spec = {"model": str(_float32_model(work / "llama_f32")), "dtype": "float32", "prefix_caching": True,
            "enforce_eager": True, "max_model_len": 1024, "connector": {"path": str(work / "store"), "codec": "none"}}
    out: dict[str, Any] = {}
    with one_process_engine(spec) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        ours = sched.connector._scheduler
        out["W"] = _generate(llm, "W", PROMPT, 56)
        _settled(ours.store, 0)
        assert llm.reset_prefix_cache()
        _generate(llm, "U", OTHER, 8)
        build, update, seen = sched.connector.build_connector_meta, sched.update_from_output, {}

        def build_then_evict(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            if meta.loads and "load" not in seen:
                seen["load"] = meta.loads[0]
                ours.store.delete(ours.namespace, [unit_key(meta.loads[0].keys[2], ours._spans[1], ours._grid)])
            return meta

        def abort_then_update(scheduler_output: Any, model_output: Any) -> Any:
            invalid = model_output.kv_connector_output and model_output.kv_connector_output.invalid_block_ids
            if invalid and "invalid" not in seen:
                seen["invalid"] = set(invalid)
                llm.llm_engine.abort_request(["A"])  # the client's abort, before vLLM takes the step's output
            return update(scheduler_output, model_output)
        sched.connector.build_connector_meta = build_then_evict
        sched.update_from_output = abort_then_update
        out["A"] = _generate(llm, "A", PROMPT, 40)
        sched.connector.build_connector_meta, sched.update_from_output = build, update
        pool = sched.kv_cache_manager.block_pool
        out["load"], out["invalid"] = seen["load"].block_ids, seen["invalid"]
        out["hashed"] = [pool.blocks[b].block_hash is not None for b in seen["load"].block_ids]
        blocks = ours.store.stats().blocks
        out["D"] = _generate(llm, "D", PROMPT, 40)
        _settled(ours.store, blocks)
        assert llm.reset_prefix_cache()
        out["X"] = _generate(llm, "X", PROMPT + out["W"][:40], 16)
    return out


def test_the_load_failed_and_its_request_was_aborted(scenario: dict[str, Any]) -> None:
    assert scenario["invalid"] == set(scenario["load"][2:]) and scenario["A"] is None


def test_the_failed_blocks_left_vllms_prefix_cache(scenario: dict[str, Any]) -> None:
    assert scenario["hashed"] == [True, True, False, False, False]  # before: all five


def test_the_next_request_of_the_prompt_computes_them_again(scenario: dict[str, Any]) -> None:
    assert scenario["D"] == scenario["W"][:40]


def test_what_it_stored_is_right(scenario: dict[str, Any]) -> None:
    assert scenario["X"] == scenario["W"][40:56]
