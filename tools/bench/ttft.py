"""TTFT benchmark: recompute vs vLLM's prefix cache vs ucm-db vs ExampleConnector.

    ucm-db bench ttft [--prompts 4] [--tokens 2048] [--json]
    python -m ucm_db.tools.bench ttft ...     (the same, without the installed script)

The usual prefix-cache procedure: pre-seed with prompts of 0.8x the target
length (output length 1), then measure prompts of the full length that start
with those seeds. Five setups, each measured in this one run:

* ``recompute``      -- no connector, vLLM prefix caching off;
* ``cold_prefix_on`` -- no connector, prefix caching on, nothing seeded (a restarted engine);
* ``vllm_prefix``    -- vLLM's own prefix cache, warm (seed and measure in one engine);
* ``ucmdb_restart``  -- ucm-db: seed in one engine, measure in a NEW engine process;
* ``example_restart``-- vLLM's in-tree ExampleConnector, seeded and measured the same way.

TTFT is the wall time of one ``generate`` call with ``max_tokens=1`` (prefill
plus one token), one prompt at a time, after a warm-up request; the figure
reported is the median over prompts. The model is a random-weight Llama,
large enough that prefill dominates on a CPU.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import click

from ucm_db.tools.bench.cpu_dtype import fast_dtype
from ucm_db.tools.bench.engine_pass import build_model, demo_dir
from ucm_db.tools.bench.engine_process import run_in_new_process

BLOCK_SIZE = 32
SEED_FRACTION = 0.8
#: VLLM_CPU_NUM_OF_RESERVED_CPU of every engine (see run_engine).
RESERVED_CPUS = 1


@dataclass(frozen=True)
class TtftOptions:
    """Sizes of one TTFT run (the command's options)."""

    prompts: int = 4
    tokens: int = 2048
    layers: int = 8
    hidden: int = 768
    codec: str = "none"
    seed: int = 1


def _engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype") or fast_dtype().dtype, block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"], max_num_seqs=2, seed=0,
        enable_prefix_caching=spec["prefix_caching"],
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    return kwargs


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: optionally seed, optionally measure (runs in a child)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # The same CPU layout for every engine: vLLM-CPU otherwise gives the model
    # one more core whenever a KV connector is configured (2 threads instead
    # of 1 here), which made connector rows 2x faster than recompute for no
    # reason of their own (docs/vllm-cpu-connector-effect.md).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(RESERVED_CPUS))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**_engine_kwargs(spec))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"ttft_s": [], "cached": [], "first_tokens": []}
    try:
        for ids in spec.get("seed_prompts", []):
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        if spec.get("measure_prompts"):
            warm = [random.Random(time.time_ns()).randrange(3, 8000) for _ in range(64)]
            llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
        for ids in spec.get("measure_prompts", []):
            t0 = time.perf_counter()
            result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            out["ttft_s"].append(time.perf_counter() - t0)
            out["cached"].append(int(result.num_cached_tokens or 0))
            out["first_tokens"].append(result.outputs[0].token_ids[0])
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def _prompts(seed: int, count: int, tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    full = [[rng.randrange(3, 8000) for _ in range(tokens)] for _ in range(count)]
    seed_len = int(tokens * SEED_FRACTION)
    return [p[:seed_len] for p in full], full


def run(args: TtftOptions) -> dict[str, Any]:
    """Every setup in its own engine process(es); returns the summary report."""
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    model = str(build_model(base / f"bench-model-{args.layers}x{args.hidden}", layers=args.layers, hidden=args.hidden))
    seeds, full = _prompts(args.seed, args.prompts, args.tokens)
    common = {"model": model, "max_model_len": args.tokens + 64}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-db-ttft-") as tmp:
        work = Path(tmp)
        ucm = {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
               "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"path": str(work / "ucm-store"), "codec": args.codec}}
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}}
        plan = [
            ("recompute", [{**common, "prefix_caching": False, "measure_prompts": full}]),
            # Cold with prefix caching on: what a restarted engine without a
            # connector does (vLLM's scheduling differs with caching on/off).
            ("cold_prefix_on", [{**common, "prefix_caching": True, "measure_prompts": full}]),
            ("vllm_prefix", [{**common, "prefix_caching": True, "seed_prompts": seeds, "measure_prompts": full}]),
            ("ucmdb_restart", [{**common, "prefix_caching": True, "kv_transfer_config": ucm, "seed_prompts": seeds},
                               {**common, "prefix_caching": True, "kv_transfer_config": ucm, "measure_prompts": full}]),
            ("example_restart", [{**common, "prefix_caching": True, "kv_transfer_config": example, "seed_prompts": seeds},
                                 {**common, "prefix_caching": True, "kv_transfer_config": example, "measure_prompts": full}]),
        ]
        for name, engines in plan:
            print(f"  {name}: {len(engines)} engine(s) ...", file=sys.stderr, flush=True)
            for i, spec in enumerate(engines):
                outcome, _ = run_in_new_process("ttft_engine", spec, work, f"{name}{i}")
            results[name] = outcome
    return _summarise(results, args)


