"""Load or recompute over a throttled remote: ``ucm-db bench cost`` (issue 13, item 2).

    ucm-db bench cost [--lengths 1024,2048,4096,8160] [--repeats 3] [--rounds 1] [--json]

TTFT of prompts of each length whose KV is on a ``throttled://`` remote
(:mod:`.throttle`: a local directory behind one token-bucket link) and not
in the local tier, served by a fresh engine with ``load_policy=auto`` and
one with ``load_policy=always``, at two link bandwidths: one slower than
recomputing the prompt, one faster. ``recompute`` is an engine without a
connector. The figure of merit, per length and bandwidth, is
``TTFT_auto / min(TTFT_always, TTFT_recompute)`` (issue 13's target:
<= 1.1), each TTFT the median over ``--repeats`` prompts.

Procedure:

1. ``recompute`` engine: every prompt computed; its tokens per second give
   the break-even bandwidth (KV bytes per token x prefill tokens per second,
   the slowest and the fastest length). Unless ``--slow-mbps``/``--fast-mbps``
   are given, the slow link is break-even (slowest length) x
   ``--slow-fraction`` and the fast one break-even (fastest length) x
   ``--fast-factor``, so the two sides hold on a quiet or a loaded machine.
2. Four connector engines (slow/fast x auto/always), each a new process
   with an empty local tier over the same remote. The first one fills the
   remote with every prompt's blocks before measuring, through a real store
   with the engine's own keys and unit sizes (random finite bf16 values:
   attention costs the same whatever the values, and filling takes no
   engine prefill); the link of the fill is unthrottled.
3. Each engine first runs two unstored prompts (the cost model learns the
   prefill rate from their steps) and one stored prompt (the remote's
   first, probing, ask), all 1K tokens (or the longest length if shorter), then the measured prompts, lengths
   interleaved. TTFT is the wall time of one ``generate`` with
   ``max_tokens=1``; ``cached`` is vLLM's count of tokens not computed.

With ``--rounds N`` the five engines run N times (each round recompute
first, then the four connector engines, in reverse order every other
round), and each figure is the median
over every round's prompts: engines run one after another, and a host
whose speed drifts meanwhile otherwise shows up as a difference between
``auto`` and the engine it chose like.

Every engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
``throttled://`` file system registered in the job serves the connector,
with the same CPU layout (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.cpu_dtype import fast_dtype
from ucm_db.tools.bench.engine_pass import build_model, demo_dir
from ucm_db.tools.bench.engine_process import run_in_new_process

BLOCK_SIZE = 32
#: Longest prompt: the model's 8192 positions hold it and its one output token.
MAX_TOKENS = 8160
#: Length of the warm-up prompts (two unstored, one stored), at most the longest measured.
WARM_TOKENS = 1024
FILL_BYTES_PER_S = 1e12
RESERVED_CPUS = 1
POLICIES = ("auto", "always")


# -- the engine job (runs in a child process) ---------------------------------------
def _bf16_like(size: int, rng: Any) -> bytes:
    """``size`` bytes of finite bf16 values (no NaN or inf)."""
    import numpy as np

    values = rng.standard_normal(size // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def fill_remote(llm: Any, remote: dict[str, Any], path: Path, prompts: list[list[int]]) -> int:
    """Writes every unit of ``prompts``' claimable blocks (all full blocks
    but the one holding the prompt's last token) to ``remote`` through a
    real store at ``path``, with the in-process engine's own namespace,
    keys and unit size; returns blocks written. Needs an in-process engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the ucm-db connector."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import Request

    import ucm_db
    from ucm_db.connector.identity import reader_spans
    from ucm_db.keys.units import UnitKeys

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    worker = get_kv_transfer_group()._worker
    rng = np.random.default_rng(0)
    written = 0
    with ucm_db.open(path, codec="none", **remote) as store:
        for i, ids in enumerate(prompts):
            blocks = (len(ids) - 1) // BLOCK_SIZE
            keys = sched.keys_for(Request(f"fill-{i}", ids, SamplingParams(max_tokens=1), None), blocks)
            for span in reader_spans(worker._shape):
                units = list(UnitKeys(keys, sched._grid, span))
                store.put(sched._namespace, units, [_bf16_like(worker.layout.unit_bytes, rng) for _ in units], parent=None)
            written += blocks
        store.flush(upload_timeout_s=None)
    return written


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: optionally fill the remote, warm up, measure (a child)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(RESERVED_CPUS)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm_db.tools.bench.throttle import register

    register()
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype") or fast_dtype().dtype, block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"], max_num_seqs=2, seed=0, enable_prefix_caching=True,
    )
    link = None
    if spec.get("policy"):
        link = {"path": spec["remote_dir"], "bandwidth_bytes_per_s": spec["bandwidth_bytes_per_s"]}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
            "kv_role": "kv_consumer",  # loads only: no upload competes for the link
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "path": spec["store"], "codec": "none", "load_policy": spec["policy"],
                "remote": "throttled://kv", "remote_options": link, "remote_deadline_s": 600.0,
            },
        }
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"ttft_s": [], "cached": []}
    try:
        if spec.get("fill"):
            fill = {"remote": "throttled://kv", "remote_options": {**link, "bandwidth_bytes_per_s": FILL_BYTES_PER_S}}  # type: ignore[dict-item]
            out["filled_blocks"] = fill_remote(llm, fill, Path(spec["fill_store"]), [spec["probe"], *spec["prompts"]])
        for ids in [*spec["unstored"], *([spec["probe"]] if link else [])]:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        for ids in spec["prompts"]:
            started = time.perf_counter()
            result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            out["ttft_s"].append(time.perf_counter() - started)
            out["cached"].append(int(result.num_cached_tokens or 0))
        if link:
            sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
            out["cost_model"] = sched.cost.describe(sched._ns_id)
            out["remote_skipped"] = sched.cost.skipped["remote"]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


