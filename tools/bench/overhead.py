"""Connector overhead figures (a script that prints, never a test).

    ucm-db bench overhead [--lookup-only] [--no-engine] [--prompts 12] [--prompt-tokens 1024] [--rounds 3]

1. Scheduler-side lookup of a 32K-token prompt: ``get_num_new_matched_tokens``
   on a fresh request (block keys hashed from scratch, then the store's
   binary search), against an empty store (miss) and a store holding the
   whole chain (hit). Target: <= 1 ms.
2. TTFT on a 0%-hit workload (every prompt new), each configuration in its
   own engine process: no connector, ucm-db with codec ``none``, ucm-db with
   codec ``zstd`` (fresh stores), ``--rounds`` times, interleaved. Target:
   ucm-db/none within 1.05x of no connector. On a CPU-only engine the
   background writer's compression competes with the model for the same
   cores, which the zstd figure shows.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.engine_pass import BLOCK_SIZE, build_model, demo_dir, run_pass_in_new_process

LOOKUP_TOKENS = 32 * 1024
#: Every engine runs with the same VLLM_CPU_NUM_OF_RESERVED_CPU: without it,
#: vLLM-CPU gives the model one more core whenever a KV connector is
#: configured (on 2 cores: 2 OpenMP threads instead of 1), and the comparison
#: would measure that, not the connector (docs/vllm-cpu-connector-effect.md).
#: 1 is vLLM's own layout here: one model thread, one core for the engine core.
RESERVED_CPUS = 1


def bench_lookup(block_size: int = BLOCK_SIZE, repeats: int = 30) -> dict[str, float]:
    """Median milliseconds of the scheduler-side lookup (miss and hit)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from ucm_db.connector.identity import KVShape, namespace
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    shape = KVShape(model="bench", kv_dtype="bfloat16", block_size=block_size, use_mla=False, layout="bench", tp_size=1, pp_size=1)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 32000) for _ in range(LOOKUP_TOKENS)]
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": tmp, "codec": "none"}), shape)
        params = SamplingParams(max_tokens=1)

        def once() -> tuple[float, float, int]:
            request = Request(f"r{time.perf_counter_ns()}", tokens, params, None)
            wall, cpu = time.perf_counter(), time.process_time()
            hit, _ = sched.get_num_new_matched_tokens(request, 0)
            return time.perf_counter() - wall, time.process_time() - cpu, hit

        misses = [once() for _ in range(repeats)]
        out["miss_ms"] = 1e3 * statistics.median(s[0] for s in misses)
        out["miss_cpu_ms"] = 1e3 * statistics.median(s[1] for s in misses)
        ns = namespace(shape)
        keys = ns.block_keys(tokens)
        sched.store.put(ns, keys, [b"\0" * 64] * len(keys))
        samples = [once() for _ in range(repeats)]
        assert samples[0][2] == (LOOKUP_TOKENS - 1) // block_size * block_size
        out["hit_ms"] = 1e3 * statistics.median(s[0] for s in samples)
        out["hit_cpu_ms"] = 1e3 * statistics.median(s[1] for s in samples)
        hashing = []
        for _ in range(repeats):
            cpu = time.process_time()
            ns.block_keys(tokens)
            hashing.append(time.process_time() - cpu)
        out["hashing_cpu_ms"] = 1e3 * statistics.median(hashing)
        out["blocks"] = float(len(keys))
        sched.shutdown()
    return out


def bench_save_path(prompt_tokens: int, repeats: int = 10) -> dict[str, float]:
    """CPU ms per prompt of the save path for the demo model's KV shape:
    the copy-out on the forward thread (``KVLayout.gather``) and the
    background writer's encode + commit (``Store.put``) per codec."""
    import torch

    from ucm_db.connector.layouts import detect_layout
    from ucm_db import Namespace

    blocks = prompt_tokens // BLOCK_SIZE
    kv = {f"l{i}": torch.randn(4 * blocks, 4, BLOCK_SIZE, 128).to(torch.bfloat16) for i in range(6)}
    layout = detect_layout(kv, 4 * blocks)
    staging = layout.new_staging(blocks)
    ids = list(range(blocks, 2 * blocks))
    out: dict[str, float] = {}
    samples = []
    for _ in range(repeats):
        cpu = time.process_time()
        layout.gather(ids, staging)
        samples.append(time.process_time() - cpu)
    out["copy_out_ms"] = 1e3 * statistics.median(samples)
    rows = staging.numpy()
    payloads = [layout.frames(rows[i]) for i in range(blocks)]
    for codec in ("none", "zstd"):
        with tempfile.TemporaryDirectory() as tmp, ucm_db_open(tmp, codec=codec, encode_threads=0) as store:
            samples = []
            for r in range(repeats):
                ns = Namespace(model=f"bench{r}", kv_dtype="bfloat16", block_size=BLOCK_SIZE)
                keys = ns.block_keys(list(range(blocks * BLOCK_SIZE)))
                cpu = time.process_time()
                store.put(ns, keys, payloads)
                samples.append(time.process_time() - cpu)
            out[f"commit_{codec}_ms"] = 1e3 * statistics.median(samples)
    out["bytes"] = float(blocks * layout.block_bytes)
    return out


def ucm_db_open(path: str, **options: object):  # noqa: ANN201 - small indirection for the import
    import ucm_db

    return ucm_db.open(path, **options)


