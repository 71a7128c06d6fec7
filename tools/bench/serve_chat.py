"""``ucm-db bench serve --workload conversation``: the serving benchmark's
rows under the conversation workload (issue 29, item 5).

The servers are :mod:`.serve`'s (same model, caps, connector options); the
load is :mod:`.serve_chat_client`'s conversations instead of ``vllm bench
serve``. Rows (remote rows are prefix_repetition's only):

==========================  ===================================================
no-conn-capped              vLLM alone, capped, first pass
cold-bound                  no connector, KV for everything, first pass
warm-bound                  the same server, second pass (same conversations)
ucm-first                   ucm-db, capped, first pass (store empty)
ucm-second                  the same server, second pass (store warm)
ucm-restart                 a new server on the warm store
==========================  ===================================================

Targets (issue 29): a ucm-db row recovers >= 99% of its bound's prefix hits
(vLLM's own hits plus ucm-db's hit tokens over the bound's vLLM hits) and
serves >= 0.95x its bound's requests per second; ucm-first's bound is
cold-bound, the others' warm-bound. no-conn-capped is reported against
cold-bound beside them, with no target.

Invariants: as :mod:`.serve`'s (fresh servers per row except second
passes; new stores per run; medians over runs; verdicts from this run's
figures); every pass of a run sends the same conversations (same seed).
The ucm-db rows' store is a local tier alone (no remote row here, so no
write-back uploads competing for the cores the rows are measured on).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ucm_db.tools.bench import serve_paired, thread_trace
from ucm_db.tools.bench.serve_options import Progress, ServeOptions, connector_options, medians, pass_counters, repeated_row
from ucm_db.tools.bench.serve_chat_client import run_conversations
from ucm_db.tools.bench.serve_conversation import (ConversationSpec, ideal_hits, parse_vllm_counters, pass_hits,
                                                   recovered_hits)
from ucm_db.tools.bench.serve_server import BLOCK_SIZE, Server, ServerSpec, bound_connector, bound_note, bound_spec, parse_connector_counters

ROWS = {
    "no-conn-capped": "vLLM alone, capped, first pass",
    "cold-bound": "cold bound: no connector, bound, first pass",
    "warm-bound": "warm bound: no connector, bound, second pass",
    "ucm-first": "ucm-db, capped, first pass (store empty)",
    "ucm-second": "ucm-db, capped, second pass (store warm)",
    "ucm-restart": "ucm-db, capped, new engine on the warm store",
}
#: row -> its bound row; the targets on recovered hits and req/s against it.
BOUNDS = {"no-conn-capped": "cold-bound", "ucm-first": "cold-bound", "ucm-second": "warm-bound",
          "ucm-restart": "warm-bound"}
HITS_TARGET, RPS_TARGET = 0.99, 0.95
WARM_ROWS = ("warm-bound", "ucm-second", "ucm-restart")


@dataclass(frozen=True)
class ChatOptions:
    """One conversation run: the workload and the servers' shared options
    (``serve.load`` is unused here)."""

    spec: ConversationSpec
    serve: ServeOptions

    @property
    def max_model_len(self) -> int:
        return -(-(self.spec.request_tokens + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE


def _counters(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode("utf-8", errors="replace")
    return {**parse_vllm_counters(text), **parse_connector_counters(text)}


def counted_pass(server: Server, send: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """``send()``'s pass between two reads of the server's counters: its
    figures with the pass's prefix hits (and ucm-db's counters where the
    server has the connector), and a note on ucm-db's loads for the
    progress line."""
    before = _counters(server)
    kept = thread_trace.trace_pass(server.pgid, send)  # where the pass's CPU went, thread by thread
    after = _counters(server)
    kept["hits"] = pass_hits(before, after)
    note = ""
    if "query_tokens" in after:  # a ucm-db counter: the server has the connector
        kept["ucm_db"] = ucm = pass_counters(before, after)
        note = f"; ucm-db {ucm['hit_tokens']:.0f} tokens loaded, {ucm['loaded_MB']:.0f} MB in {ucm['load_s']:.1f} s"
    return kept, note + thread_trace.shown(kept["threads"])


def _pass(options: ChatOptions, server: Server, name: str, progress: Progress) -> dict[str, Any]:
    kept, note = counted_pass(server, lambda: run_conversations(options.spec, server.base_url))
    progress(f"  {name}: {kept['request_throughput']:.2f} req/s, TTFT p50 {kept['median_ttft_ms']:.0f} ms, "
             f"p99 {kept['p99_ttft_ms']:.0f} ms, vLLM hits {kept['hits']['vllm_hits']:.0f} tokens "
             f"({kept['duration']:.0f} s){note}")
    return kept


def run_once(options: ChatOptions, model: Path, work: Path, progress: Progress) -> dict[str, dict[str, Any]]:
    """Every wanted row once, with a new store under ``work``."""
    rows: dict[str, dict[str, Any]] = {}
    want = set(options.serve.rows)
    capped = ServerSpec(model, options.serve.capped_blocks, options.max_model_len,
                        enforce_eager=options.serve.enforce_eager)
    # Local tier only: no row here reads a remote, and write-back uploads
    # would take CPU from the two cores the rows are measured on.
    ucm = replace(capped, connector=connector_options(work / "store", None, options.serve))

    def serve(spec: ServerSpec, label: str, passes: tuple[str, ...]) -> None:
        if not want & set(passes):
            return
        progress(f"starting the server for {label}")
        with Server(spec, work / f"{label}.server.log", start_timeout_s=options.serve.start_timeout_s) as server:
            progress(f"  healthy after {server.start_s:.0f} s")
            for row in passes:
                rows[row] = _pass(options, server, row, progress)
                rows[row]["server_start_s"] = server.start_s

    serve(capped, "no-conn-capped", ("no-conn-capped",))
    bound = bound_spec(capped, options.serve.bound_blocks)
    if options.serve.paired:  # the command checked that both warm rows are wanted
        rows.update(serve_paired.paired_rows(
            bound, ucm, options.serve.warm_passes, want,
            lambda spec, label: Server(spec, work / f"{label}.server.log", start_timeout_s=options.serve.start_timeout_s),
            lambda server, row: _pass(options, server, row, progress), repeated_row, progress))
    else:
        serve(bound, "bound", ("cold-bound", "warm-bound"))
        serve(ucm, "ucm", ("ucm-first", "ucm-second"))
    serve(ucm, "ucm-restart", ("ucm-restart",))
    return rows


def run(options: ChatOptions, progress: Progress) -> dict[str, Any]:
    """All runs; returns the report (medians, every run, targets)."""
    from ucm_db.tools.bench.serve_model import build_serve_model

    started = time.time()
    if options.serve.scratch_dir is not None:
        Path(options.serve.scratch_dir).mkdir(parents=True, exist_ok=True)
    model = build_serve_model(options.serve.layers)
    all_runs: list[dict[str, dict[str, Any]]] = []
    for index in range(options.serve.runs):
        work = Path(tempfile.mkdtemp(prefix="ucm-bench-chat-", dir=options.serve.scratch_dir))
        progress(f"run {index + 1}/{options.serve.runs} in {work}")
        try:
            all_runs.append(run_once(options, model, work, progress))
        finally:
            if os.environ.get("UCM_DB_BENCH_KEEP") != "1":
                shutil.rmtree(work, ignore_errors=True)
    return report(options, all_runs, time.time() - started)


def targets(medians: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with a bound: recovered hits and req/s ratio against it."""
    out = []
    for row, base in BOUNDS.items():
        if row not in medians or base not in medians:
            continue
        hits = recovered_hits(medians[row]["hits"], medians[base]["hits"])
        rps, _ = serve_paired.throughput_ratio(medians[row], medians[base])
        graded = row.startswith("ucm")
        out.append({"row": row, "bound": base, "recovered_hits": round(hits, 4), "rps_ratio": round(rps, 3),
                    "met": (hits >= HITS_TARGET and rps >= RPS_TARGET) if graded else None})
    return out