# -- the parent -----------------------------------------------------------------------
def _kv_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2)  # K and V, bf16


def _prompts(lengths: list[int], repeats: int, seed: int) -> dict[str, Any]:
    import random

    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 999) for _ in range(n)]

    order = [n for _ in range(repeats) for n in lengths]  # lengths interleaved
    warm = min(WARM_TOKENS, max(lengths))
    return {"unstored": [prompt(warm) for _ in range(2)], "probe": prompt(warm),
            "prompts": [prompt(n) for n in order], "lengths": order}


def _medians(outcome: dict[str, Any], order: list[int]) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for n in sorted(set(order)):
        picked = [i for i, m in enumerate(order) if m == n]
        rows[n] = {"ttft_ms": 1e3 * statistics.median(outcome["ttft_s"][i] for i in picked),
                   "cached": statistics.median(outcome["cached"][i] for i in picked)}
    return rows


def run(lengths: list[int], repeats: int, layers: int, hidden: int, slow_fraction: float, fast_factor: float,
        slow_mbps: float | None, fast_mbps: float | None, seed: int, rounds: int = 1) -> dict[str, Any]:
    """Every engine in its own process, ``rounds`` times (recompute first,
    then the connector engines, in reverse order every other round, so a
    host that drifts weighs on them alike); returns the report, each
    engine's prompts pooled over the rounds."""
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    model = build_model(base / f"bench-model-{layers}x{hidden}", layers=layers, hidden=hidden)
    bytes_per_token = _kv_bytes_per_token(model)
    prompts = _prompts(lengths, repeats, seed)
    order = prompts["lengths"]
    common = {"model": str(model), "max_model_len": max(lengths) + BLOCK_SIZE, **{k: prompts[k] for k in ("unstored", "probe", "prompts")}}

    with tempfile.TemporaryDirectory(prefix="ucm-db-cost-") as tmp:
        work = Path(tmp)
        print("  recompute: 1 engine ...", file=sys.stderr, flush=True)
        outcomes: dict[str, list[dict[str, Any]]] = {"recompute": [_engine(common, work, "recompute-0")]}
        rates = [n / (row["ttft_ms"] / 1e3) for n, row in _medians(outcomes["recompute"][0], order).items()]
        break_even = (min(rates) * bytes_per_token, max(rates) * bytes_per_token)
        links = {"slow": slow_mbps * 1e6 if slow_mbps else break_even[0] * slow_fraction,
                 "fast": fast_mbps * 1e6 if fast_mbps else break_even[1] * fast_factor}
        (work / "remote").mkdir()
        names = [f"{link}-{policy}" for link in links for policy in POLICIES]
        for round_index in range(rounds):
            if round_index:  # round 1's recompute engine calibrated the links above
                print(f"  recompute: 1 engine (round {round_index + 1}) ...", file=sys.stderr, flush=True)
                outcomes["recompute"].append(_engine(common, work, f"recompute-{round_index}"))
            for name in names if round_index % 2 == 0 else names[::-1]:
                tag = f"{name}-{round_index}"
                link, policy = name.split("-")
                print(f"  {name}: 1 engine, link {links[link] / 1e6:.1f} MB/s (round {round_index + 1}) ...", file=sys.stderr, flush=True)
                spec = {**common, "policy": policy, "bandwidth_bytes_per_s": links[link], "remote_dir": str(work / "remote"),
                        "store": str(work / f"store-{tag}"), "fill": len(outcomes) == 1, "fill_store": str(work / "fill-store")}
                outcomes.setdefault(name, []).append(_engine(spec, work, tag))
    pooled = {name: _pooled(runs) for name, runs in outcomes.items()}
    recompute = pooled.pop("recompute")
    return _report(recompute, pooled, links, break_even, order * rounds, bytes_per_token, layers, hidden, repeats, rounds)


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's rounds as one outcome: prompts concatenated in round
    order, the last round's cost model and counters."""
    pooled = dict(runs[-1])
    filled = [run["filled_blocks"] for run in runs if "filled_blocks" in run]  # the round that filled the remote
    if filled:
        pooled["filled_blocks"] = filled[0]
    pooled["ttft_s"] = [t for run in runs for t in run["ttft_s"]]
    pooled["cached"] = [c for run in runs for c in run["cached"]]
    return pooled


