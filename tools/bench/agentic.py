"""``ucm-db bench agentic``: agent sessions whose context grows turn by turn
past the capped KV cache, with tool-call gaps between turns, or a user's
trace replayed (issue 50, item 6).

The workload (:mod:`.agentic_trace`): seeded sessions whose every turn's
prompt is the session so far plus new blocks, growing to ``--context-tokens``
(8192 by default) with short answers (16-32 tokens), more sessions than the
capped cache holds; or ``--trace FILE``, one JSON line per request. The
sending is :mod:`.agentic_run`'s replay; the rows, the bound each is judged
against and the targets (>= 99% of the bound's prefix hits, >= 0.95x its
req/s) are the conversation workload's own objects
(:data:`.serve_chat.ROWS`, :data:`.serve_chat.BOUNDS`,
``serve_chat.HITS_TARGET``/``RPS_TARGET``), so the two workloads cannot
drift apart.

Invariants:
    * Each target's figure is the median over runs of the ratio within a
      run (rows of one run ran minutes apart on the same host, runs may be
      hours apart); with ``--paired`` the warm req/s ratio of a run is the
      median of its pairs' (:mod:`.serve_paired`). Verdicts come from this
      run's figures, never hard-coded.
    * Usage errors (a bad trace line, caps that cannot hold a request, a
      capped cache that holds every generated session) stop the command
      before any server starts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench import serve_chat, serve_paired
from ucm_db.tools.bench.agentic_trace import (DEFAULT_BLOCK_TOKENS, AgenticSpec, TraceError, TraceRequest, generate,
                                              longest_session_blocks, read_trace, reusable_tokens, sessions,
                                              sessions_held, working_set_blocks, write_trace)
from ucm_db.tools.bench.serve_options import ServeOptions, medians
from ucm_db.tools.bench.serve_server import BLOCK_SIZE, bound_connector, bound_note

HITS_TARGET, RPS_TARGET = serve_chat.HITS_TARGET, serve_chat.RPS_TARGET


def workload(requests: list[TraceRequest], block_tokens: int, capped_blocks: int, bound_blocks: int) -> dict[str, Any]:
    """What a trace asks of the servers (no engine needed)."""
    turns = [sum(1 for r in requests if r.session == s) for s in sessions(requests)]
    return {"requests": len(requests), "sessions": len(turns), "turns_min": min(turns), "turns_max": max(turns),
            "longest_prompt_tokens": max(r.input_len for r in requests),
            "mean_output_tokens": round(statistics.mean(r.output_len for r in requests), 1),
            "last_arrival_s": max(r.arrival_s for r in requests), "hash_block_tokens": block_tokens,
            "working_set_blocks": working_set_blocks(requests, block_tokens, BLOCK_SIZE),
            "longest_context_blocks": longest_session_blocks(requests, BLOCK_SIZE),
            "capped_blocks": capped_blocks, "bound_blocks": bound_blocks,
            "sessions_held_by_capped": sessions_held(requests, capped_blocks, BLOCK_SIZE),
            "ideal_cold_hits": sum(reusable_tokens(requests, block_tokens, BLOCK_SIZE, warm=False)),
            "ideal_warm_hits": sum(reusable_tokens(requests, block_tokens, BLOCK_SIZE, warm=True))}


def targets(all_runs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row with a bound: recovered hits and req/s ratio within each run, their medians, the verdict."""
    per_run = [{t["row"]: t for t in serve_chat.targets(rows)} for rows in all_runs]
    out = []
    for row, base in serve_chat.BOUNDS.items():
        found = [run[row] for run in per_run if row in run]
        if not found:
            continue
        hits = statistics.median(t["recovered_hits"] for t in found)
        rps = statistics.median(t["rps_ratio"] for t in found)
        graded = row.startswith("ucm")
        out.append({"row": row, "bound": base, "recovered_hits": round(hits, 4), "rps_ratio": round(rps, 3),
                    "per_run_hits": [t["recovered_hits"] for t in found], "per_run_rps": [t["rps_ratio"] for t in found],
                    "met": (hits >= HITS_TARGET and rps >= RPS_TARGET) if graded else None})
    return out


