"""The restart benchmark's engine, run in a child process per start
(:mod:`.restart`, job ``restart_engine`` of :mod:`.engine_process`): time to
ready, a warm-up request, then the timed passes over the prompts."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from ucm_db.tools.bench.restart import (
    BLOCK_SIZE, CONNECTOR_MODULE, CONNECTOR_NAME, RESERVED_CPUS, TIMINGS_ENV, VOCAB, WARMUP_TOKENS,
)


def _engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"], max_num_seqs=2, seed=0, enable_prefix_caching=True,
        enforce_eager=spec["eager"],
    )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": spec["connector"],
        }
    return kwargs


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: time to ready, a warm-up request, then ``spec['passes']``
    over ``spec['prompts']`` (runs in the child)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(RESERVED_CPUS))
    if spec.get("timings_path"):
        os.environ[TIMINGS_ENV] = spec["timings_path"]  # read in vLLM's engine processes, which inherit it
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - started
    started, started_at = time.perf_counter(), time.time()
    llm = LLM(**_engine_kwargs(spec))
    out: dict[str, Any] = {"import_s": import_s, "init_s": time.perf_counter() - started, "init_started_at": started_at,
                           "ready_s": time.time() - spec["launched_at"], "passes": {}}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        warm = [random.Random(time.time_ns()).randrange(3, VOCAB) for _ in range(WARMUP_TOKENS)]
        out["warmup_ttft_s"] = _request(llm, params, warm)["ttft_s"]
        for name in spec["passes"]:
            out["passes"][name] = [_request(llm, params, ids) for ids in spec["prompts"]]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def _request(llm: Any, params: Any, ids: list[int]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    return {"ttft_s": time.perf_counter() - started, "cached": int(result.num_cached_tokens or 0),
            "first_token": result.outputs[0].token_ids[0]}
