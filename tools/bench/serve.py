"""The serving benchmark: ``ucm-db bench serve`` (issue 13, item 1).

Three workloads: ``prefix_repetition`` (this module, below), ``conversation``
(multi-turn chats whose prompts grow a turn at a time: :mod:`.serve_chat`) and
``no-reuse`` (unique random prompts, ucm-db on against off: :mod:`.serve_noreuse`).

vLLM's OpenAI server on CPU (a random-weight Llama with a local tokenizer,
:mod:`.serve_model`) driven by vLLM's own load generator, ``vllm bench
serve --dataset-name prefix_repetition`` (:mod:`.serve_server`), in these
rows ("capped": the engine's KV cache is ``--capped-blocks``, smaller than
the working set; "bound": ``--bound-blocks``, which holds all of it):

==========================  ===================================================
no-conn-capped              no connector, capped, first pass
cold-bound                  no connector, bound, first pass
warm-bound                  the same server, second pass (same requests)
ucm-first                   ucm-db, capped, first pass (store empty)
ucm-second                  the same server, second pass (store warm)
ucm-restart                 a new server on the warm store (vLLM's cache empty)
ucm-remote                  a new server, empty local tier over the warm
                            ``file://`` remote the servers above wrote
==========================  ===================================================

Targets (issue 13): ucm-first >= 0.97x cold-bound request throughput;
ucm-second and ucm-restart >= 1.0x warm-bound; ucm-remote >= 0.8x warm-bound.

Invariants:
    * Each row's servers start fresh (a new process: vLLM's prefix cache
      and the connector's state are empty) except the second passes, which
      replay the same requests (same ``--seed``) on the same server.
    * With ``--paired`` the bound's and ucm-db's servers stay up together
      and their warm passes run in turns; ucm-second / warm-bound is the
      median of the pairs' ratios (:mod:`.serve_paired`).
    * Each of ``--runs`` repetitions uses new, empty stores; a row's figure
      is the median over runs, and every run is kept (``--json``).
    * A pass that does not complete every request stops the benchmark.
    * Verdicts are computed from this run's figures, never hard-coded.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench import serve_paired
from ucm_db.tools.bench.serve_options import REMOTE_ROWS, ROWS, WARM_ROWS, Progress, ServeOptions, pass_counters, repeated_row
from ucm_db.tools.bench.serve_options import connector_options as _connector
from ucm_db.tools.bench.serve_options import medians as _medians
from ucm_db.tools.bench.serve_server import BLOCK_SIZE, LoadSpec, Server, ServerSpec, bound_connector, bound_note, bound_spec, run_load

#: row -> (baseline row, bound on row / baseline request throughput).
TARGETS = {
    "ucm-first": ("cold-bound", 0.97),
    "ucm-second": ("warm-bound", 1.0),
    "ucm-restart": ("warm-bound", 1.0),
    "ucm-remote": ("warm-bound", 0.8),
    "ucm-remote-s3": ("warm-bound", 0.8),
}
#: What each row's result keeps from ``vllm bench serve``'s saved result.
KEPT = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_e2el_ms", "duration")


def _pass(options: ServeOptions, server: Server, model: Path, work: Path, name: str, progress: Progress) -> dict[str, Any]:
    started = time.perf_counter()
    before = server.connector_counters()
    result = run_load(options.load, server, model, work, name)
    after = server.connector_counters()
    kept: dict[str, Any] = {key: float(result[key]) for key in KEPT if key in result}
    note = ""
    if before or after:
        kept["ucm_db"] = pass_counters(before, after)
        ucm = kept["ucm_db"]
        note = (f"; ucm-db: {ucm['hit_tokens']:.0f} of {ucm['query_tokens']:.0f} looked-up tokens loaded, "
                f"{ucm['loaded_MB']:.0f} MB in {ucm['load_s']:.1f} s, {ucm['cost_skips']:.0f} cost skips, "
                f"{ucm['saved_MB']:.0f} MB saved (commit {ucm['save_commit_s']:.2f} s, {ucm['save_commit_cpu_s']:.2f} s of CPU; "
                f"copy {ucm['save_copy_s']:.2f} s)")
    progress(f"  {name}: {kept.get('request_throughput', 0):.2f} req/s, TTFT p50 {kept.get('median_ttft_ms', 0):.0f} ms, "
             f"p99 {kept.get('p99_ttft_ms', 0):.0f} ms ({time.perf_counter() - started:.0f} s){note}")
    return kept


def run_once(options: ServeOptions, model: Path, work: Path, progress: Progress) -> dict[str, dict[str, Any]]:
    """Every wanted row once, with new stores under ``work``."""
    rows: dict[str, dict[str, Any]] = {}
    want = set(options.rows)
    capped = ServerSpec(model, options.capped_blocks, options.max_model_len, enforce_eager=options.enforce_eager)
    store, remote = work / "store", work / "remote"
    # The write-back remote only where a row reads it (or --write-back asks):
    # its uploads take CPU from the two cores every row is measured on.
    ucm = replace(capped, connector=_connector(store, remote.as_uri() if options.uses_remote else None, options))

    def serve(spec: ServerSpec, label: str, passes: tuple[str, ...]) -> None:
        if not want & set(passes):
            return
        progress(f"starting the server for {label}")
        with Server(spec, work / f"{label}.server.log", start_timeout_s=options.start_timeout_s) as server:
            progress(f"  healthy after {server.start_s:.0f} s")
            for row in passes:
                repeats = options.warm_passes if row in WARM_ROWS else 1
                rows[row] = repeated_row([_pass(options, server, model, work, row, progress) for _ in range(repeats)])
                rows[row]["server_start_s"] = server.start_s

    serve(capped, "no-conn-capped", ("no-conn-capped",))
    bound = bound_spec(capped, options.bound_blocks)
    if options.paired:  # the command checked that both warm rows are wanted
        rows.update(serve_paired.paired_rows(
            bound, ucm, options.warm_passes, want,
            lambda spec, label: Server(spec, work / f"{label}.server.log", start_timeout_s=options.start_timeout_s),
            lambda server, row: _pass(options, server, model, work, row, progress), repeated_row, progress))
    else:
        serve(bound, "bound", ("cold-bound", "warm-bound"))
        serve(ucm, "ucm", ("ucm-first", "ucm-second"))
    serve(ucm, "ucm-restart", ("ucm-restart",))
    if want & REMOTE_ROWS:
        _drain_uploads(store, remote, progress)
        serve(replace(capped, connector=_connector(work / "empty-local", remote.as_uri(), options)), "ucm-remote", ("ucm-remote",))
    if "ucm-remote-s3" in want:
        from ucm_db.tools.bench.remote import MotoS3

        with MotoS3() as s3:
            started = time.perf_counter()
            url = _copy_to_s3(remote, s3.options, s3.bucket)
            progress(f"  remote copied to {url} in {time.perf_counter() - started:.1f} s")
            link_mb_s = _raw_read_mb_s(url, s3.options)
            progress(f"  raw read of the bucket (s3fs cat, concurrent): {link_mb_s:.1f} MB/s")
            s3_connector = _connector(work / "empty-local-s3", url, options, remote_options=s3.options)
            serve(replace(capped, connector=s3_connector), "ucm-remote-s3", ("ucm-remote-s3",))
            rows["ucm-remote-s3"]["link_raw_read_mb_s"] = link_mb_s
    return rows


def _copy_to_s3(remote: Path, s3_options: dict[str, Any], bucket: str) -> str:
    """Copies the warm ``file://`` remote into the moto bucket, object for
    object (the same relative paths); returns the S3 remote's URL."""
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True)
    for path in sorted(p for p in remote.rglob("*") if p.is_file()):
        fs.pipe_file(f"{bucket}/kv/{path.relative_to(remote).as_posix()}", path.read_bytes())
    return f"s3://{bucket}/kv"