def report(summary: dict[str, Any], settings: dict[str, Any], all_runs: list[dict[str, dict[str, Any]]],
           elapsed_s: float) -> dict[str, Any]:
    by_row = {row: medians([r[row] for r in all_runs if row in r])
              for row in serve_chat.ROWS if any(row in r for r in all_runs)}
    return {"workload": summary, "options": settings,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
            "elapsed_s": round(elapsed_s, 1), "rows": by_row, "runs": all_runs, "targets": targets(all_runs)}


def describe(w: dict[str, Any]) -> str:
    """The workload in two lines."""
    return (f"{w['requests']} requests in {w['sessions']} sessions of {w['turns_min']}-{w['turns_max']} turns, prompts "
            f"up to {w['longest_prompt_tokens']} tokens, answers {w['mean_output_tokens']} tokens on average, last "
            f"arrival {w['last_arrival_s']:.1f} s; hash blocks of {w['hash_block_tokens']} tokens\n"
            f"working set {w['working_set_blocks']} blocks of {BLOCK_SIZE}; capped {w['capped_blocks']} blocks "
            f"(holds {w['sessions_held_by_capped']} of {w['sessions']} sessions' longest contexts), bound "
            f"{w['bound_blocks']}; prefix hits a cache that forgets nothing gets: {w['ideal_cold_hits']} tokens first "
            f"pass, {w['ideal_warm_hits']} second pass")


def format_table(rep: dict[str, Any]) -> str:
    """The workload, one line per row (medians over runs), then the targets."""
    o = rep["options"]
    lines = [describe(rep["workload"]),
             f"source {o['source']}; concurrency {o['concurrency']}, time scale {o['time_scale']}; {o['layers']}-layer "
             f"Llama, block {BLOCK_SIZE}; median of {o['runs']} run(s); ucm-db codec {o['codec']}, load_mode "
             f"{o['load_mode']}, admit_after {o.get('admit_after', '1')}" + ("; --enforce-eager" if o["enforce_eager"] else "")
             + (f"; {o['warm_passes']} paired warm passes" if o["paired"] else "") + bound_note(o.get("bound_connector", "none")), "",
             f"{'setup':<46} {'req/s':>7} {'TTFT p50':>9} {'p99 ms':>7} {'vLLM hits':>10} {'ucm-db hits':>12} {'short turns':>12}"]
    for row, label in serve_chat.ROWS.items():
        if row in rep["rows"]:
            r = rep["rows"][row]
            h = r["hits"]
            ucm = f"{h['ucm_hit_tokens']:>12.0f}" if "ucm_db" in r else f"{'-':>12}"
            lines.append(f"{label:<46} {r['request_throughput']:>7.3f} {r['median_ttft_ms']:>9.0f} {r['p99_ttft_ms']:>7.0f} "
                         f"{h['vllm_hits']:>10.0f} {ucm} {r['short_turns']:>12.0f}")
    lines.append("")
    for t in rep["targets"]:
        verdict = "" if t["met"] is None else ("met" if t["met"] else "MISSED")
        runs = "" if len(t["per_run_rps"]) < 2 else " (runs: " + ", ".join(f"{x:.3f}" for x in t["per_run_rps"]) + ")"
        lines.append(f"{t['row']:<15} / {t['bound']:<11} recovered hits {t['recovered_hits']:>7.2%} (>= {HITS_TARGET:.0%}), "
                     f"req/s {t['rps_ratio']:.3f}x (>= {RPS_TARGET}){runs} {verdict}")
    load = ", ".join(f"{x:.2f}" for x in rep["machine"]["load_avg_at_end"])
    lines.append(f"\n{rep['machine']['cpus']} CPUs, load average at end {load}; {rep['elapsed_s']} s")
    return "\n".join(lines)


def _requests(trace: str | None, spec: AgenticSpec) -> list[TraceRequest]:
    if trace is None:
        return generate(spec)
    try:
        return read_trace(Path(trace), spec.block_tokens)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from exc