def report(options: ChatOptions, all_runs: list[dict[str, dict[str, Any]]], elapsed_s: float) -> dict[str, Any]:
    by_row = {row: medians([r[row] for r in all_runs if row in r]) for row in ROWS if any(row in r for r in all_runs)}
    spec, serve = options.spec, options.serve
    return {
        "options": {"workload": "conversation", "conversations": spec.conversations, "turns": spec.turns,
                    "turn_tokens": spec.turn_tokens, "output_tokens": spec.output_tokens,
                    "concurrency": spec.concurrency, "seed": spec.seed, "layers": serve.layers,
                    "capped_blocks": serve.capped_blocks, "bound_blocks": serve.bound_blocks,
                    "working_set_blocks": spec.working_set_blocks(BLOCK_SIZE), "block_size": BLOCK_SIZE,
                    "ideal_cold_hits": ideal_hits(spec, BLOCK_SIZE, warm=False),
                    "ideal_warm_hits": ideal_hits(spec, BLOCK_SIZE, warm=True), "runs": serve.runs,
                    "enforce_eager": serve.enforce_eager, "codec": serve.codec, "load_mode": serve.load_mode,
                    "warm_passes": serve.warm_passes, "paired": serve.paired, "bound_connector": bound_connector()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "elapsed_s": round(elapsed_s, 1),
        "rows": by_row,
        "runs": all_runs,
        "targets": targets(by_row),
    }


def format_table(report: dict[str, Any]) -> str:
    """One line per row (medians), then recovered hits and req/s ratios."""
    o = report["options"]
    ws = o["working_set_blocks"]
    lines = [f"{o['conversations']} conversations x {o['turns']} turns of {o['turn_tokens']} tokens + "
             f"{o['output_tokens']}-token answers, concurrency {o['concurrency']}, seed {o['seed']}; "
             f"{o['layers']}-layer Llama bf16, block {o['block_size']}; capped {o['capped_blocks']} blocks "
             f"(working set {ws}: {ws / o['capped_blocks']:.1f}x), bound {o['bound_blocks']}; median of "
             f"{o['runs']} run(s); ucm-db codec {o['codec']}, load_mode {o['load_mode']}"
             + ("; --enforce-eager" if o["enforce_eager"] else "")
             + (f"; {o['warm_passes']} paired warm passes (both servers up, in turns)" if o.get("paired") else "")
             + bound_note(o.get("bound_connector", "none")),
             f"prefix hits a cache that forgets nothing gets: {o['ideal_cold_hits']} tokens first pass, "
             f"{o['ideal_warm_hits']} second pass", "",
             f"{'setup':<46} {'req/s':>6} {'TTFT p50':>9} {'p99 ms':>7} {'vLLM hits':>10} {'ucm-db hits':>12}"]
    for row, label in ROWS.items():
        if row in report["rows"]:
            r = report["rows"][row]
            h = r["hits"]
            ucm = f"{h['ucm_hit_tokens']:>12.0f}" if "ucm_db" in r else f"{'-':>12}"
            lines.append(f"{label:<46} {r['request_throughput']:>6.2f} {r['median_ttft_ms']:>9.0f} "
                         f"{r['p99_ttft_ms']:>7.0f} {h['vllm_hits']:>10.0f} {ucm}")
    lines.append("")
    for t in report["targets"]:
        verdict = "" if t["met"] is None else ("met" if t["met"] else "MISSED")
        lines.append(f"{t['row']:<15} / {t['bound']:<11} recovered hits {t['recovered_hits']:>7.2%} (>= {HITS_TARGET:.0%}), "
                     f"req/s {t['rps_ratio']:.3f}x (>= {RPS_TARGET}) {verdict}")
    load = ", ".join(f"{x:.2f}" for x in report["machine"]["load_avg_at_end"])
    lines.append(f"\n{report['machine']['cpus']} CPUs, load average at end {load}; {report['elapsed_s']} s")
    return "\n".join(lines)


def conversation_command(rows: tuple[str, ...] | None, conversations: int, turns: int, turn_tokens: int,
                         output_tokens: int, concurrency: int, seed: int, serve: ServeOptions, as_json: bool) -> None:
    """``ucm-db bench serve --workload conversation``: checks the sizes
    (usage errors before any server starts), runs, prints the report."""
    import json

    import click

    wanted = rows or tuple(ROWS)
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise click.BadParameter(f"unknown row(s) {', '.join(unknown)} for --workload conversation; choose from "
                                 f"{', '.join(ROWS)}", param_hint="--rows")
    if serve.paired and not serve_paired.PAIR_ROWS <= set(wanted):
        raise click.BadParameter(serve_paired.MISSING_PAIR, param_hint="--paired")
    spec = ConversationSpec(conversations=conversations, turns=turns, turn_tokens=turn_tokens,
                            output_tokens=output_tokens, concurrency=concurrency, seed=seed)
    options = ChatOptions(spec=spec, serve=replace(serve, rows=wanted))
    for name, blocks in (("--capped-blocks", serve.capped_blocks), ("--bound-blocks", serve.bound_blocks)):
        if blocks * BLOCK_SIZE < options.max_model_len:
            raise click.BadParameter(f"{blocks} blocks cannot hold one conversation's last turn "
                                     f"({options.max_model_len} tokens)", param_hint=name)
    report_ = run(options, progress=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(report_, indent=2) if as_json else format_table(report_))