def _raw_read_mb_s(url: str, s3_options: dict[str, Any], max_bytes: int = 64 << 20) -> float:
    """MB/s of plain s3fs reads of the bucket's objects (up to ``max_bytes``
    of them, fetched concurrently by one ``cat`` call): what the link gives
    before ucm-db does anything, the scale the ``ucm-remote-s3`` row is read
    against (moto serves a few MB/s on a 2-core host)."""
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options, skip_instance_cache=True)
    chosen, total = [], 0
    for path, info in sorted(fs.find(url, detail=True).items()):
        if total >= max_bytes:
            break
        chosen.append(path)
        total += int(info["size"])
    started = time.perf_counter()
    read = sum(len(blob) for blob in fs.cat(chosen).values())
    return read / (time.perf_counter() - started) / 1e6


def _drain_uploads(store: Path, remote: Path, progress: Progress) -> None:
    """Finishes the warm store's write-back queue, so the remote holds every block."""
    import ucm_db

    started = time.perf_counter()
    with ucm_db.open(store, remote=remote.as_uri()) as opened:
        opened.flush(upload_timeout_s=600.0)
    n_objects = sum(1 for p in remote.rglob("*") if p.is_file())
    progress(f"  remote upload queue drained in {time.perf_counter() - started:.1f} s ({n_objects} remote files)")
    if n_objects == 0:
        raise RuntimeError(f"the remote {remote} is empty after the ucm-db rows: the ucm-remote row would measure nothing")


