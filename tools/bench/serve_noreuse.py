"""``ucm-db bench serve --workload no-reuse``: the tax of turning ucm-db on
where it cannot help (issue 50, item 2).

Every request is a prompt of random token ids never sent before, so no
store and no prefix cache ever hits: ucm-db only looks up (misses), copies
each full block out of the paged cache (the model thread's ``save copy``)
and commits it in its writer thread. The same engine without a connector,
with the same KV cap, is the baseline. One server per setup stays up
(``off``, then one ucm-db server per codec, each on its own empty store)
and the passes run in rounds. A setup is a codec, optionally with the
connector's ``admit_after`` (``none+admit2``: a chain is stored from its
second sighting, so unique prompts are never written; ``none+admitauto``:
so once little is seen reused): what admission takes off the tax.

Invariants:
    * Each pass sends fresh prompts: pass ``k`` (counted over every pass of
      the run, warm-ups included) draws its ids from the seed
      ``(seed, k)``, so no two passes share a prompt, on one server or
      across servers (:func:`prompts`).
    * Round ``r`` runs the servers in the order ``off, ucm...`` when ``r``
      is even and reversed when odd (:func:`round_order`): ABBA over two
      rounds, so a steady drift of the host's load favours no server.
    * Before each pass every server is idle (:func:`.serve_paired.wait_idle`):
      a ucm-db server's writer commits the last pass's blocks before the
      next pass of any server starts, and its counters, read after that
      wait, hold them.
    * A setup's ratio is each round's ucm-db pass over that round's ``off``
      pass; its figure is the geometric mean of the rounds' ratios
      (:func:`geomean`). With the ``noop`` setup among them, each ucm-db
      setup is also set against it the same way (``ratios_to_noop``):
      ucm-db's own share, vLLM's connector plumbing being in both.
    * A warm-up pass per server (not counted) precedes the rounds.
    * Every request is answered with exactly ``output_len`` tokens, or the
      pass fails (:mod:`.serve_chat_client`'s client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ucm_db.tools.bench import serve_paired, thread_trace
from ucm_db.tools.bench.serve_chat_client import _complete, summarize
from ucm_db.tools.bench.serve_options import Progress, ServeOptions, connector_options, pass_counters
from ucm_db.tools.bench.serve_server import BLOCK_SIZE, NOOP_TRANSFER, SERVED_NAME, Server, ServerSpec

#: The baseline setup's name; the ucm-db setups are ``ucm-<codec>``.
OFF = "off"
#: ucm-db on / off request throughput (geometric mean of the rounds' ratios).
TARGET = 0.98
#: The prefill rate the save time per token is set against: an H100-class
#: GPU prefilling a Llama-3-8B-sized model (bf16, about 16 GFLOP a token at
#: about 40% of 989 dense TFLOPS): 20,000 tokens a second, 50 us a token.
H100_PREFILL_TOKENS_S = 20_000.0
#: Ids of the word-level tokenizer's special tokens (never in a prompt).
FIRST_ID = 4


@dataclass(frozen=True)
class NoReuseSpec:
    """One pass's load: ``num_prompts`` prompts of ``prompt_len`` random
    ids, ``output_len`` tokens each, ``concurrency`` in flight."""

    num_prompts: int = 16
    prompt_len: int = 2048
    output_len: int = 64
    concurrency: int = 4
    seed: int = 7
    vocab_size: int = 8000

    @property
    def max_model_len(self) -> int:
        return -(-(self.prompt_len + self.output_len + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE


def prompts(spec: NoReuseSpec, pass_index: int) -> list[list[int]]:
    """Pass ``pass_index``'s prompts: random ids from the seed ``(spec.seed, pass_index)``."""
    rng = np.random.default_rng([spec.seed, pass_index])
    ids = rng.integers(FIRST_ID, spec.vocab_size, size=(spec.num_prompts, spec.prompt_len))
    return [row.tolist() for row in ids]