def _summarise(results: dict[str, Any], args: TtftOptions) -> dict[str, Any]:
    base_s = statistics.median(results["recompute"]["ttft_s"])
    rows = {}
    for name, outcome in results.items():
        median_s = statistics.median(outcome["ttft_s"])
        rows[name] = {
            "median_ttft_ms": 1e3 * median_s, "ratio_vs_recompute": median_s / base_s,
            "median_cached_tokens": statistics.median(outcome["cached"]),
            "same_first_tokens_as_recompute": outcome["first_tokens"] == results["recompute"]["first_tokens"],
            # vLLM's warm prefix cache runs the same arithmetic as a load
            # (stored prefix KV + prefill of the rest): a loader that restores
            # the exact KV bytes gives its tokens even where the random-weight
            # model's near-flat logits make a full recompute differ.
            "same_first_tokens_as_vllm_prefix": outcome["first_tokens"] == results["vllm_prefix"]["first_tokens"],
            "first_tokens": outcome["first_tokens"],
            "ttft_ms": [round(1e3 * t, 1) for t in outcome["ttft_s"]],
        }
    return {"prompts": args.prompts, "prompt_tokens": args.tokens, "seed_tokens": int(args.tokens * SEED_FRACTION),
            "model": f"llama {args.layers} layers x {args.hidden} hidden, bf16, random weights", "codec": args.codec,
            "block_size": BLOCK_SIZE, "setups": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"TTFT, {report['prompts']} prompts of {report['prompt_tokens']} tokens, seeded with {report['seed_tokens']}"
          f" ({report['model']}, block {report['block_size']}, ucm-db codec {report['codec']})")
    print(f"{'setup':<16} {'median TTFT ms':>15} {'x recompute':>12} {'cached tok':>11} {'= recompute':>12} {'= vllm_prefix':>14}")
    for name, row in report["setups"].items():
        print(f"{name:<16} {row['median_ttft_ms']:>15.1f} {row['ratio_vs_recompute']:>12.3f}"
              f" {row['median_cached_tokens']:>11.0f} {str(row['same_first_tokens_as_recompute']):>12}"
              f" {str(row['same_first_tokens_as_vllm_prefix']):>14}")


@click.command("ttft", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True, help="prompts per setup")
@click.option("--tokens", type=click.IntRange(min=64), default=2048, show_default=True, help="full prompt length")
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True, help="layers of the random-weight Llama")
@click.option("--hidden", type=click.IntRange(min=64), default=768, show_default=True, help="hidden size of the model")
@click.option("--codec", type=click.Choice(["none", "zstd"]), default="none", show_default=True, help="ucm-db's codec")
@click.option("--seed", type=int, default=1, show_default=True, help="prompt seed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def command(as_json: bool, **sizes: Any) -> None:
    """TTFT: recompute, vLLM's prefix cache, ucm-db and ExampleConnector after a restart (real vLLM engines on CPU).

    \b
    Example:
        ucm-db bench ttft --prompts 4 --tokens 2048
    """
    report = run(TtftOptions(**sizes))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
