"""Runs the agentic workload (:mod:`.agentic_trace`'s requests) against
vLLM's OpenAI servers on CPU, in the conversation workload's rows
(:mod:`.serve_chat`: vLLM alone capped, cold and warm bound, ucm-db capped
first and second pass, ucm-db after a restart) on its servers.

The replay (:func:`replay`) sends a request once three things hold: its
``arrival_s`` (times ``time_scale``) has passed since the pass began, its
session's previous request has answered (a turn needs the last answer),
and fewer than ``concurrency`` requests are in flight. Among requests
waiting for a slot the earliest arrival goes first, so on a busy server the
generated sessions take turns: between two turns of one session every
other session runs a turn, and a capped cache evicts the session meanwhile.

Invariants:
    * Every request is a streamed ``/v1/completions`` of token ids with
      ``ignore_eos`` (:func:`.serve_chat_client._complete`): its answer has
      exactly ``output_len`` tokens, or the pass fails naming the request.
    * Every pass of a run sends the same token ids (the trace's, derived
      once); requests per second is completed requests over the pass's wall
      time; prefix hits are differences of the server's ``/metrics``
      counters (vLLM's own and ucm-db's) before and after the pass.
    * A pass records ``idle_s``, its seconds with no request in flight (the
      server waited for arrivals): a pass with much of it measured the
      trace's pace, not the server (``--time-scale 0`` sends at once).
    * A pass counts its ``short_turns``: requests whose cached prompt
      tokens (vLLM's ``cached_tokens``, local and connector hits alike)
      fell short of what a cache that forgets nothing serves
      (:func:`.agentic_trace.reusable_tokens`): in vLLM alone capped they
      are the turns whose session was evicted during its gap.
    * Servers, stores and medians as :mod:`.serve_chat`'s: fresh servers per
      row except second passes, new stores per run, verdicts from this
      run's figures; the ucm-db store is a local tier alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ucm_db.tools.bench import serve_chat, serve_paired
from ucm_db.tools.bench.agentic_trace import TraceRequest, request_tokens, reusable_tokens
from ucm_db.tools.bench.serve_chat_client import _complete, summarize
from ucm_db.tools.bench.serve_options import Progress, ServeOptions, connector_options, repeated_row
from ucm_db.tools.bench.serve_server import BLOCK_SIZE, SERVED_NAME, Server, ServerSpec, bound_spec

#: The serving model's positions (engine_pass.build_model's).
MODEL_POSITIONS = 8192


@dataclass(frozen=True)
class AgenticOptions:
    """One agentic run: the requests (arrival order), how their tokens are
    derived, how they are sent, and the servers' shared options."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int
    seed: int
    concurrency: int
    time_scale: float
    serve: ServeOptions

    @property
    def max_model_len(self) -> int:
        """The longest request and its answer, plus a block, in whole blocks."""
        longest = max(r.input_len + r.output_len for r in self.requests)
        return -(-(longest + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE


def agentic_model(layers: int, max_model_len: int) -> Path:
    """The serving model (:func:`.serve_model.build_serve_model`); where
    ``max_model_len`` is over its 8192 positions, a sibling directory with
    the same files (linked) and a config with positions raised to the next
    power of two (the weights do not depend on it)."""
    from ucm_db.tools.bench.serve_model import build_serve_model

    base = build_serve_model(layers)
    if max_model_len <= MODEL_POSITIONS:
        return base
    positions = 1 << (max_model_len - 1).bit_length()
    out = base.parent / f"{base.name}-pos{positions}"
    if (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(dir=base.parent))
    for item in base.iterdir():
        if item.name != "config.json":
            (tmp / item.name).symlink_to(item.resolve())
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tmp.rename(out)  # atomic: a half-made directory is never reused
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _Gate:
    """``slots`` requests in flight; a freed slot goes to the waiting
    request with the smallest key (arrival, index), not the longest waiting."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiting: list[tuple[tuple[float, int], asyncio.Future[None]]] = []

    @contextlib.asynccontextmanager
    async def slot(self, key: tuple[float, int]) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiting:
            self._free -= 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (key, future))
            await future  # the releasing request handed its slot over
        try:
            yield
        finally:
            if self._waiting:
                heapq.heappop(self._waiting)[1].set_result(None)
            else:
                self._free += 1


async def _replay(requests: list[TraceRequest], prompts: list[list[int]], reusable: list[int], base_url: str,
                  concurrency: int, time_scale: float, timeout_s: float) -> dict[str, Any]:
    import httpx

    by_session: dict[str, list[int]] = {}
    for index, r in enumerate(requests):
        by_session.setdefault(r.session, []).append(index)
    gate = _Gate(concurrency)
    ttfts_s: list[float] = [0.0] * len(requests)
    cached: list[int] = [0] * len(requests)
    url = base_url + "/v1/completions"
    in_flight, idle_s, idle_since = 0, 0.0, time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = idle_since = time.perf_counter()

        async def session(indices: list[int]) -> None:
            nonlocal in_flight, idle_s, idle_since
            for index in indices:  # in arrival order: each turn after the previous answered
                r = requests[index]
                wait_s = started + r.arrival_s * time_scale - time.perf_counter()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                async with gate.slot((r.arrival_s, index)):
                    if in_flight == 0:
                        idle_s += time.perf_counter() - idle_since
                    in_flight += 1
                    ttft_s, answered, cached[index] = await _complete(client, url, SERVED_NAME, prompts[index], r.output_len)
                    in_flight -= 1
                    if in_flight == 0:
                        idle_since = time.perf_counter()
                if answered != r.output_len or ttft_s < 0:
                    raise RuntimeError(f"request {index} (session {r.session}, arrival {r.arrival_s} s): {answered} of "
                                       f"{r.output_len} answer tokens (TTFT {ttft_s:.3f} s)")
                ttfts_s[index] = ttft_s

        await asyncio.gather(*(session(indices) for indices in by_session.values()))
        duration_s = time.perf_counter() - started
    result = summarize(ttfts_s, duration_s, sum(cached))
    result["short_turns"] = sum(1 for got, ideal in zip(cached, reusable) if got < ideal)
    result["reusable_tokens"] = float(sum(reusable))
    result["idle_s"] = round(idle_s, 3)
    return result


def replay(requests: list[TraceRequest], prompts: list[list[int]], reusable: list[int], base_url: str, *,
           concurrency: int, time_scale: float, timeout_s: float = 1800.0) -> dict[str, Any]:
    """One pass of every request against the server at ``base_url`` (see the module docstring)."""
    return asyncio.run(_replay(requests, prompts, reusable, base_url, concurrency, time_scale, timeout_s))


@dataclass(frozen=True)
class _Load:
    """What every pass of a run sends: token ids, and the ideal reuse of a first and a second pass."""

    requests: list[TraceRequest]
    prompts: list[list[int]]
    reusable_cold: list[int]
    reusable_warm: list[int]


def _pass(options: AgenticOptions, load: _Load, server: Server, name: str, progress: Progress) -> dict[str, Any]:
    reusable = load.reusable_warm if name in serve_chat.WARM_ROWS else load.reusable_cold
    kept, note = serve_chat.counted_pass(server, lambda: replay(load.requests, load.prompts, reusable, server.base_url,
                                                                concurrency=options.concurrency, time_scale=options.time_scale))
    progress(f"  {name}: {kept['request_throughput']:.3f} req/s, TTFT p50 {kept['median_ttft_ms']:.0f} ms, "
             f"p99 {kept['p99_ttft_ms']:.0f} ms, vLLM hits {kept['hits']['vllm_hits']:.0f} tokens, "
             f"{kept['short_turns']} short turns ({kept['duration']:.0f} s, {kept['idle_s']:.1f} s with none in flight){note}")
    return kept


def run_once(options: AgenticOptions, load: _Load, model: Path, work: Path, progress: Progress) -> dict[str, dict[str, Any]]:
    """Every wanted row once, with a new store under ``work``."""
    rows: dict[str, dict[str, Any]] = {}
    serve = options.serve
    want = set(serve.rows)
    capped = ServerSpec(model, serve.capped_blocks, options.max_model_len, enforce_eager=serve.enforce_eager)
    ucm = replace(capped, connector=connector_options(work / "store", None, serve))

    def open_server(spec: ServerSpec, label: str) -> Server:
        return Server(spec, work / f"{label}.server.log", start_timeout_s=serve.start_timeout_s)

    def rows_on(spec: ServerSpec, label: str, passes: tuple[str, ...]) -> None:
        if not want & set(passes):
            return
        progress(f"starting the server for {label}")
        with open_server(spec, label) as server:
            progress(f"  healthy after {server.start_s:.0f} s")
            for row in passes:
                rows[row] = {**_pass(options, load, server, row, progress), "server_start_s": server.start_s}

    rows_on(capped, "no-conn-capped", ("no-conn-capped",))
    bound = bound_spec(capped, serve.bound_blocks)
    if serve.paired:  # the command checked that both warm rows are wanted
        rows.update(serve_paired.paired_rows(bound, ucm, serve.warm_passes, want, open_server,
                                             lambda server, row: _pass(options, load, server, row, progress),
                                             repeated_row, progress))
    else:
        rows_on(bound, "bound", ("cold-bound", "warm-bound"))
        rows_on(ucm, "ucm", ("ucm-first", "ucm-second"))
    rows_on(ucm, "ucm-restart", ("ucm-restart",))
    return {row: rows[row] for row in serve_chat.ROWS if row in rows and row in want}


def run(options: AgenticOptions, progress: Progress) -> tuple[list[dict[str, dict[str, Any]]], float]:
    """All runs: every run's rows, and the seconds they took."""
    started = time.time()
    requests = list(options.requests)
    load = _Load(requests, request_tokens(requests, options.block_tokens, options.seed),
                 reusable_tokens(requests, options.block_tokens, BLOCK_SIZE, warm=False),
                 reusable_tokens(requests, options.block_tokens, BLOCK_SIZE, warm=True))
    if options.serve.scratch_dir is not None:
        Path(options.serve.scratch_dir).mkdir(parents=True, exist_ok=True)
    model = agentic_model(options.serve.layers, options.max_model_len)
    all_runs: list[dict[str, dict[str, Any]]] = []
    for index in range(options.serve.runs):
        work = Path(tempfile.mkdtemp(prefix="ucm-bench-agentic-", dir=options.serve.scratch_dir))
        progress(f"run {index + 1}/{options.serve.runs} in {work}")
        try:
            all_runs.append(run_once(options, load, model, work, progress))
        finally:
            if os.environ.get("UCM_DB_BENCH_KEEP") != "1":
                shutil.rmtree(work, ignore_errors=True)
    return all_runs, time.time() - started