def _check_caps(requests: list[TraceRequest], max_model_len: int, capped: int, bound: int, generated: bool) -> None:
    for name, blocks in (("--capped-blocks", capped), ("--bound-blocks", bound)):
        if blocks * BLOCK_SIZE < max_model_len:
            raise click.BadParameter(f"{blocks} blocks cannot hold the longest request ({max_model_len} tokens = "
                                     f"{max_model_len // BLOCK_SIZE} blocks)", param_hint=name)
    held = sessions_held(requests, capped, BLOCK_SIZE)
    if generated and held >= len(sessions(requests)):
        raise click.BadParameter(f"{capped} blocks hold all {held} sessions' longest contexts: nothing is evicted to "
                                 "recover; lower it or raise --sessions", param_hint="--capped-blocks")


@click.command("agentic", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
              help="replay this trace (JSON lines: session, arrival_s, input_len, output_len, hash_ids) instead of generating")
@click.option("--write-trace", type=click.Path(dir_okay=False, writable=True), default=None,
              help="write the workload (generated or read) as a trace to this file")
@click.option("--no-run", is_flag=True, help="print the workload (and write --write-trace) without starting any server")
@click.option("--hash-block-tokens", type=click.IntRange(min=1), default=DEFAULT_BLOCK_TOKENS, show_default=True,
              help="tokens each hash id stands for (the trace's block size)")
@click.option("--time-scale", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="multiplies every arrival_s (0: send each request as soon as its session and a slot allow)")
@click.option("--sessions", "n_sessions", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--turns", type=click.IntRange(min=1), default=8, show_default=True, help="turns of each session")
@click.option("--context-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
              help="the last turn's prompt is at least this long")
@click.option("--shared-tokens", type=click.IntRange(min=0), default=1024, show_default=True,
              help="system prompt and tool definitions every session starts with")
@click.option("--min-output-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-output-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--gap-s", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="tool call: seconds between a session's turns' arrivals")
@click.option("--seed", type=int, default=7, show_default=True, help="the sessions' and the tokens' seed")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True, help="requests in flight at most")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="layers of the random Llama")
@click.option("--capped-blocks", type=click.IntRange(min=1), default=None,
              help="KV blocks of the capped engines [default: --concurrency longest contexts, plus a quarter]")
@click.option("--bound-blocks", type=click.IntRange(min=1), default=None,
              help="KV blocks of the bound engine [default: the working set, plus a tenth, at least --capped-blocks]")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True, help="repetitions (medians reported)")