def run(options: ServeOptions, progress: Progress) -> dict[str, Any]:
    """All runs; returns the report (medians, every run, targets)."""
    from ucm_db.tools.bench.serve_model import build_serve_model

    if options.capped_blocks * BLOCK_SIZE < options.max_model_len:
        raise ValueError(f"--capped-blocks {options.capped_blocks} cannot hold one request "
                         f"({options.max_model_len} tokens = {options.max_model_len // BLOCK_SIZE} blocks)")
    started = time.time()
    if options.scratch_dir is not None:
        Path(options.scratch_dir).mkdir(parents=True, exist_ok=True)
    model = build_serve_model(options.layers)
    all_runs: list[dict[str, dict[str, Any]]] = []
    for index in range(options.runs):
        work = Path(tempfile.mkdtemp(prefix="ucm-bench-serve-", dir=options.scratch_dir))
        progress(f"run {index + 1}/{options.runs} in {work}")
        try:
            all_runs.append(run_once(options, model, work, progress))
        finally:
            if os.environ.get("UCM_DB_BENCH_KEEP") != "1":
                shutil.rmtree(work, ignore_errors=True)
    return _report(options, all_runs, time.time() - started)


def _report(options: ServeOptions, all_runs: list[dict[str, dict[str, Any]]], elapsed_s: float) -> dict[str, Any]:
    medians: dict[str, dict[str, float]] = {}
    for row in ROWS:
        per_run = [r[row] for r in all_runs if row in r]
        if per_run:
            medians[row] = _medians(per_run)
    targets = []
    for row, (base, bound) in TARGETS.items():
        if row in medians and base in medians:
            ratio, paired = serve_paired.throughput_ratio(medians[row], medians[base])
            label = f"{row} / {base} req/s" + (", paired" if paired else "")
            targets.append({"target": label, "measured": round(ratio, 3), "bound": f">= {bound}", "met": ratio >= bound})
    load = options.load
    return {
        "options": {"num_prompts": load.num_prompts, "num_prefixes": load.num_prefixes, "prefix_len": load.prefix_len,
                    "suffix_len": load.suffix_len, "output_len": load.output_len, "concurrency": load.concurrency,
                    "seed": load.seed, "layers": options.layers, "capped_blocks": options.capped_blocks,
                    "bound_blocks": options.bound_blocks, "working_set_blocks": options.working_set_blocks,
                    "runs": options.runs, "block_size": BLOCK_SIZE, "enforce_eager": options.enforce_eager,
                    "codec": options.codec, "load_mode": options.load_mode, "remote_lookup": options.remote_lookup,
                    "write_back": options.uses_remote, "warm_passes": options.warm_passes, "paired": options.paired,
                    "bound_connector": bound_connector()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "elapsed_s": round(elapsed_s, 1),
        "rows": medians,
        "runs": all_runs,
        "targets": targets,
    }


def format_table(report: dict[str, Any]) -> str:
    """The issue's table: one line per row (medians), then the targets."""
    o = report["options"]
    lines = [f"{o['num_prompts']} requests, {o['num_prefixes']} prefixes of {o['prefix_len']} + {o['suffix_len']}-token "
             f"suffixes, {o['output_len']} output tokens, concurrency {o['concurrency']}, seed {o['seed']}; "
             f"{o['layers']}-layer Llama bf16, block {o['block_size']}; capped {o['capped_blocks']} blocks "
             f"(working set {o['working_set_blocks']}: {o['working_set_blocks'] / o['capped_blocks']:.1f}x), "
             f"bound {o['bound_blocks']}; median of {o['runs']} run(s); ucm-db codec {o.get('codec', 'zstd')}, "
             f"load_mode {o.get('load_mode', 'block')}, remote_lookup {o.get('remote_lookup', 'inline')}"
             # Reports from before the option always wrote back.
             + ("; write-back to a file:// remote" if o.get("write_back", True) else "; local tier only")
             + ("; --enforce-eager" if o["enforce_eager"] else "")
             + (f"; {o['warm_passes']} passes of each warm row" if o.get("warm_passes", 1) > 1 else "")
             + ("; warm passes paired (both servers up, in turns)" if o.get("paired") else "") + bound_note(o.get("bound_connector", "none")),
             "", f"{'setup':<58} {'req/s':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}  ucm-db loaded / looked up, skips"]
    for row, label in ROWS.items():
        if row in report["rows"]:
            r = report["rows"][row]
            ucm = r.get("ucm_db")
            did = f"  {ucm['hit_tokens']:.0f} / {ucm['query_tokens']:.0f} tokens, {ucm['cost_skips']:.0f}" if ucm else ""
            if "pass_throughputs" in r:
                did += "  passes: " + ", ".join(f"{x:.2f}" for x in r["pass_throughputs"])
            if "paired_ratios" in r:
                did += "  paired ratios: " + ", ".join(f"{x:.3f}" for x in r["paired_ratios"])
            lines.append(f"{label:<58} {r['request_throughput']:>7.2f} {r['median_ttft_ms']:>12.0f} {r['p99_ttft_ms']:>12.0f}{did}")
    if "link_raw_read_mb_s" in report["rows"].get("ucm-remote-s3", {}):
        lines.append(f"S3 (moto) raw read of the bucket: {report['rows']['ucm-remote-s3']['link_raw_read_mb_s']:.1f} MB/s")
    lines.append("")
    for t in report["targets"]:
        lines.append(f"{t['target']:<40} {t['measured']:>7.3f}  {t['bound']:<7} {'met' if t['met'] else 'MISSED'}")
    load = ", ".join(f"{x:.2f}" for x in report["machine"]["load_avg_at_end"])
    lines.append(f"\n{report['machine']['cpus']} CPUs, load average at end {load}; {report['elapsed_s']} s")
    return "\n".join(lines)


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--num-prompts", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--num-prefixes", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prefix-len", type=click.IntRange(min=BLOCK_SIZE), default=2048, show_default=True, help="tokens")
@click.option("--suffix-len", type=click.IntRange(min=1), default=64, show_default=True, help="tokens")
@click.option("--output-len", type=click.IntRange(min=1), default=16, show_default=True, help="tokens")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True, help="layers of the random Llama")
@click.option("--capped-blocks", type=click.IntRange(min=1), default=256, show_default=True, help="KV blocks of the capped engines")
@click.option("--bound-blocks", type=click.IntRange(min=1), default=1200, show_default=True, help="KV blocks of the bound engine")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True, help="repetitions (medians reported)")
@click.option("--warm-passes", type=click.IntRange(min=1), default=1, show_default=True,
              help="passes of warm-bound and ucm-second on their warm server (medians kept, every pass's req/s listed)")
