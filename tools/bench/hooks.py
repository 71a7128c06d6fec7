"""``ucm-db bench hooks``: what each vLLM connector hook costs a step.

The no-reuse tax at concurrency 1 is paid on every decode step, where a
small model's step takes a few milliseconds. This benchmark runs one real
vLLM-CPU engine per setup (``off``, ``noop``: vLLM's connector plumbing
alone, ``ucm``: ucm-db with codec none) on unique prompts sent one at a
time, with every hook timed (:mod:`.timed_connector`), and prints per
setup the wall time of a step and, per hook, its calls and microseconds a
step, in the engine core (scheduler half) and the worker (model thread).

Invariants:
    * Each setup runs in its own fresh process (:mod:`.engine_process`)
      with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` in every setup (vLLM-CPU
      otherwise gives the model another core when a connector is set).
    * The wall time of a step is the timed requests' time over
      ``--output-len`` steps a request (one prefill, then a decode step per
      token after the first), the same count in every setup; a hook's
      microseconds a step are its total over the engine's
      ``build_connector_meta`` calls (the warm-up request's steps included).
    * Every request is answered with exactly ``--output-len`` tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench import thread_trace

SETUPS = ("off", "noop", "ucm")
CONNECTORS = {"noop": "TimedNoopConnector", "ucm": "TimedUcmDbConnector"}


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One setup's engine: prompts one at a time; the hooks' totals. Runs in the child."""
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    times_dir = Path(spec["work"]) / f"hooks-{spec['setup']}"
    times_dir.mkdir(parents=True, exist_ok=True)
    os.environ["UCM_DB_HOOK_TIMES_DIR"] = str(times_dir)  # read by the engine's processes (timed_connector.py)
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm_db.tools.bench.serve_server import BLOCK_SIZE

    kwargs: dict[str, Any] = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], block_size=BLOCK_SIZE,
                                  max_model_len=spec["prompt_len"] + spec["output_len"] + BLOCK_SIZE, max_num_seqs=8, seed=0,
                                  enforce_eager=True, num_gpu_blocks_override=spec["kv_blocks"])
    if spec["setup"] != "off":
        extra = {"path": spec["store"], "capacity_bytes": 16 << 30, "codec": "none"} if spec["setup"] == "ucm" else {}
        kwargs["kv_transfer_config"] = {"kv_connector": CONNECTORS[spec["setup"]], "kv_role": "kv_both",
                                        "kv_connector_module_path": "ucm_db.tools.bench.timed_connector",
                                        "kv_connector_extra_config": extra}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(spec["seed"])
    prompts = [rng.integers(4, 8000, size=spec["prompt_len"]).tolist() for _ in range(spec["num_prompts"] + 1)]
    request_s = []
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up, not counted
        pids = thread_trace.process_group(os.getpgid(0))
        threads_before, started_all = thread_trace.snapshot(pids), time.perf_counter()
        for ids in prompts[1:]:
            started = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            request_s.append(time.perf_counter() - started)
            if len(out.outputs[0].token_ids) != spec["output_len"]:
                raise RuntimeError(f"{len(out.outputs[0].token_ids)} of {spec['output_len']} tokens")
        threads = thread_trace.diff(threads_before, thread_trace.snapshot(pids), time.perf_counter() - started_all, by_thread=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    time.sleep(1.0)  # the workers' shutdown writes their totals
    processes = [json.loads(p.read_text()) for p in sorted(times_dir.glob("hooks-*.json"))]
    return {"request_s": request_s, "processes": processes, "threads": threads}


def summarize(result: dict[str, Any], num_prompts: int, output_len: int) -> dict[str, Any]:
    """Per setup: wall ms a step and, per hook, calls and us a step (the
    warm-up request's calls included in the totals, so a step here is
    every step the engine ran)."""
    steps_timed = num_prompts * output_len  # one prefill + output_len - 1 decode steps a prompt: output_len steps
    wall_step_ms = sum(result["request_s"]) / steps_timed * 1e3
    hooks: dict[str, dict[str, float]] = {}
    steps_all = 0
    max_blocks = 0
    for proc in result["processes"]:
        steps_all = max(steps_all, proc["meta"]["steps"])
        max_blocks = max(max_blocks, proc["meta"]["max_blocks"])
    for proc in result["processes"]:
        role = "scheduler" if proc["meta"]["steps"] else "worker"
        for name, entry in proc["hooks"].items():
            if entry["calls"]:
                hooks[f"{role}.{name}"] = {"calls_per_step": round(entry["calls"] / max(steps_all, 1), 2),
                                           "us_per_step": round(entry["s"] / max(steps_all, 1) * 1e6, 1)}
    by_role = {role: round(sum(h["us_per_step"] for k, h in hooks.items() if k.startswith(role + ".")), 1)
               for role in ("scheduler", "worker")}
    return {"wall_ms_per_step": round(wall_step_ms, 3), "request_s_median": round(statistics.median(result["request_s"]), 4),
            "steps_counted": steps_all, "max_blocks_a_step": max_blocks, "hooks_us_per_step": by_role, "hooks": hooks}


@click.command("hooks")
@click.option("--num-prompts", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=16), default=2048, show_default=True)
@click.option("--output-len", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--hidden", type=click.IntRange(min=64), default=256, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True, help="every setup once a round, in turns")
@click.option("--setups", default=",".join(SETUPS), show_default=True, help="comma-separated: off, noop, ucm")
@click.option("--json", "as_json", is_flag=True)
def command(num_prompts: int, prompt_len: int, output_len: int, layers: int, hidden: int, rounds: int, setups: str,
            as_json: bool) -> None:
    """Per-step cost of each connector hook in a real engine, c1, unique prompts.

    Example:

        ucm-db bench hooks --rounds 3 --num-prompts 12
    """
    from ucm_db.tools.bench.cpu_dtype import fast_dtype
    from ucm_db.tools.bench.engine_process import run_in_new_process
    from ucm_db.tools.bench.serve_model import build_serve_model

    chosen = [s.strip() for s in setups.split(",") if s.strip()]
    if not chosen or any(s not in SETUPS for s in chosen):
        raise click.BadParameter(f"{setups!r}: setups are {', '.join(SETUPS)}", param_hint="--setups")
    model = build_serve_model(layers, hidden=hidden)
    dtype = fast_dtype().dtype
    report: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-hooks-") as tmp:
        work = Path(tmp)
        for r in range(rounds):
            for setup in chosen if r % 2 == 0 else list(reversed(chosen)):
                spec = {"setup": setup, "model": str(model), "dtype": dtype, "prompt_len": prompt_len, "output_len": output_len,
                        "num_prompts": num_prompts, "seed": 1000 * r + SETUPS.index(setup), "work": str(work),
                        "store": str(work / f"store-{setup}-{r}"), "kv_blocks": 320}
                result, _log = run_in_new_process("hooks_engine", spec, work, f"{setup}-{r}",
                                                  progress=lambda line: click.echo(line, err=True))
                summary = summarize(result, num_prompts, output_len)
                report[setup].append(summary)
                click.echo(f"round {r + 1} {setup}: {summary['wall_ms_per_step']:.3f} ms a step, hooks "
                           f"{summary['hooks_us_per_step']} us a step", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"c1, {num_prompts} unique prompts of {prompt_len} tokens, {output_len} out; {layers} x {hidden} {dtype}")
    for setup, runs in report.items():
        walls = ", ".join(f"{s['wall_ms_per_step']:.3f}" for s in runs)
        click.echo(f"\n{setup}: wall ms a step {walls}")
        for name in sorted({k for s in runs for k in s["hooks"]}):
            per = [s["hooks"].get(name, {"us_per_step": 0.0, "calls_per_step": 0.0}) for s in runs]
            click.echo(f"  {name:<45} {per[0]['calls_per_step']:>6.2f} calls  "
                       + ", ".join(f"{p['us_per_step']:8.1f}" for p in per) + " us a step")
