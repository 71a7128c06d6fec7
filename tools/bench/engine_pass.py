"""One engine pass for the demo and the overhead benchmark: a random-weight
Llama on vLLM (CPU), prompts sent one by one, TTFT and first tokens recorded.

Invariants:
    * The model is built locally (``transformers`` + ``save_pretrained``),
      never downloaded, and reused from ``demo_dir()`` once written whole
      (written to a temp directory and renamed).
    * A pass runs in its own process (:mod:`ucm_db.tools.bench.engine_process`):
      a new engine has an empty vLLM prefix cache, which is what "after a
      restart" means.
    * ``spec["reserved_cpus"]`` pins ``VLLM_CPU_NUM_OF_RESERVED_CPU``: with
      a KV connector vLLM-CPU otherwise hands the model a different number of
      cores than without one (docs/vllm-cpu-connector-effect.md), and a
      comparison would measure that instead of the connector.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_db.tools.bench.cpu_dtype import fast_dtype
from ucm_db.tools.bench.engine_process import run_in_new_process

BLOCK_SIZE = 32
#: Log-probabilities kept per prompt (the demo's near-tie check reads them).
TOP_LOGPROBS = 5
_HIT_LINE = re.compile(r"ucm-db: request (\S+): (\d+) prompt tokens, (\d+) from vLLM's prefix cache, (\d+) hit tokens")


def demo_dir() -> Path:
    """Where built models are cached: ``$UCM_DB_DEMO_DIR`` or ``~/.cache/ucm-db-demo``."""
    return Path(os.environ.get("UCM_DB_DEMO_DIR") or Path.home() / ".cache" / "ucm-db-demo")


def build_model(out_dir: Path, *, layers: int = 6, hidden: int = 768, seed: int = 0) -> Path:
    """A random-weight Llama (bf16) in ``out_dir``; reused if present."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64, vocab_size=8000,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent if out_dir.parent.exists() else None))
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-written model is never reused
    return out_dir


def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """Starts one engine, sends ``spec['prompts']`` one by one (max_tokens=1). Runs in the child.
    ``spec['dtype']``: the model dtype (default: the one this CPU runs fast, :mod:`cpu_dtype`)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if spec.get("reserved_cpus") is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(spec["reserved_cpus"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype") or fast_dtype().dtype, block_size=BLOCK_SIZE,
        max_model_len=spec.get("max_model_len", 4096), max_num_seqs=4, seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True),
    )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    ttft_s, cached, first_tokens, top_logprobs = [], [], [], []
    try:
        warm = [random.Random(time.time_ns()).randrange(3, 8000) for _ in range(64)]
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)  # first-request overheads
        for ids in spec["prompts"]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            ttft_s.append(time.perf_counter() - t0)
            cached.append(int(out.num_cached_tokens or 0))
            first_tokens.append(out.outputs[0].token_ids[0])
            top = (out.outputs[0].logprobs or [{}])[0]
            top_logprobs.append({str(token): float(entry.logprob) for token, entry in top.items()})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"engine_start_s": start_s, "ttft_s": ttft_s, "cached": cached, "first_tokens": first_tokens,
            "top_logprobs": top_logprobs}


def run_pass_in_new_process(spec: dict[str, Any], work: Path, name: str, *,
                            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`run_pass` in a fresh Python process; ucm-db's hit lines parsed from its log.

    ``result["ucm_hits"]`` holds ``(vLLM cached tokens, ucm-db hit tokens)``
    per prompt, or is empty when the engine ran without ucm-db.
    """
    result, text = run_in_new_process("engine_pass", spec, work, name, progress=progress)
    result["ucm_hits"] = [(int(m[2]), int(m[3])) for m in _HIT_LINE.findall(text)][1:]  # [0] is the warm-up
    return result