@click.option("--paired", is_flag=True,
              help="keep the bound's and ucm-db's servers up together and run their --warm-passes in turns (ABBA); "
              "ucm-second / warm-bound is then the median of each pair's ratio (needs both rows)")
@click.option("--rows", default=",".join(ROWS), show_default=True, help="comma-separated rows to run")
@click.option("--codec", type=click.Choice(["zstd", "none"]), default="zstd", show_default=True,
              help="codec of the ucm-db rows' local tier (the store's `codec`; the remote keeps its own, `remote_codec`)")
@click.option("--load-mode", type=click.Choice(["block", "layer", "async"]), default="block", show_default=True,
              help="the ucm-db rows' connector load_mode")
@click.option("--remote-lookup", type=click.Choice(["inline", "background"]), default="inline", show_default=True,
              help="the ucm-db rows' connector remote_lookup")
@click.option("--write-back", is_flag=True,
              help="the ucm-db rows upload to a file:// remote even when no remote row reads it (on whenever one does)")
@click.option("--enforce-eager", is_flag=True, help="vLLM without torch.compile (every server alike): faster starts")
@click.option("--start-timeout-s", type=click.FloatRange(min=1), default=1200.0, show_default=True,
              help="longest wait for a server to become healthy")
@click.option("--workload", type=click.Choice(["prefix_repetition", "conversation", "no-reuse"]), default="prefix_repetition",
              show_default=True, help="conversation: multi-turn chats (--conversations, --turns, --turn-tokens; "
              "--output-len is each answer, --concurrency the requests in flight); no-reuse: unique random prompts, "
              "ucm-db on (--codecs) against off, --pairs rounds (--num-prompts a pass, --prompt-len, --capped-blocks every server's cap)")
