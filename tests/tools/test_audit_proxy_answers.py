"""Questions of the second ``ucm-db proxy`` audit that the proxy already
answered rightly, kept as tests (the findings are in
test_audit_proxy_findings.py): a streaming client that leaves midway, a
client's own publication fields, a SIGTERM with a stream in flight.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from test_proxy import free_port
from test_proxy_robustness import _complete, _event, world  # noqa: F401  (world: the fixture)

STREAMED = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}


def test_streams_left_midway_close_their_upstream_and_leak_no_socket(world: dict[str, Any]) -> None:
    """A client that leaves after the first event of a stream whose server
    then sends nothing: the upstream stream is closed at once (vLLM aborts
    the generation), the server's count drops back to 0, and 30 such streams
    leave no more connections to the server than the pool keeps."""
    left: list[float] = []

    async def stall(request: Request, body: dict[str, Any]) -> Response:
        async def events() -> Any:
            try:
                yield _event("first")
                await asyncio.sleep(20)  # nothing more unless the proxy hangs up (the server cancels this)
            finally:
                left.append(time.monotonic())
        return StreamingResponse(events(), media_type="text/event-stream")

    server = world["fake"](stall)
    proxy = world["proxy"]([world["p"]], [server.url])
    for _ in range(30):
        with httpx.stream("POST", proxy + "/v1/completions", json=STREAMED, timeout=15) as response:
            assert next(response.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 10
    while len(left) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(left) == 30, f"{len(left)} of 30 upstream streams closed"
    assert httpx.get(proxy + "/health", timeout=15).json()["in_flight"][server.url] == 0
    port = int(server.url.rsplit(":", 1)[1])
    to_server = [c for c in psutil.Process().net_connections() if c.raddr and c.raddr.port == port]
    assert len(to_server) <= 2, to_server  # this process is the proxy; the /health probe's own may stay pooled


def test_the_publication_wins_every_field_a_client_names(world: dict[str, Any]) -> None:
    """A client cannot steer decode to another request's or namespace's KV
    through the proxy: every field of the producer's publication replaces the
    client's. (Where the prefill failed, the client's params reach decode as
    sent, as documented; a consumer trusts a publication only as a count of
    blocks whose last key it derives from its own tokens: connector/roles.py.)"""
    published = {"ucm_db": {"version": 1, "namespace": "a" * 32, "blocks": 2, "block_size": 16, "tokens": 32,
                            "last_key": "b" * 64, "published_to": "local"}}

    async def producer(request: Request, body: dict[str, Any]) -> Response:
        return JSONResponse({"choices": [{"text": "p"}], "kv_transfer_params": published})

    forged = {"ucm_db": {"version": 1, "namespace": "f" * 32, "blocks": 99, "block_size": 1, "tokens": 99,
                         "last_key": "e" * 64, "published_to": "remote", "load": False}}
    response = _complete(world["proxy"]([world["fake"](producer).url], [world["d"]]),
                         {"model": "m", "prompt": "x", "max_tokens": 3, "kv_transfer_params": forged})
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok"
    (_, _, sent), = world["seen"]
    assert sent["kv_transfer_params"] == {"ucm_db": {**published["ucm_db"], "load": False}}


def test_sigterm_lets_a_stream_in_flight_finish_whole(world: dict[str, Any]) -> None:
    """The real command: SIGTERM while a stream is relayed stops new
    connections, finishes the stream (every event, then [DONE]) and exits."""
    async def slow(request: Request, body: dict[str, Any]) -> Response:
        async def events() -> Any:
            for i in range(6):
                yield _event(f"e{i}")
                await asyncio.sleep(0.2)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    server, port = world["fake"](slow), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ucm_db.tools.cli", "proxy", "--prefill", world["p"], "--decode",
                             server.url, "--port", str(port), "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "the proxy did not start"
                time.sleep(0.1)
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=STREAMED, timeout=15) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f"e{i}" for i in range(6)]
        assert events[-1] == "[DONE]"
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