def _engine(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """One engine job in a new process (a failure is a SystemExit whose
    message the ``ucm-db`` script prints)."""
    result, _ = run_in_new_process("cost_engine", spec, work, name,
                                   progress=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
    return result


def _report(recompute: dict[str, Any], engines: dict[str, dict[str, Any]], links: dict[str, float],
            break_even: tuple[float, float], order: list[int], bytes_per_token: int, layers: int, hidden: int,
            repeats: int, rounds: int = 1) -> dict[str, Any]:
    base = _medians(recompute, order)
    rows = []
    for link, bandwidth in links.items():
        auto, always = _medians(engines[f"{link}-auto"], order), _medians(engines[f"{link}-always"], order)
        for n in sorted(base):
            best = min(always[n]["ttft_ms"], base[n]["ttft_ms"])
            rows.append({
                "link": link, "bandwidth_MBps": round(bandwidth / 1e6, 2), "tokens": n,
                "recompute_ms": round(base[n]["ttft_ms"], 1), "always_ms": round(always[n]["ttft_ms"], 1),
                "auto_ms": round(auto[n]["ttft_ms"], 1), "auto_cached": auto[n]["cached"], "always_cached": always[n]["cached"],
                "auto_over_best": round(auto[n]["ttft_ms"] / best, 3),
                "load_over_recompute": round(always[n]["ttft_ms"] / base[n]["ttft_ms"], 3),
            })
    return {
        "model": f"llama {layers} layers x {hidden} hidden, bf16, random weights", "kv_bytes_per_token": bytes_per_token,
        "block_size": BLOCK_SIZE, "repeats": repeats, "rounds": rounds, "break_even_MBps": [round(b / 1e6, 2) for b in break_even],
        "rows": rows, "target_auto_over_best": 1.1,
        "worst_auto_over_best": max(r["auto_over_best"] for r in rows),
        "engines": {name: {k: v for k, v in out.items() if k in ("cost_model", "remote_skipped", "filled_blocks", "ttft_s", "cached")}
                    for name, out in {"recompute": recompute, **engines}.items()},
        "host": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version()},
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"load or recompute over a throttled remote ({report['model']}, {report['kv_bytes_per_token']} KV bytes/token, "
          f"block {report['block_size']}); median TTFT of {report['repeats']} prompts per length"
          + (f" in each of {report['rounds']} rounds" if report.get("rounds", 1) > 1 else ""))
    print(f"break-even link (slowest, fastest length): {report['break_even_MBps'][0]} / {report['break_even_MBps'][1]} MB/s")
    print(f"{'link':<5} {'MB/s':>7} {'tokens':>6} {'recompute ms':>12} {'always ms':>10} {'auto ms':>9} "
          f"{'auto cached':>11} {'load/recomp':>11} {'auto/min':>8}")
    for r in report["rows"]:
        print(f"{r['link']:<5} {r['bandwidth_MBps']:>7.2f} {r['tokens']:>6} {r['recompute_ms']:>12.1f} {r['always_ms']:>10.1f}"
              f" {r['auto_ms']:>9.1f} {r['auto_cached']:>11.0f} {r['load_over_recompute']:>11.3f} {r['auto_over_best']:>8.3f}")
    verdict = "met" if report["worst_auto_over_best"] <= report["target_auto_over_best"] else "NOT met"
    print(f"worst TTFT_auto / min(TTFT_load, TTFT_recompute): {report['worst_auto_over_best']:.3f} "
          f"(target <= {report['target_auto_over_best']}: {verdict}); load average {report['host']['load_avg'][0]:.1f}"
          f" on {report['host']['cpus']} CPUs")


def _lengths(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError as exc:
        raise click.BadParameter("give token counts separated by commas, e.g. 1024,2048") from exc
    if not lengths or min(lengths) < 2 * BLOCK_SIZE or max(lengths) > MAX_TOKENS:
        raise click.BadParameter(f"each length must be {2 * BLOCK_SIZE} to {MAX_TOKENS} tokens")
    return lengths


@click.command("cost", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--lengths", default="1024,2048,4096,8160", show_default=True, callback=_lengths, help="prompt lengths in tokens")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="prompts per length (median)")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="run every engine this many times, every other round in reverse order; medians pool the rounds")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True, help="layers of the random-weight Llama")
@click.option("--hidden", type=click.IntRange(min=64), default=512, show_default=True, help="hidden size of the model")
@click.option("--slow-fraction", type=click.FloatRange(min=0.01, max=0.95), default=0.5, show_default=True,
              help="slow link = break-even bandwidth of the slowest length x this")
@click.option("--fast-factor", type=click.FloatRange(min=1.05), default=4.0, show_default=True,
              help="fast link = break-even bandwidth of the fastest length x this")
@click.option("--slow-mbps", type=click.FloatRange(min=0.01), default=None, help="slow link in MB/s (instead of calibrating)")
@click.option("--fast-mbps", type=click.FloatRange(min=0.01), default=None, help="fast link in MB/s (instead of calibrating)")
@click.option("--seed", type=int, default=1, show_default=True, help="prompt seed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def command(as_json: bool, **options: Any) -> None:
    """Load or recompute: TTFT with load_policy=auto vs always vs recompute over a throttled remote (real vLLM on CPU).

    \b
    Example:
        ucm-db bench cost --lengths 1024,2048,4096,8160 --repeats 3
    """
    report = run(**options)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