@click.option("--prompt-len", type=click.IntRange(min=BLOCK_SIZE), default=2048, show_default=True,
              help="no-reuse workload: tokens of each prompt")
@click.option("--codecs", default="none,zstd", show_default=True,
              help="no-reuse workload: comma-separated setups, one ucm-db server each: a codec (none, zstd), "
              "optionally +admitN or +admitauto for the connector's admit_after (e.g. none+admit2) and +proc for save_process; noop: a connector that does nothing")
@click.option("--store-capacity-mib", type=click.IntRange(min=64), default=16384, show_default=True, help="no-reuse workload: every ucm-db store's capacity_bytes in MiB (small: evicting from the start, as a full store does)")
@click.option("--pairs", type=click.IntRange(min=1), default=2, show_default=True,
              help="no-reuse workload: rounds of one pass per server, order alternated (ABBA)")
@click.option("--hidden", type=click.IntRange(min=256), default=768, show_default=True, help="width of the random Llama (a multiple of 256)")
@click.option("--conversations", type=click.IntRange(min=1), default=16, show_default=True, help="conversation workload")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True, help="conversation workload: turns each")
@click.option("--turn-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="conversation workload: tokens of each user message")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None, help="scratch directory (stores, logs)")
@click.option("--json", "as_json", is_flag=True, help="print the full report as JSON")
def command(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int, concurrency: int,
            seed: int, layers: int, capped_blocks: int, bound_blocks: int, runs: int, warm_passes: int, paired: bool, rows: str,
            codec: str, load_mode: str, remote_lookup: str, write_back: bool, enforce_eager: bool, start_timeout_s: float, workload: str,
            prompt_len: int, codecs: str, pairs: int, hidden: int, store_capacity_mib: int,
            conversations: int, turns: int, turn_tokens: int, scratch_dir: str | None, as_json: bool) -> None:
    """vLLM's OpenAI server on CPU with and without ucm-db, under `vllm bench serve` (prefix_repetition).

    Rows: no connector capped, cold and warm bounds, ucm-db first and second
    pass, after an engine restart, and an empty local tier over a warm
    file:// remote. The ucm-db rows write back to that remote only when a
    remote row is run (or --write-back): otherwise they measure the local
    tier alone, the embedded default. Each server start takes about a
    minute; the default size (the issue's) takes about an hour on 2 cores.
    Progress goes to stderr; targets are reported, not enforced.

    \b
    --workload conversation replays many multi-turn chats instead (each
    turn's prompt is the conversation so far, sent once the previous turn
    answered) in rows no-conn-capped, cold/warm bound, ucm-first/second and
    ucm-restart, and reports prefix hits recovered against the bound.

    \b
    Example:
        ucm-db bench serve --workload conversation --conversations 16 --turns 4 --capped-blocks 160 --bound-blocks 700
        ucm-db bench serve --num-prompts 32 --num-prefixes 8 --prefix-len 1024 --capped-blocks 144 --bound-blocks 600
        ucm-db bench serve --runs 3 --json
        ucm-db bench serve --rows cold-bound,warm-bound,ucm-first,ucm-second --warm-passes 3
        ucm-db bench serve --rows cold-bound,warm-bound,ucm-first,ucm-second --warm-passes 5 --paired
        ucm-db bench serve --workload no-reuse --layers 2 --hidden 256 --num-prompts 16 --capped-blocks 320 --enforce-eager
    """
    wanted = tuple(r.strip() for r in rows.split(",") if r.strip())
    if hidden % 256:
        raise click.BadParameter("must be a multiple of 256 (heads of 64, 4 KV heads)", param_hint="--hidden")
    if workload == "no-reuse":
        from ucm_db.tools.bench.serve_noreuse import no_reuse_command

        no_reuse_command(num_prompts, prompt_len, output_len, concurrency, seed, codecs, pairs, hidden,
                         ServeOptions(layers=layers, capped_blocks=capped_blocks, scratch_dir=scratch_dir,
                                      enforce_eager=enforce_eager, load_mode=load_mode, remote_lookup=remote_lookup,
                                      start_timeout_s=start_timeout_s, capacity_bytes=store_capacity_mib << 20), as_json)
        return
    if hidden != 768:
        raise click.BadParameter("only the no-reuse workload builds other widths", param_hint="--hidden")
    if workload == "conversation":
        if write_back:
            raise click.BadParameter("the conversation workload measures the local tier alone", param_hint="--write-back")
        if warm_passes > 1 and not paired:
            raise click.BadParameter("the conversation workload repeats warm passes only in pairs: add --paired",
                                     param_hint="--warm-passes")
        from ucm_db.tools.bench.serve_chat import conversation_command

        conversation_command(wanted if rows != ",".join(ROWS) else None, conversations, turns, turn_tokens, output_len,
                             concurrency, seed, ServeOptions(layers=layers, capped_blocks=capped_blocks,
                             bound_blocks=bound_blocks, runs=runs, scratch_dir=scratch_dir, enforce_eager=enforce_eager,
                             codec=codec, load_mode=load_mode, remote_lookup=remote_lookup, start_timeout_s=start_timeout_s,
                             warm_passes=warm_passes, paired=paired), as_json)
        return
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise click.BadParameter(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}", param_hint="--rows")
    if paired and not serve_paired.PAIR_ROWS <= set(wanted):
        raise click.BadParameter(serve_paired.MISSING_PAIR, param_hint="--paired")
    if num_prompts < num_prefixes:
        raise click.BadParameter("must be at least --num-prefixes (vLLM's prefix_repetition needs a prompt per prefix)",
                                 param_hint="--num-prompts")
    if num_prompts % num_prefixes:
        multiple = num_prompts // num_prefixes * num_prefixes
        raise click.BadParameter(f"must be a multiple of --num-prefixes ({num_prefixes}): vLLM's prefix_repetition sends "
                                 f"num_prompts // num_prefixes prompts per prefix, so {num_prompts} would send {multiple}",
                                 param_hint="--num-prompts")
    load = LoadSpec(num_prompts=num_prompts, num_prefixes=num_prefixes, prefix_len=prefix_len, suffix_len=suffix_len,
                    output_len=output_len, concurrency=concurrency, seed=seed)
    options = ServeOptions(load=load, layers=layers, capped_blocks=capped_blocks, bound_blocks=bound_blocks, runs=runs,
                           rows=wanted, scratch_dir=scratch_dir, enforce_eager=enforce_eager, codec=codec, load_mode=load_mode,
                           remote_lookup=remote_lookup, start_timeout_s=start_timeout_s, write_back=write_back,
                           warm_passes=warm_passes, paired=paired)
    if capped_blocks * BLOCK_SIZE < options.max_model_len:
        raise click.BadParameter(f"{capped_blocks} blocks cannot hold one request ({options.max_model_len} tokens)",
                                 param_hint="--capped-blocks")
    report = run(options, progress=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
