"""Runs one vLLM CPU engine for the e2e tests, in its own process.

    python engine_job.py SPEC.json RESULT.json

SPEC: {"model": dir, "connector": {extra config} | null, "prefix_caching": bool,
       "prompts": [{"ids": [...], "cache_salt": str | null}], "max_tokens": int,
       "dtype": str, "block_size": int, "tp": int, "env": {name: value},
       "enforce_eager": bool, "engine_kwargs": {more LLM(...) arguments},
       "processes": "one" (default) | "vllm"}
("env" is set before the engine starts, e.g. the TP=2 CPU thread binding; the
 tests run this script as a fork of a server that imported vLLM already
 (engine_forkserver.py) unless "env" names a variable other than VLLM_*.
"enforce_eager" skips torch.compile: about 20 s less per engine start here;
the connector's own e2e module keeps vLLM's default, compiled.)
("processes": "one" runs vLLM's engine core, and at TP=1 its worker, inside
 this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the connector's scheduler and
 worker halves still both run. Each process of its own costs a whole import of
 vLLM: on a 2-core AVX2 host an engine start takes 25 s this way against 64 s
 in vLLM's own layout ("vllm": engine core and worker each in a process of
 their own), which test_connector_e2e runs and checks.)
("logprobs": N adds each output token's top-N log-probabilities.)
("wait_for_saves": true, with "processes": "one": before each prompt but the first, waits until the store
 (the connector's own, shared in this process) holds more blocks than before the previous prompt and has not
 changed for a moment, so a prompt may hit what the one before it saved.)
("kv_events": {"pub_port": int, "replay_port": int, "settle_store": dir} turns on vLLM's ZMQ
 KV events publisher; a subscriber in this process collects every batch (the replay endpoint
 fills what it missed) after the store at "settle_store" stopped growing and a few more requests
 were driven (vLLM publishes inside steps): RESULT gets "kv_events", each
 {"type", "medium", "group_idx", "block_hashes"}.)
RESULT: {"outputs": [[token ids]], "cached": [num_cached_tokens], "engine_start_s": float,
         "num_kv_blocks": vLLM's KV cache blocks, "logprobs": [[{token id: logprob}]] (with "logprobs")}
Each prompt is sent alone (one generate call each) so that a prompt's saves
can serve the next one.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_engine(spec: dict):
    from vllm import LLM

    kwargs = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
        block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=8, enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
        tensor_parallel_size=spec.get("tp", 1), enforce_eager=spec.get("enforce_eager", False),
    )
    kwargs.update(spec.get("engine_kwargs", {}))
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    return LLM(**kwargs)


def _tokens_prompt(prompt: dict):
    from vllm.inputs import TokensPrompt

    tp = TokensPrompt(prompt_token_ids=prompt["ids"])
    if prompt.get("cache_salt"):
        tp["cache_salt"] = prompt["cache_salt"]
    return tp


def run_prompts(llm, prompts: list[dict], max_tokens: int, between=None, batch: bool = False, logprobs: int | None = None) -> dict:
    """Runs ``prompts`` one by one, or with ``batch`` all in one generate call
    (its one latency is the batch's)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    if batch:
        started = time.perf_counter()
        outs = llm.generate([_tokens_prompt(p) for p in prompts], params, use_tqdm=False)
        return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "cached": [int(o.num_cached_tokens or 0) for o in outs],
                "latency_s": [time.perf_counter() - started]}
    outputs, cached, latency, tops = [], [], [], []
    for i, prompt in enumerate(prompts):
        if between is not None:
            between(i)
        started = time.perf_counter()
        out = llm.generate([_tokens_prompt(prompt)], params, use_tqdm=False)[0]
        latency.append(time.perf_counter() - started)
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(int(out.num_cached_tokens or 0))
        tops.append([{str(t): float(lp.logprob) for t, lp in step.items()} for step in out.outputs[0].logprobs or []])
    result = {"outputs": outputs, "cached": cached, "latency_s": latency}
    return {**result, "logprobs": tops} if logprobs else result


def _saves_settled(spec: dict):
    """``run_prompts``'s ``between``: waits for the previous prompt's saves (see "wait_for_saves")."""
    from e2e_helpers import wait_for_new_blocks  # tests/vllm, beside this script
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.stores import acquire

    store = acquire(ConnectorSettings.from_extra_config(spec["connector"]))  # the connector's, shared in this process
    before = [0]

    def between(index: int) -> None:
        if index:
            before[0] = wait_for_new_blocks(store.path, before[0], settle_s=0.3, count_blocks=lambda _: store.stats().blocks)
        else:
            before[0] = store.stats().blocks

    between.store = store  # released after the prompts
    return between


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    processes = spec.get("processes", "one")
    if processes not in ("one", "vllm"):
        raise ValueError(f'spec "processes" is {processes!r}: give "one" or "vllm"')
    if processes == "one":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(spec.get("env", {}))
    events = spec.get("kv_events")
    subscriber = None
    if events is not None:
        from kv_events_job import EventSubscriber, events_config  # tests/vllm, beside this script

        subscriber = EventSubscriber(events["pub_port"])
        spec.setdefault("engine_kwargs", {})["kv_events_config"] = events_config(events["pub_port"], events["replay_port"])
    started = time.perf_counter()
    llm = make_engine(spec)
    start_s = time.perf_counter() - started
    try:
        between = _saves_settled(spec) if spec.get("wait_for_saves") else None
        result = run_prompts(llm, spec["prompts"], spec.get("max_tokens", 8), between=between, batch=spec.get("batch", False),
                             logprobs=spec.get("logprobs"))
        if between is not None:
            from ucm_db.connector.stores import release

            release(between.store)
        result["num_kv_blocks"] = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0)
        if subscriber is not None:
            result["kv_events"] = subscriber.collect(lambda ids: run_prompts(llm, [{"ids": ids}], 2), events)
    finally:
        llm.llm_engine.engine_core.shutdown()
    result["engine_start_s"] = start_s
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
