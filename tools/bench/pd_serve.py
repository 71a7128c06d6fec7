"""The PD benchmark's serving part: end-to-end TTFT through the PD proxy
(prefill ``kv_producer`` + decode ``kv_consumer`` OpenAI servers on one
store, ``python -m ucm_db.tools.proxy`` in front) against one OpenAI
server without a connector, same prompts, streamed.

Invariants:
    * TTFT is measured at the client: from sending the request to the first
      streamed event that carries a completion token (its ``text`` is not
      empty), one request at a time; the first request of each setup is a
      warm-up, reported but left out of the median.
    * Prompts are token-id lists (``/v1/completions`` takes them as they
      are), so every setup prefills exactly the same tokens.
    * Servers run through :class:`~ucm_db.tools.bench.serve_server.Server`
      (own process group, log file, SIGINT then SIGKILL), with the same CPU
      layout with and without a connector (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db.tools.bench.serve_server import SERVED_NAME, Server, ServerSpec


@dataclass(frozen=True)
class ProxySpec:
    """The PD proxy in front of one prefill and one decode server."""

    prefill_url: str
    decode_url: str
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "ucm_db.tools.proxy", "--prefill", self.prefill_url,
                "--decode", self.decode_url, "--port", str(port), "--log-level", "warning"]


def parse_event(line: str) -> dict[str, Any] | None:
    """One server-sent-events line as its JSON document (None: not a data line, or ``[DONE]``)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    document: dict[str, Any] = json.loads(payload)
    return document


def has_token(event: dict[str, Any]) -> bool:
    """Whether a streamed completion event carries generated text."""
    return any(choice.get("text") for choice in event.get("choices") or [])


def read_stream(lines: Iterable[str], started: float, clock: Any = time.perf_counter) -> dict[str, Any]:
    """TTFT, text and cached prompt tokens of one streamed completion."""
    ttft_s: float | None = None
    text: list[str] = []
    cached: int | None = None
    for line in lines:
        event = parse_event(line)
        if event is None:
            continue
        if ttft_s is None and has_token(event):
            ttft_s = clock() - started
        text.extend(choice.get("text") or "" for choice in event.get("choices") or [])
        usage = event.get("usage") or {}
        if usage.get("prompt_tokens_details"):
            cached = int(usage["prompt_tokens_details"].get("cached_tokens") or 0)
    if ttft_s is None:
        raise RuntimeError("the stream ended without a completion token")
    return {"ttft_s": ttft_s, "text": "".join(text), "cached_tokens": cached}


def stream_completion(client: Any, base_url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request; TTFT at the client, plus the proxy's prefill headers."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    with client.stream("POST", base_url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {response.text[:500]}")
        result = read_stream(response.iter_lines(), started)
        result["prefill"] = response.headers.get("x-ucm-db-prefill")
        prefill_ms = response.headers.get("x-ucm-db-prefill-ms")
        result["prefill_ms"] = float(prefill_ms) if prefill_ms else None
    return result


def _requests(base_url: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    import httpx

    with httpx.Client(timeout=httpx.Timeout(1800.0)) as client:
        return [stream_completion(client, base_url, ids, max_tokens) for ids in prompts]


def run_serving(model: Path, prompts: list[list[int]], work: Path, *, max_model_len: int, max_tokens: int,
                enforce_eager: bool, start_timeout_s: float, progress: Any) -> dict[str, Any]:
    """Both setups, one after the other: PD through the proxy, then one server without a connector."""
    store = {"path": str(work / "serve-store")}
    producer = ServerSpec(model, None, max_model_len, store, enforce_eager, role="kv_producer")
    consumer = ServerSpec(model, None, max_model_len, store, enforce_eager, role="kv_consumer")
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        progress("serve: starting prefill and decode servers ...")
        # Both start at once (Server.__enter__ blocks until healthy), each in a thread.
        servers = [Server(spec, work / f"{name}.log", start_timeout_s=start_timeout_s)
                   for name, spec in (("prefill", producer), ("decode", consumer))]
        for server in servers:
            stack.callback(server.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            started = [pool.submit(server.__enter__) for server in servers]
        for future in started:
            future.result()  # a server that failed to start raises here (both are stopped on the way out)
        proxy = stack.enter_context(Server(ProxySpec(servers[0].base_url, servers[1].base_url),
                                           work / "proxy.log", start_timeout_s=120))
        progress(f"serve: PD through the proxy, {len(prompts)} prompts ...")
        out["pd"] = _requests(proxy.base_url, prompts, max_tokens)
    with Server(ServerSpec(model, None, max_model_len, enforce_eager=enforce_eager),
                work / "single.log", start_timeout_s=start_timeout_s) as single:
        progress(f"serve: one server without a connector, {len(prompts)} prompts ...")
        out["single"] = _requests(single.base_url, prompts, max_tokens)
    return out
