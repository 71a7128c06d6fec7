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
5. A sharer of a failed load whose loader recomputes in chunks
   (connector/scheduler/stale_blocks.py): ``L`` (PROMPT) claims its 5 stored
   blocks and ``S`` (PROMPT's first 3 blocks, then 20 tokens of its own),
   added with it, takes them from vLLM's prefix cache in the same step; one
   unit of block 1 is deleted between the lookup and the load. vLLM rewinds
   ``L`` to block 1 and lets ``S`` keep blocks 1-2, and ``L`` writes half a
   block a step (``long_prefill_token_threshold`` 16): ``S`` would compute
   over the stale blocks. Its tokens equal those of the same prompt computed
   whole (``S_ref``, another cache salt), and what it stored is right (``Y``).
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


def _generate(llm: Any, req_id: str, prompt: list[int], max_tokens: int, salt: str | None = None) -> list[int] | None:
    """Steps the engine until ``req_id`` ends; its tokens (None: aborted)."""
    return _generate_together(llm, {req_id: (prompt, max_tokens, salt)})[req_id]


def _generate_together(llm: Any, requests: dict[str, tuple[list[int], int, str | None]]) -> dict[str, list[int] | None]:
    """Adds every request (id -> prompt, max tokens, cache salt), then steps
    the engine until all end; their tokens (None: aborted). Ids are no
    prefix of one another."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    for req_id, (prompt, max_tokens, salt) in requests.items():
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt, **({"cache_salt": salt} if salt else {})),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int] | None] = dict.fromkeys(requests)
    while engine.has_unfinished_requests():
        for out in engine.step():
            req_id = next((r for r in requests if out.request_id.startswith(r)), None)
            if out.finished and req_id is not None and out.outputs[0].finish_reason != "abort":
                tokens[req_id] = list(out.outputs[0].token_ids)
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
        out.update(_shared_failed_load(llm, sched, ours))
    return out


SHARER = PROMPT[:3 * BLOCK_SIZE] + OTHER[:20]


def _shared_failed_load(llm: Any, sched: Any, ours: Any) -> dict[str, Any]:
    """Step 5 of the module's scenario."""
    from ucm_db.keys.units import unit_key

    out: dict[str, Any] = {"S_ref": _generate(llm, "Sref", SHARER, 16, salt="computed whole")}
    assert llm.reset_prefix_cache()
    _generate(llm, "U2", OTHER, 8)  # other KV in the freed blocks
    build, seen = sched.connector.build_connector_meta, {"stale_reads": []}

    def build_then_evict(scheduler_output: Any) -> Any:
        meta = build(scheduler_output)
        if meta.loads and "load" not in seen:
            seen["load"], seen["first_step"] = meta.loads[0], {r.split("-")[0] for r in scheduler_output.num_scheduled_tokens}
            ours.store.delete(ours.namespace, [unit_key(meta.loads[0].keys[1], ours._spans[0], ours._grid)])
        seen["stale_reads"] += [meta.stale_reads] if meta.stale_reads else []
        return meta
    sched.connector.build_connector_meta = build_then_evict
    sched.scheduler_config.long_prefill_token_threshold = BLOCK_SIZE // 2
    blocks = ours.store.stats().blocks
    try:
        outputs = _generate_together(llm, {"L": (PROMPT, 16, None), "S": (SHARER, 16, None)})
    finally:
        sched.connector.build_connector_meta = build
        sched.scheduler_config.long_prefill_token_threshold = 0
    out.update(outputs, first_step=seen["first_step"], stale_reads=seen["stale_reads"])
    _settled(ours.store, blocks)  # S's block 3, filled as it decoded
    assert llm.reset_prefix_cache()
    out["Y"] = _generate(llm, "Y", SHARER + out["S"][:14], 2)  # S's block 3 (128 tokens) from the store
    return out


def test_the_load_failed_and_its_request_was_aborted(scenario: dict[str, Any]) -> None:
    assert scenario["invalid"] == set(scenario["load"][2:]) and scenario["A"] is None


def test_the_failed_blocks_left_vllms_prefix_cache(scenario: dict[str, Any]) -> None:
    assert scenario["hashed"] == [True, True, False, False, False]  # before: all five


def test_the_next_request_of_the_prompt_computes_them_again(scenario: dict[str, Any]) -> None:
    assert scenario["D"] == scenario["W"][:40]


def test_what_it_stored_is_right(scenario: dict[str, Any]) -> None:
    assert scenario["X"] == scenario["W"][40:56]


def test_a_sharer_of_a_failed_load_recomputed_in_chunks_reads_no_stale_kv(scenario: dict[str, Any]) -> None:
    assert scenario["first_step"] == {"L", "S"}, "L and S were admitted in one step"
    assert scenario["S"] == scenario["S_ref"]
    assert scenario["L"] == scenario["W"][:16]
    assert scenario["stale_reads"], "S was found reading the stale blocks: the scenario happened"


def test_what_the_sharer_stored_is_right(scenario: dict[str, Any]) -> None:
    assert scenario["Y"] == scenario["S_ref"][14:16]
