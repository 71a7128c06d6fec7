"""The prefill/decode benchmark: ``ucm-db bench pd`` (issue 11, item 7).

Three figures, each on the same 2K-token prompts (random token ids; the first
prompt of every setup is a warm-up, reported but left out of the medians):

* **consumer** -- a ``kv_producer`` engine prefills each prompt
  (``max_tokens=1``) and publishes its blocks to a store directory; then a
  ``kv_consumer`` engine (a new process on the same store) serves each prompt
  with the producer's ``kv_transfer_params`` (TTFT: ``max_tokens=1``) and
  then recomputes the same prompt under a salt (no hit). Target: consumer
  TTFT <= 0.25x of recomputing.
* **publish** -- the producer's publication wait per request: the in-step
  commit (``ucm_db_publish_wait_seconds``, read per request from vLLM's
  metrics, :mod:`.pd_engine`) to the local store, and with
  ``publish="remote"`` to a ``file://`` remote (commit and upload). Target:
  <= 50 ms at the median to the local store.
* **serve** -- end-to-end TTFT at a streaming client through the PD proxy
  (prefill and decode OpenAI servers) against one OpenAI server without a
  connector (:mod:`.pd_serve`).

Invariants:
    * Every engine and server runs in its own process, one setup after
      another (the producer finishes before the consumer starts, so the two
      never share the cores during a timed request), all with the same CPU
      layout (``VLLM_CPU_NUM_OF_RESERVED_CPU``, see
      docs/vllm-cpu-connector-effect.md).
    * The load average is recorded before and after each part: on a shared
      host it says how much the figures are worth.
    * A consumer that hits fewer tokens than the published blocks promise
      (a read-after-write miss) is reported, never hidden: the ratio would
      be meaningless without its hits.
    * Verdicts are computed from this run's figures, never hard-coded.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.cpu_dtype import fast_dtype
from ucm_db.tools.bench.pd_engine import BLOCK_SIZE, start_job
from ucm_db.tools.bench.serve_model import VOCAB_SIZE, build_serve_model

CONSUMER_RATIO_TARGET = 0.25
PUBLISH_WAIT_TARGET_MS = 50.0
#: VLLM_CPU_NUM_OF_RESERVED_CPU of every engine: one model thread, as the other engine benchmarks.
RESERVED_CPUS = 1
JOB_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class PdOptions:
    """Sizes and parts of one run (the command's options)."""

    prompts: int = 4
    tokens: int = 2048
    layers: int = 8
    codec: str | None = None
    remote: bool = True
    serve: bool = True
    serve_max_tokens: int = 4
    eager: bool = True
    seed: int = 11
    keep: Path | None = None

    @property
    def max_model_len(self) -> int:
        return self.tokens + 64


def make_prompts(seed: int, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of random token ids, none of them special (ids 0-3)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB_SIZE) for _ in range(tokens)] for _ in range(count)]