def bench_ttft(prompts: int, prompt_tokens: int, rounds: int) -> dict[str, dict[str, Any]]:
    """TTFT per configuration, each engine in its own process, interleaved.

    Every round runs each configuration once, in an order that rotates from
    round to round, so a host that speeds up or slows down during the run
    (these machines do) shifts every configuration alike. Per configuration:
    the median and minimum over all its prompts, and the median over rounds of
    its ratio to the no-connector engine of the same round.
    """
    model = build_model(demo_dir() / "model")
    rng = random.Random(time.time_ns())
    texts = [[rng.randrange(3, 8000) for _ in range(prompt_tokens)] for _ in range(prompts)]
    codecs = {"no connector": None, "ucm-db codec=none": "none", "ucm-db codec=zstd": "zstd"}
    names = list(codecs)
    ttft_s: dict[str, list[float]] = {name: [] for name in names}
    round_ratios: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="ucm-db-overhead-") as tmp:
        work = Path(tmp)
        for round_index in range(rounds):
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            round_medians: dict[str, float] = {}
            for name in order:
                print(f"  round {round_index + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
                codec = codecs[name]
                connector = None if codec is None else {"path": str(work / f"store_{codec}_{round_index}"), "codec": codec}
                # A fresh first token per engine keeps every prompt at 0% hits.
                salt = rng.randrange(1 << 30)
                spec_prompts = [[salt % 7000 + 3] + p[1:] for p in texts]
                spec = {"model": str(model), "connector": connector, "prompts": spec_prompts, "reserved_cpus": RESERVED_CPUS}
                result = run_pass_in_new_process(spec, work, f"{name.replace(' ', '_')}_{round_index}")
                assert not any(result["cached"]), f"{name}: expected 0% hits, got {result['cached']}"
                ttft_s[name].extend(result["ttft_s"])
                round_medians[name] = statistics.median(result["ttft_s"])
            for name in names:
                round_ratios[name].append(round_medians[name] / round_medians["no connector"])
    return {
        name: {
            "median_ms": 1e3 * statistics.median(ttft_s[name]),
            "min_ms": 1e3 * min(ttft_s[name]),
            "ratio_of_round_medians": statistics.median(round_ratios[name]),
            "round_ratios": round_ratios[name],
        }
        for name in names
    }


@click.command("overhead", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--lookup-only", is_flag=True, help="only the scheduler-side lookup")
@click.option("--no-engine", is_flag=True, help="skip the engine TTFT runs")
@click.option("--block-size", type=click.IntRange(min=1), default=BLOCK_SIZE, show_default=True, help="block size of the lookup benchmark")
@click.option("--prompts", type=click.IntRange(min=1), default=12, show_default=True, help="prompts per engine")
@click.option("--prompt-tokens", type=click.IntRange(min=BLOCK_SIZE), default=1024, show_default=True, help="tokens per prompt")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="engine runs per configuration, interleaved")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON (progress goes to stderr)")
def command(lookup_only: bool, no_engine: bool, block_size: int, prompts: int, prompt_tokens: int, rounds: int,
            as_json: bool) -> None:
    """Connector overhead: scheduler lookup of a 32K-token prompt, save path, TTFT at 0% hits (real vLLM engines).

    \b
    Example:
        ucm-db bench overhead --lookup-only
        ucm-db bench overhead --prompts 10 --prompt-tokens 1024 --rounds 3
    """
    report: dict[str, Any] = {"lookup": bench_lookup(block_size)}
    if not lookup_only:
        report["save"] = bench_save_path(prompt_tokens)
    if not lookup_only and not no_engine:
        report["ttft"] = bench_ttft(prompts, prompt_tokens, rounds)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    lookup = report["lookup"]
    print(f"scheduler lookup, {LOOKUP_TOKENS}-token prompt ({int(lookup['blocks'])} blocks of {block_size}), median of 30,"
          f" wall (CPU) ms: miss {lookup['miss_ms']:.3f} ({lookup['miss_cpu_ms']:.3f}),"
          f" full hit {lookup['hit_ms']:.3f} ({lookup['hit_cpu_ms']:.3f});"
          f" hashing the whole chain alone {lookup['hashing_cpu_ms']:.3f} CPU ms; target <= 1 ms")
    if "save" not in report:
        return
    save = report["save"]
    if "ttft" not in report:
        print(f"save path per {prompt_tokens}-token prompt ({save['bytes'] / 1e6:.1f} MB of KV), CPU ms: copy-out {save['copy_out_ms']:.2f},"
              f" encode+commit none {save['commit_none_ms']:.2f}, zstd {save['commit_zstd_ms']:.2f}")
        return
    print(f"save path per {prompt_tokens}-token prompt of the demo model ({save['bytes'] / 1e6:.1f} MB of KV), CPU ms:"
          f" copy-out on the forward thread {save['copy_out_ms']:.2f}; background encode+commit"
          f" codec none {save['commit_none_ms']:.2f}, zstd {save['commit_zstd_ms']:.2f}")
    print(f"TTFT, 0% hits, {prompts} prompts of {prompt_tokens} tokens, {rounds} rounds,"
          " one engine process per configuration per round, configurations interleaved:")
    ttft = report["ttft"]
    base = ttft["no connector"]["median_ms"]
    for name, figures in ttft.items():
        per_round = ", ".join(f"{r:.3f}" for r in figures["round_ratios"])
        print(f"  {name:<20} median {figures['median_ms']:8.1f} ms  min {figures['min_ms']:8.1f} ms"
              f"  ratio of medians {figures['median_ms'] / base:.3f}x  per round [{per_round}]"
              f" -> median {figures['ratio_of_round_medians']:.3f}x")