@click.option("--warm-passes", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --paired: pairs of warm-bound and ucm-second passes")
@click.option("--paired", is_flag=True, help="keep the bound's and ucm-db's servers up and run their warm passes in turns (ABBA)")
@click.option("--rows", default=",".join(serve_chat.ROWS), show_default=True, help="comma-separated rows to run")
@click.option("--codec", type=click.Choice(["zstd", "none"]), default="zstd", show_default=True, help="the ucm-db store's codec")
@click.option("--load-mode", type=click.Choice(["block", "layer", "async"]), default="block", show_default=True)
@click.option("--admit-after", type=click.Choice(["1", "2", "auto"]), default="1", show_default=True,
              help="the ucm-db rows' connector admit_after")
@click.option("--enforce-eager", is_flag=True, help="vLLM without torch.compile (every server alike): faster starts")
@click.option("--start-timeout-s", type=click.FloatRange(min=1), default=1200.0, show_default=True)
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None, help="scratch directory (stores, logs)")
@click.option("--json", "as_json", is_flag=True, help="print the full report as JSON")
def command(trace: str | None, write_trace: str | None, no_run: bool, hash_block_tokens: int, time_scale: float,
            n_sessions: int, turns: int, context_tokens: int, shared_tokens: int, min_output_tokens: int,
            max_output_tokens: int, gap_s: float, seed: int, concurrency: int, layers: int, capped_blocks: int | None,
            bound_blocks: int | None, runs: int, warm_passes: int, paired: bool, rows: str, codec: str, load_mode: str,
            admit_after: str, enforce_eager: bool, start_timeout_s: float, scratch_dir: str | None, as_json: bool) -> None:
    """Agent sessions on vLLM's OpenAI server on CPU, with and without ucm-db.

    Each session's prompt grows turn by turn (the session so far plus a
    tool result) to --context-tokens, answers are short, and a tool call
    (--gap-s) separates turns while other sessions run, so the capped
    cache has evicted a session by its next turn. Rows: vLLM alone capped,
    cold and warm bound (a cache for everything), ucm-db capped first and
    second pass and after a restart. Reports each row's req/s and prefix
    hits, and the hits recovered and req/s against the bound (targets
    >= 99% and >= 0.95x). --trace replays your traffic instead: one JSON
    line per request, {"session": "s1", "arrival_s": 0.0, "input_len":
    1024, "output_len": 16, "hash_ids": [0, 1]}, each hash id one block of
    --hash-block-tokens tokens (equal ids, equal tokens). A session's
    request is sent once its arrival_s (times --time-scale) has passed and
    its previous request answered. Progress goes to stderr.

    \b
    Example:
        ucm-db bench agentic --write-trace agentic.jsonl --no-run
        ucm-db bench agentic --layers 2 --sessions 8 --enforce-eager
        ucm-db bench agentic --trace agentic.jsonl --time-scale 0.5 --runs 2 --json
    """
    wanted = tuple(r.strip() for r in rows.split(",") if r.strip())
    unknown = sorted(set(wanted) - set(serve_chat.ROWS))
    if unknown:
        raise click.BadParameter(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(serve_chat.ROWS)}",
                                 param_hint="--rows")
    if paired and not serve_paired.PAIR_ROWS <= set(wanted):
        raise click.BadParameter(serve_paired.MISSING_PAIR, param_hint="--paired")
    if warm_passes > 1 and not paired:
        raise click.BadParameter("warm passes repeat only in pairs: add --paired", param_hint="--warm-passes")
    try:
        spec = AgenticSpec(sessions=n_sessions, turns=turns, context_tokens=context_tokens, shared_tokens=shared_tokens,
                           min_output_tokens=min_output_tokens, max_output_tokens=max_output_tokens, gap_s=gap_s,
                           block_tokens=hash_block_tokens, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    requests = _requests(trace, spec)
    if write_trace is not None:
        write_trace_file(Path(write_trace), requests)
    longest = longest_session_blocks(requests, BLOCK_SIZE) + 1
    capped = capped_blocks or -(-5 * concurrency * longest // 4)
    bound = bound_blocks or max(capped, -(-11 * working_set_blocks(requests, hash_block_tokens, BLOCK_SIZE) // 10))
    summary = workload(requests, hash_block_tokens, capped, bound)
    if no_run:
        click.echo(json.dumps(summary, indent=2) if as_json else describe(summary))
        return
    from ucm_db.tools.bench import agentic_run

    serve = ServeOptions(layers=layers, capped_blocks=capped, bound_blocks=bound, runs=runs, rows=wanted,
                         scratch_dir=scratch_dir, enforce_eager=enforce_eager, codec=codec, load_mode=load_mode,
                         start_timeout_s=start_timeout_s, warm_passes=warm_passes, paired=paired,
                         admit_after=admit_after if admit_after == "auto" else int(admit_after))
    options = agentic_run.AgenticOptions(tuple(requests), hash_block_tokens, seed, concurrency, time_scale, serve)
    _check_caps(requests, options.max_model_len, capped, bound, trace is None)
    all_runs, elapsed_s = agentic_run.run(options, progress=lambda line: click.echo(line, err=True))
    settings = {"source": trace or "generated", "concurrency": concurrency, "time_scale": time_scale, "seed": seed,
                "layers": layers, "runs": runs, "codec": codec, "load_mode": load_mode, "admit_after": admit_after,
                "enforce_eager": enforce_eager,
                "paired": paired, "warm_passes": warm_passes, "max_model_len": options.max_model_len, "bound_connector": bound_connector(),
                "generator": None if trace else {"sessions": n_sessions, "turns": turns, "context_tokens": context_tokens,
                                                 "shared_tokens": shared_tokens, "output_tokens": [min_output_tokens, max_output_tokens],
                                                 "gap_s": gap_s}}
    rep = report(summary, settings, all_runs, elapsed_s)
    click.echo(json.dumps(rep, indent=2) if as_json else format_table(rep))


def write_trace_file(path: Path, requests: list[TraceRequest]) -> None:
    """``--write-trace``: the requests as a trace, and a line on stderr saying where."""
    write_trace(path, requests)
    click.echo(f"wrote {len(requests)} requests to {path}", err=True)
