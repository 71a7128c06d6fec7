"""Sends the conversation workload (:mod:`.serve_conversation`) to vLLM's
OpenAI server, ``concurrency`` requests in flight, and measures it.

Chosen over a ``vllm bench serve --dataset-name timed_trace`` trace: that
dataset replays requests at timestamps, so a turn could start before its
previous turn's answer came back; this client keeps the order itself.

Invariants:
    * A conversation's turn ``k + 1`` is queued only after its turn ``k``
      completed; queued turns are served first in, first out, starting
      with every conversation's first turn, so between two turns of one
      conversation the other conversations' turns run (the working set of
      all of them is live at once, as in a chat service with many users).
    * Every request is a streamed ``/v1/completions`` of token ids with
      ``ignore_eos`` and ``max_tokens = output_tokens``: its answer has
      exactly that many tokens, or the pass fails.
    * TTFT is from sending a request to its first streamed token; requests
      per second is completed requests over the pass's wall time.
    * A request that fails (an HTTP error, a short answer) stops the pass
      with the server's answer in the error.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np

from ucm_db.tools.bench.serve_conversation import ConversationSpec, conversations


async def _complete(client: Any, url: str, model: str, prompt: list[int], output_tokens: int) -> tuple[float, int, int]:
    """One streamed completion: (TTFT s, answer tokens, vLLM's cached prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft_s = -1.0
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if ttft_s < 0 and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft_s = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    answered = int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return ttft_s, answered, cached


async def _run(spec: ConversationSpec, base_url: str, model: str, timeout_s: float) -> dict[str, Any]:
    import httpx

    prompts = conversations(spec)
    queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
    for conversation in range(spec.conversations):
        queue.put_nowait((conversation, 0))
    ttfts_s: list[float] = []
    cached_tokens = 0
    remaining = spec.num_requests
    url = base_url + "/v1/completions"

    async def worker(client: Any) -> None:
        nonlocal remaining, cached_tokens
        while (item := await queue.get()) is not None:
            conversation, turn = item
            ttft_s, answered, cached = await _complete(client, url, model, prompts[conversation][turn], spec.output_tokens)
            if answered != spec.output_tokens or ttft_s < 0:
                raise RuntimeError(f"conversation {conversation} turn {turn}: {answered} of {spec.output_tokens} "
                                   f"answer tokens (TTFT {ttft_s:.3f} s)")
            ttfts_s.append(ttft_s)
            cached_tokens += cached
            remaining -= 1
            if turn + 1 < spec.turns:
                queue.put_nowait((conversation, turn + 1))
            if remaining == 0:
                for _ in range(spec.concurrency):
                    queue.put_nowait(None)

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(spec.concurrency)))
        duration_s = time.perf_counter() - started
    return summarize(ttfts_s, duration_s, cached_tokens)


def summarize(ttfts_s: list[float], duration_s: float, cached_tokens: int) -> dict[str, Any]:
    """A pass's figures in the keys the prefix_repetition rows use."""
    ttft_ms = np.array(ttfts_s) * 1e3
    return {"completed": len(ttfts_s), "duration": duration_s, "request_throughput": len(ttfts_s) / duration_s,
            "median_ttft_ms": float(np.percentile(ttft_ms, 50)), "p99_ttft_ms": float(np.percentile(ttft_ms, 99)),
            "mean_ttft_ms": float(ttft_ms.mean()), "client_cached_tokens": float(cached_tokens)}


def run_conversations(spec: ConversationSpec, base_url: str, model: str = "bench",
                      timeout_s: float = 600.0) -> dict[str, Any]:
    """One pass of every conversation against the server at ``base_url``."""
    return asyncio.run(_run(spec, base_url, model, timeout_s))