def round_order(round_index: int, setups: list[str]) -> list[str]:
    """The servers' order in round ``round_index``: ``setups`` (baseline
    first) when even, reversed when odd (ABBA)."""
    return list(setups) if round_index % 2 == 0 else list(reversed(setups))


def geomean(values: list[float]) -> float:
    """The geometric mean of positive ``values``."""
    if not values or min(values) <= 0:
        raise ValueError(f"a geometric mean needs positive values, not {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def round_ratios(passes: dict[str, list[dict[str, Any]]], baseline: str = OFF) -> dict[str, list[float]]:
    """Each other setup's request throughput over ``baseline``'s (the server
    without a connector, or the no-op connector's), round by round."""
    base = passes[baseline]
    out: dict[str, list[float]] = {}
    for setup, own in passes.items():
        if setup in (OFF, baseline):
            continue
        if len(own) != len(base):
            raise ValueError(f"{setup}: {len(own)} passes against {len(base)} of {baseline}: rounds need one of each")
        out[setup] = [round(u["request_throughput"] / b["request_throughput"], 4) for b, u in zip(base, own)]
    return out


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """Bytes of K and V one token takes over every layer of ``model`` in ``dtype``."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if dtype in ("float32", "float") else 2
    return 2 * config["num_hidden_layers"] * heads * head_dim * width


def save_per_token(ucm: dict[str, float], bytes_per_token: int) -> dict[str, float]:
    """The connector's save costs per saved token (from a pass's counters),
    and the copy's share of an H100-class prefill step (:data:`H100_PREFILL_TOKENS_S`)."""
    tokens = ucm["saved_MB"] * 1e6 / bytes_per_token
    if tokens <= 0:
        return {"saved_tokens": 0.0}
    copy_us = ucm["save_copy_s"] / tokens * 1e6
    return {"saved_tokens": round(tokens), "save_copy_us_per_token": round(copy_us, 3),
            "save_commit_cpu_us_per_token": round(ucm["save_commit_cpu_s"] / tokens * 1e6, 3),
            "save_copy_share_of_h100_prefill": round(copy_us / (1e6 / H100_PREFILL_TOKENS_S), 4)}


async def _send(spec: NoReuseSpec, ids: list[list[int]], base_url: str, timeout_s: float) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in ids:
        queue.put_nowait(prompt)
    ttfts_s: list[float] = []
    cached_tokens = 0
    url = base_url + "/v1/completions"

    async def worker(client: Any) -> None:
        nonlocal cached_tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            ttft_s, answered, cached = await _complete(client, url, SERVED_NAME, prompt, spec.output_len)
            if answered != spec.output_len or ttft_s < 0:
                raise RuntimeError(f"{answered} of {spec.output_len} answer tokens (TTFT {ttft_s:.3f} s)")
            ttfts_s.append(ttft_s)
            cached_tokens += cached

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(spec.concurrency)))
        duration_s = time.perf_counter() - started
    return summarize(ttfts_s, duration_s, cached_tokens)


@dataclass(frozen=True)
class NoReuseOptions:
    """A no-reuse run: the load, the setups (``codecs``: one ucm-db server
    each), the rounds, the model's width, and the servers' shared options
    (``serve.capped_blocks`` is every server's KV cap)."""

    spec: NoReuseSpec
    serve: ServeOptions
    codecs: tuple[str, ...] = ("none", "zstd")  # setups: "CODEC", "CODEC+admitN", "CODEC+admitauto", "CODEC+proc" (parse_setup)
    rounds: int = 2
    hidden: int = 768

    @property
    def setups(self) -> list[str]:
        return [OFF, *(f"ucm-{codec}" for codec in self.codecs)]


#: The setup of a server with a connector that does nothing: what vLLM's connector plumbing costs alone.
NOOP = "noop"