def expected_hit_tokens(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Tokens a consumer loads: every full block but the one holding the last token."""
    return (tokens - 1) // block_size * block_size


def median_after_warmup(values: list[float]) -> float:
    """The median without the first (warm-up) value; the only value if there is one."""
    kept = values[1:] or values
    return float(statistics.median(kept))


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _ms(values: list[float]) -> list[float]:
    return [round(1e3 * v, 1) for v in values]


def _run_jobs(specs: list[tuple[str, dict[str, Any]]], work: Path, progress: Any) -> dict[str, dict[str, Any]]:
    """Each engine job in turn (a new process each); results by name."""
    results = {}
    for name, spec in specs:
        progress(f"{name}: engine job ({len(spec['prompts'])} prompts) ...")
        results[name] = start_job(spec, work, name).wait(JOB_TIMEOUT_S)
        results[name].pop("log", None)
    return results


def run_offline(options: PdOptions, model: Path, prompts: list[list[int]], work: Path, progress: Any) -> dict[str, Any]:
    """Producer then consumer on one store; then a producer publishing to a ``file://`` remote."""
    common = {"model": str(model), "prompts": prompts, "max_tokens": 1, "max_model_len": options.max_model_len,
              "dtype": fast_dtype().dtype, "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(RESERVED_CPUS)}}
    codec = {"codec": options.codec} if options.codec else {}
    local = {"path": str(work / "store"), **codec}
    jobs = [
        ("producer", {**common, "role": "kv_producer", "reference": False, "stats": True,
                      "params_out": str(work / "params.jsonl"), "connector": local}),
        ("consumer", {**common, "role": "kv_consumer", "params_in": str(work / "params.jsonl"), "compare_recompute": True,
                      "connector": {**local, "load_deadline_s": 30}}),
    ]
    if options.remote:
        remote = {"path": str(work / "store-r"), "remote": f"file://{work / 'remote'}", "publish": "remote", **codec}
        jobs.append(("producer_remote", {**common, "role": "kv_producer", "reference": False, "stats": True,
                                         "params_out": str(work / "params-r.jsonl"), "connector": remote}))
    for name in ("params.jsonl", "params-r.jsonl"):
        (work / name).unlink(missing_ok=True)  # a kept work directory: no stale announcements
    loads = {"before": _load()}
    results = _run_jobs(jobs, work, progress)
    loads["after"] = _load()
    results["load_avg"] = loads
    return results


def summarise(options: PdOptions, offline: dict[str, Any], serving: dict[str, Any] | None) -> dict[str, Any]:
    """The report: figures, ratios and verdicts from the raw per-request results."""
    used, made = offline["consumer"], offline["producer"]
    consumer_s, recompute_s = median_after_warmup(used["latency_s"]), median_after_warmup(used["recompute_latency_s"])
    ratio = consumer_s / recompute_s
    expected = expected_hit_tokens(options.tokens)
    report: dict[str, Any] = {
        "prompts": options.prompts, "prompt_tokens": options.tokens, "block_size": BLOCK_SIZE,
        "model": f"llama {options.layers} layers x 768 hidden, {fast_dtype().dtype}, random weights",
        "dtype": fast_dtype().reason,
        "codec": options.codec or "store default", "load_avg_offline": offline["load_avg"],
        "consumer": {
            "ttft_ms": _ms(used["latency_s"]), "recompute_ttft_ms": _ms(used["recompute_latency_s"]),
            "median_ttft_ms": round(1e3 * consumer_s, 1), "median_recompute_ms": round(1e3 * recompute_s, 1),
            "ratio": round(ratio, 3), "target": CONSUMER_RATIO_TARGET, "met": ratio <= CONSUMER_RATIO_TARGET,
            "cached_tokens": used["cached"], "expected_hit_tokens": expected,
            "every_published_block_hit": all(c >= expected for c in used["cached"]),
        },
        "publish": {"local": _publish(made, options)},
    }
    if "producer_remote" in offline:
        report["publish"]["remote"] = _publish(offline["producer_remote"], options)
    if serving is not None:
        report["serve"] = _serving(serving, expected)
    return report


def _publish(result: dict[str, Any], options: PdOptions) -> dict[str, Any]:
    median_ms = 1e3 * median_after_warmup(result["publish_wait_s"])
    blocks = [int((p or {}).get("ucm_db", {}).get("blocks", 0)) for p in result["params"]]
    return {"wait_ms": _ms(result["publish_wait_s"]), "median_wait_ms": round(median_ms, 1),
            "target_ms": PUBLISH_WAIT_TARGET_MS, "met": median_ms <= PUBLISH_WAIT_TARGET_MS,
            "producer_ttft_ms": _ms(result["latency_s"]), "median_producer_ttft_ms": round(1e3 * median_after_warmup(result["latency_s"]), 1),
            "published_blocks": blocks, "full_prompt_blocks": options.tokens // BLOCK_SIZE,
            "remote_files": result.get("remote_files", 0),
            # the wait's parts: the copy out of the KV cache, the writer's encode + commit (and upload)
            **{f"median_{key[:-2]}_ms": round(1e3 * median_after_warmup(result[key]), 1)
               for key in ("save_copy_s", "save_commit_s") if result.get(key)}}


def _serving(serving: dict[str, Any], expected: int) -> dict[str, Any]:
    pd, single = serving["pd"], serving["single"]
    pd_s = median_after_warmup([r["ttft_s"] for r in pd])
    single_s = median_after_warmup([r["ttft_s"] for r in single])
    prefill = [r["prefill_ms"] for r in pd if r["prefill_ms"] is not None]
    return {
        "pd_ttft_ms": _ms([r["ttft_s"] for r in pd]), "single_ttft_ms": _ms([r["ttft_s"] for r in single]),
        "median_pd_ms": round(1e3 * pd_s, 1), "median_single_ms": round(1e3 * single_s, 1), "ratio": round(pd_s / single_s, 3),
        "proxy_prefill_ms": prefill, "median_proxy_prefill_ms": round(median_after_warmup(prefill), 1) if prefill else None,
        "prefill_status": [r["prefill"] for r in pd], "decode_cached_tokens": [r["cached_tokens"] for r in pd],
        "expected_hit_tokens": expected,
        "same_text_as_single": [a["text"] == b["text"] for a, b in zip(pd, single)],
        "load_avg": serving["load_avg"],
    }


def run(options: PdOptions, progress: Any) -> dict[str, Any]:
    """Every part in its own processes; returns the report."""
    from ucm_db.tools.bench.pd_serve import run_serving

    started = time.monotonic()
    model = build_serve_model(options.layers)
    prompts = make_prompts(options.seed, options.prompts, options.tokens)
    with tempfile.TemporaryDirectory(prefix="ucm-db-bench-pd-") as tmp:
        work = Path(tmp)
        if options.keep is not None:  # stores, specs and every engine's log, kept for a look afterwards
            work = options.keep
            work.mkdir(parents=True, exist_ok=True)
        offline = run_offline(options, model, prompts, work, progress)
        serving = None
        if options.serve:
            before = _load()
            serving = run_serving(model, prompts, work, max_model_len=options.max_model_len, max_tokens=options.serve_max_tokens,
                                  enforce_eager=options.eager, start_timeout_s=1200.0, progress=progress)
            serving["load_avg"] = {"before": before, "after": _load()}
    report = summarise(options, offline, serving)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of a report."""
    c, lines = report["consumer"], []
    verdict = {True: "met", False: "NOT met"}
    lines.append(f"PD, {report['prompts']} prompts of {report['prompt_tokens']} tokens (first left out), {report['model']}, "
                 f"block {report['block_size']}, codec {report['codec']}; load avg {report['load_avg_offline']}")
    lines.append(f"(a) consumer TTFT {c['median_ttft_ms']:.1f} ms vs recompute {c['median_recompute_ms']:.1f} ms: "
                 f"{c['ratio']:.3f}x (target <= {c['target']}: {verdict[c['met']]})")
    lines.append(f"    per prompt ms: consumer {c['ttft_ms']}, recompute {c['recompute_ttft_ms']}; cached tokens {c['cached_tokens']}"
                 f" (expected {c['expected_hit_tokens']})")
    for where, p in report["publish"].items():
        lines.append(f"(b) publication wait, {where}: median {p['median_wait_ms']:.1f} ms per request"
                     + (f" (target <= {p['target_ms']:.0f} ms: {verdict[p['met']]})" if where == "local" else "")
                     + (f" (copy {p['median_save_copy_ms']:.1f} ms, encode + commit {p['median_save_commit_ms']:.1f} ms)"
                        if "median_save_commit_ms" in p else "")
                     + f"; per request {p['wait_ms']}; producer TTFT median {p['median_producer_ttft_ms']:.1f} ms;"
                     f" blocks published {p['published_blocks'][-1]} of {p['full_prompt_blocks']}")
    if "serve" in report:
        s = report["serve"]
        lines.append(f"(c) end-to-end TTFT through the proxy {s['median_pd_ms']:.1f} ms vs one server without a connector "
                     f"{s['median_single_ms']:.1f} ms: {s['ratio']:.3f}x; load avg {s['load_avg']}")
        lines.append(f"    per prompt ms: PD {s['pd_ttft_ms']}, single {s['single_ttft_ms']}; proxy prefill ms {s['proxy_prefill_ms']};"
                     f" decode cached tokens {s['decode_cached_tokens']}; same text {s['same_text_as_single']}")
    lines.append(f"elapsed {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


@click.command("pd", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prompts", type=click.IntRange(min=2), default=4, show_default=True, help="prompts per setup (the first is a warm-up)")
@click.option("--tokens", type=click.IntRange(min=64), default=2048, show_default=True, help="prompt length")
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True, help="layers of the random-weight Llama (hidden 768)")
@click.option("--codec", type=click.Choice(["none", "zstd"]), default=None, help="store codec (default: the store's default)")
@click.option("--remote/--no-remote", default=True, show_default=True, help="also publish to a file:// remote")
@click.option("--serve/--no-serve", default=True, show_default=True, help="also measure end-to-end TTFT through the proxy")
@click.option("--eager/--compiled", default=True, show_default=True, help="servers with --enforce-eager (faster start)")
@click.option("--seed", type=int, default=11, show_default=True, help="prompt seed")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="work directory to keep (stores, logs); default: a temporary one, removed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def command(as_json: bool, **sizes: Any) -> None:
    """Prefill/decode: consumer TTFT vs recompute, the producer's publication wait, TTFT through the proxy (real vLLM on CPU).

    \b
    Example:
        ucm-db bench pd --prompts 4 --tokens 2048
        ucm-db bench pd --no-serve --no-remote --prompts 3
    """
    report = run(PdOptions(**sizes), lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
