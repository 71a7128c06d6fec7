"""Remote lookups inline or in the background over a link with round trips: ``ucm-db bench remote-lookup``.

    ucm-db bench remote-lookup [--latency-ms 20] [--bandwidth-mb-s 400] [--rounds 4] [--json]

Each round submits one batch to a real vLLM engine on CPU: ``--hits``
prompts whose blocks are on a ``throttled://`` remote (:mod:`.throttle`, a
local directory behind one link with ``--latency-ms`` per request) and
not in the local tier, interleaved with as many prompts the remote lacks.
The figure is the batch's wall time (median over ``--rounds`` batches of
new prompts) for each configuration: the connector's ``remote_lookup``
(``inline``: the scheduler fetches a hit before answering vLLM, and every
running request waits; ``background``: lookups run on connector threads
while vLLM schedules the rest) and the store's ``remote_read_concurrency``.
Every configuration loads the same tokens (``load_policy: "always"``); the
report checks it.

Every engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in a
new process, so the ``throttled://`` file system registered in the job
serves the connector.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.cost import BLOCK_SIZE, fill_remote
from ucm_db.tools.bench.engine_pass import build_model, demo_dir
from ucm_db.tools.bench.engine_process import run_in_new_process

#: (remote_lookup, remote_read_concurrency) of each measured engine, in order.
CONFIGS = (("inline", 16), ("background", 16), ("inline", 64), ("background", 64))
WARM_TOKENS = 1024
MAX_NUM_SEQS = 8


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: fill the remote if asked, warm up, time each batch (a child)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm_db.tools.bench.throttle import register

    register()
    link = {"path": spec["remote_dir"], "bandwidth_bytes_per_s": spec["bandwidth_bytes_per_s"], "latency_s": spec["latency_s"]}
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=spec["max_model_len"],
        max_num_seqs=MAX_NUM_SEQS, seed=0, enable_prefix_caching=True,
        kv_transfer_config={
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "path": spec["store"], "codec": "none", "load_policy": "always", "remote": "throttled://kv",
                "remote_options": link, "remote_deadline_s": 60.0, "remote_lookup": spec["remote_lookup"],
                "remote_read_concurrency": spec["remote_read_concurrency"],
            },
        },
    )
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"wall_s": [], "cached_tokens": []}
    try:
        if spec["fill"]:
            fill = {"remote": "throttled://kv", "remote_options": {**link, "bandwidth_bytes_per_s": 1e12, "latency_s": 0.0}}
            out["filled_blocks"] = fill_remote(llm, fill, Path(spec["fill_store"]), [spec["probe"], *(p for b in spec["batches"] for p in b["hits"])])
        for ids in [*spec["unstored"], spec["probe"]]:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        for batch in spec["batches"]:
            prompts = [p for pair in zip(batch["hits"], batch["misses"]) for p in pair]
            started = time.perf_counter()
            results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
            out["wall_s"].append(time.perf_counter() - started)
            out["cached_tokens"].append(sum(int(r.num_cached_tokens or 0) for r in results))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def run(latency_ms: float, bandwidth_mb_s: float, hits: int, prompt_tokens: int, rounds: int, output_len: int,
        layers: int, seed: int) -> dict[str, Any]:
    """Every configuration in its own process; returns the report."""
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    model = build_model(base / f"bench-model-{layers}x512", layers=layers, hidden=512)
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 999) for _ in range(n)]

    unstored, probe = [prompt(WARM_TOKENS) for _ in range(2)], prompt(WARM_TOKENS)
    engines: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-db-remote-lookup-") as tmp:
        work = Path(tmp)
        (work / "remote").mkdir()
        for lookup, threads in CONFIGS:
            name = f"{lookup}-{threads}"
            # Every engine gets new prompts (vLLM's own prefix cache is per engine, the remote is shared).
            batches = [{"hits": [prompt(prompt_tokens) for _ in range(hits)], "misses": [prompt(prompt_tokens) for _ in range(hits)]}
                       for _ in range(rounds)]
            spec = {"model": str(model), "max_model_len": prompt_tokens + output_len + BLOCK_SIZE, "remote_dir": str(work / "remote"),
                    "bandwidth_bytes_per_s": bandwidth_mb_s * 1e6, "latency_s": latency_ms / 1e3, "store": str(work / f"store-{name}"),
                    "remote_lookup": lookup, "remote_read_concurrency": threads, "output_len": output_len, "fill": True,
                    "fill_store": str(work / f"fill-{name}"), "unstored": unstored, "probe": probe, "batches": batches}
            print(f"  {name}: 1 engine ...", file=sys.stderr, flush=True)
            result, _ = run_in_new_process("remote_lookup_engine", spec, work, name,
                                           progress=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
            engines[name] = result
    baseline = statistics.median(engines["inline-16"]["wall_s"])
    rows = []
    for lookup, threads in CONFIGS:
        walls = engines[f"{lookup}-{threads}"]["wall_s"]
        rows.append({"remote_lookup": lookup, "remote_read_concurrency": threads, "batch_s": round(statistics.median(walls), 3),
                     "speedup_over_inline_16": round(baseline / statistics.median(walls), 2),
                     "cached_tokens": engines[f"{lookup}-{threads}"]["cached_tokens"]})
    return {
        "model": f"llama {layers} layers x 512 hidden, bf16, random weights", "latency_ms": latency_ms,
        "bandwidth_MBps": bandwidth_mb_s, "batch": f"{hits} remote hits + {hits} misses of {prompt_tokens} tokens, {output_len} output tokens",
        "rounds": rounds, "rows": rows,
        "same_tokens_loaded": len({tuple(sorted(r["cached_tokens"])) for r in rows}) == 1,
        "host": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version()},
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"remote lookups over a {report['bandwidth_MBps']} MB/s link with {report['latency_ms']} ms per request "
          f"({report['model']}); batch: {report['batch']}; median of {report['rounds']} batches")
    print(f"{'remote_lookup':<14} {'read threads':>12} {'batch s':>8} {'vs inline/16':>12}")
    for r in report["rows"]:
        print(f"{r['remote_lookup']:<14} {r['remote_read_concurrency']:>12} {r['batch_s']:>8.3f} {r['speedup_over_inline_16']:>11.2f}x")
    print("every configuration loaded the same tokens" if report["same_tokens_loaded"] else "WARNING: configurations loaded different tokens")


@click.command("remote-lookup", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--latency-ms", type=click.FloatRange(min=0), default=20.0, show_default=True, help="round trip of each remote request")
@click.option("--bandwidth-mb-s", type=click.FloatRange(min=1), default=400.0, show_default=True, help="link bandwidth")
@click.option("--hits", type=click.IntRange(min=1, max=MAX_NUM_SEQS), default=6, show_default=True,
              help="remote hits per batch (as many misses beside them)")
@click.option("--prompt-tokens", type=click.IntRange(min=2 * BLOCK_SIZE, max=8160), default=2048, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True, help="batches per configuration (median)")
@click.option("--output-len", type=click.IntRange(min=1), default=8, show_default=True, help="tokens generated per prompt")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True, help="layers of the random-weight Llama")
@click.option("--seed", type=int, default=5, show_default=True, help="prompt seed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def command(as_json: bool, **options: Any) -> None:
    """Remote lookups inline vs in the background, over a link with round trips (real vLLM on CPU).

    \b
    Example:
        ucm-db bench remote-lookup --latency-ms 20 --bandwidth-mb-s 400
    """
    report = run(**options)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