def parse_setup(setup: str) -> tuple[str, int | str, bool]:
    """``"zstd"`` -> ("zstd", 1, False); ``"none+admit2"`` -> ("none", 2,
    False); ``"none+admitauto"`` -> ("none", "auto", False); ``"none+proc"``
    -> ("none", 1, True): the connector's ``save_process``. Raises
    ValueError naming the accepted forms."""
    if setup == NOOP:
        return NOOP, 1, False
    codec, *suffixes = setup.split("+")
    admits = [s for s in suffixes if s == "admitauto" or (s.startswith("admit") and s[5:].isdigit() and int(s[5:]) >= 1)]
    procs = [s for s in suffixes if s == "proc"]
    if codec not in ("none", "zstd") or len(admits) > 1 or len(procs) > 1 or len(admits) + len(procs) != len(suffixes):
        raise ValueError(f"{setup!r}: a setup is a codec (none, zstd), optionally +admitN or +admitauto (e.g. none+admit2) "
                         "and +proc (saves committed by a child process), or noop")
    admit: int | str = 1 if not admits else "auto" if admits[0] == "admitauto" else int(admits[0][5:])
    return codec, admit, bool(procs)


def run(options: NoReuseOptions, progress: Progress) -> dict[str, Any]:
    """Starts every setup's server, a warm-up pass each, then the rounds; returns the report."""
    from ucm_db.tools.bench.serve_model import VOCAB_SIZE, build_serve_model

    spec = replace(options.spec, vocab_size=VOCAB_SIZE)
    if options.serve.capped_blocks * BLOCK_SIZE < spec.max_model_len:
        raise ValueError(f"--capped-blocks {options.serve.capped_blocks} cannot hold one request ({spec.max_model_len} tokens)")
    started = time.time()
    model = build_serve_model(options.serve.layers, hidden=options.hidden)
    if options.serve.scratch_dir is not None:
        Path(options.serve.scratch_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-noreuse-", dir=options.serve.scratch_dir))
    base = ServerSpec(model, options.serve.capped_blocks, spec.max_model_len, enforce_eager=options.serve.enforce_eager)
    specs = {OFF: base}
    for setup in options.codecs:
        codec, admit_after, save_process = parse_setup(setup)
        if codec == NOOP:  # vLLM's connector plumbing alone (tools/bench/noop_connector.py)
            specs[f"ucm-{setup}"] = replace(base, transfer=NOOP_TRANSFER)
            continue
        serve = replace(options.serve, codec=codec)
        extra: dict[str, Any] = {"admit_after": admit_after} if admit_after != 1 else {}
        if save_process:
            extra["save_process"] = True
        specs[f"ucm-{setup}"] = replace(base, connector=connector_options(work / f"store-{setup}", None, serve, **extra))
    bytes_per_token = kv_bytes_per_token(model, base.dtype)
    passes: dict[str, list[dict[str, Any]]] = {setup: [] for setup in options.setups}
    pass_index = 0
    try:
        with contextlib.ExitStack() as stack:
            servers: dict[str, Server] = {}
            for setup in options.setups:
                progress(f"starting the server for {setup}")
                servers[setup] = stack.enter_context(
                    Server(specs[setup], work / f"{setup}.server.log", start_timeout_s=options.serve.start_timeout_s))
                progress(f"  healthy after {servers[setup].start_s:.0f} s")

            def one_pass(setup: str, label: str, warmup: bool) -> dict[str, Any]:
                nonlocal pass_index
                for server in servers.values():
                    serve_paired.wait_idle(lambda: serve_paired.process_group_cpu_s(server.pgid))
                server = servers[setup]
                ids = prompts(spec, pass_index)
                if warmup:
                    ids = ids[:spec.concurrency]
                pass_index += 1
                before = server.connector_counters()
                result = thread_trace.trace_pass(server.pgid, lambda: asyncio.run(_send(spec, ids, server.base_url, 1800.0)))
                serve_paired.wait_idle(lambda: serve_paired.process_group_cpu_s(server.pgid))  # the writer's tail
                after = server.connector_counters()
                result["seed"] = [spec.seed, pass_index - 1]
                note = ""
                if before or after:
                    result["ucm_db"] = pass_counters(before, after)
                    result["save"] = save_per_token(result["ucm_db"], bytes_per_token)
                    u, s = result["ucm_db"], result["save"]
                    note = (f"; ucm-db hit {u['hit_tokens']:.0f} of {u['query_tokens']:.0f} tokens, saved {u['saved_MB']:.0f} MB, "
                            f"copy {u['save_copy_s']:.3f} s ({s.get('save_copy_us_per_token', 0):.2f} us/token), "
                            f"commit CPU {u['save_commit_cpu_s']:.3f} s ({s.get('save_commit_cpu_us_per_token', 0):.2f} us/token)")
                progress(f"  {label} {setup}: {result['request_throughput']:.3f} req/s, TTFT p50 {result['median_ttft_ms']:.0f} ms, "
                         f"vLLM cached {result['client_cached_tokens']:.0f} tokens{note}{thread_trace.shown(result['threads'])}")
                return result

            for setup in options.setups:
                one_pass(setup, "warm-up", True)
            for r in range(options.rounds):
                for setup in round_order(r, options.setups):
                    passes[setup].append(one_pass(setup, f"round {r + 1}", False))
    finally:
        if os.environ.get("UCM_DB_BENCH_KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)
    return _report(options, spec, passes, bytes_per_token, base.dtype, time.time() - started)


def _report(options: NoReuseOptions, spec: NoReuseSpec, passes: dict[str, list[dict[str, Any]]], bytes_per_token: int,
            dtype: str, elapsed_s: float) -> dict[str, Any]:
    ratios = round_ratios(passes)
    # Beside the no-op connector, each ucm-db setup's own share: on / noop,
    # round by round (vLLM's connector plumbing is in both).
    noop = f"ucm-{NOOP}"
    own_ratios = round_ratios(passes, noop) if noop in passes else {}
    setups: dict[str, Any] = {}
    for setup, own in passes.items():
        row: dict[str, Any] = {"pass_throughputs": [round(p["request_throughput"], 4) for p in own],
                               "median_ttft_ms": statistics.median(p["median_ttft_ms"] for p in own)}
        if setup in ratios:
            row["ratios"] = ratios[setup]
            row["geomean_ratio"] = round(geomean(ratios[setup]), 4)
            if all("ucm_db" in p for p in own):  # not the no-op connector's server
                totals = {key: sum(p["ucm_db"][key] for p in own) for key in ("saved_MB", "save_copy_s", "save_commit_cpu_s", "hit_tokens")}
                row["ucm_db"] = totals
                row["save"] = save_per_token(totals, bytes_per_token)
        if setup in own_ratios:
            row["ratios_to_noop"] = own_ratios[setup]
            row["geomean_to_noop"] = round(geomean(own_ratios[setup]), 4)
        setups[setup] = row
    targets = [{"target": f"{setup} / {OFF} req/s (geometric mean of {options.rounds} rounds)", "measured": row["geomean_ratio"],
                "bound": f">= {TARGET}", "met": row["geomean_ratio"] >= TARGET}
               for setup, row in setups.items() if "geomean_ratio" in row]
    return {
        "workload": "no-reuse",
        "options": {"num_prompts": spec.num_prompts, "prompt_len": spec.prompt_len, "output_len": spec.output_len,
                    "concurrency": spec.concurrency, "seed": spec.seed, "layers": options.serve.layers, "hidden": options.hidden,
                    "dtype": dtype, "kv_bytes_per_token": bytes_per_token, "kv_blocks": options.serve.capped_blocks,
                    "block_size": BLOCK_SIZE, "codecs": list(options.codecs), "rounds": options.rounds,
                    "enforce_eager": options.serve.enforce_eager, "h100_prefill_tokens_s": H100_PREFILL_TOKENS_S},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "elapsed_s": round(elapsed_s, 1),
        "setups": setups,
        "passes": passes,
        "targets": targets,
    }


def format_table(report: dict[str, Any]) -> str:
    """One line per setup (every pass's req/s, the rounds' ratios), then the targets."""
    o = report["options"]
    lines = [f"no-reuse: {o['num_prompts']} unique prompts a pass of {o['prompt_len']} random ids, {o['output_len']} out, "
             f"concurrency {o['concurrency']}, seed {o['seed']}; {o['layers']}-layer Llama hidden {o['hidden']} {o['dtype']} "
             f"({o['kv_bytes_per_token']} KV bytes/token), KV cap {o['kv_blocks']} blocks of {o['block_size']}; "
             f"{o['rounds']} rounds, order alternated (ABBA)" + ("; --enforce-eager" if o["enforce_eager"] else ""), "",
             f"{'setup':<10} {'req/s per pass':<28} {'on/off per round':<22} {'geomean':>8}  save copy / commit CPU per token"]
    for setup, row in report["setups"].items():
        rps = ", ".join(f"{x:.3f}" for x in row["pass_throughputs"])
        ratios = ", ".join(f"{x:.3f}" for x in row.get("ratios", []))
        geo = f"{row['geomean_ratio']:.3f}" if "geomean_ratio" in row else ""
        save = row.get("save", {})
        cost = (f"{save['save_copy_us_per_token']:.2f} us / {save['save_commit_cpu_us_per_token']:.2f} us "
                f"({save['saved_tokens']} tokens; copy = {save['save_copy_share_of_h100_prefill']:.1%} of an H100-class "
                f"prefill at {o['h100_prefill_tokens_s']:.0f} tok/s)" if "save_copy_us_per_token" in save else "")
        lines.append(f"{setup:<10} {rps:<28} {ratios:<22} {geo:>8}  {cost}")
    own = {setup: row for setup, row in report["setups"].items() if "geomean_to_noop" in row}
    if own:
        lines.append("")
        lines.append("ucm-db's own share, on / noop per round (vLLM's connector plumbing is in both):")
        for setup, row in own.items():
            lines.append(f"{setup:<10} {', '.join(f'{x:.3f}' for x in row['ratios_to_noop']):<51} {row['geomean_to_noop']:>8.3f}")
    lines.append("")
    for t in report["targets"]:
        lines.append(f"{t['target']:<55} {t['measured']:>7.3f}  {t['bound']:<7} {'met' if t['met'] else 'MISSED'}")
    load = ", ".join(f"{x:.2f}" for x in report["machine"]["load_avg_at_end"])
    lines.append(f"\n{report['machine']['cpus']} CPUs, load average at end {load}; {report['elapsed_s']} s")
    return "\n".join(lines)


def no_reuse_command(num_prompts: int, prompt_len: int, output_len: int, concurrency: int, seed: int, codecs: str,
                     pairs: int, hidden: int, serve_options: ServeOptions, as_json: bool) -> None:
    """``ucm-db bench serve --workload no-reuse``: checks the options (usage errors), runs, prints."""
    import click

    chosen = tuple(c.strip() for c in codecs.split(",") if c.strip())
    try:
        for setup in chosen:
            parse_setup(setup)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--codecs") from exc
    if not chosen or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"{codecs!r}: distinct setups (codecs none, zstd, optionally +admitN or +admitauto, or noop)", param_hint="--codecs")
    spec = NoReuseSpec(num_prompts=num_prompts, prompt_len=prompt_len, output_len=output_len, concurrency=concurrency,
                       seed=seed)
    if serve_options.capped_blocks * BLOCK_SIZE < spec.max_model_len:
        raise click.BadParameter(f"{serve_options.capped_blocks} blocks cannot hold one request ({spec.max_model_len} tokens)",
                                 param_hint="--capped-blocks")
    options = NoReuseOptions(spec=spec, serve=serve_options, codecs=chosen, rounds=pairs, hidden=hidden)
    report = run(options, progress=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
