"""The PD proxy under load, misbehaving servers and hostile clients (the
audit of ``ucm-db proxy``: F1, F3 to F6, F8 to F12; F2 and F7 are in
test_proxy.py).

The servers behind the proxy are small stand-ins: FastAPI apps for what an
HTTP framework can say (a stream held open, a server that never answers, odd
statuses) and a bare TCP server (:class:`Raw`) for what none lets a test
write: a stream or a body cut midway, a body that trickles in a byte at a
time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socketserver
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ucm_db import ConfigError
from ucm_db.tools.proxy import ProxyLimits, build_app, main, parse_urls

from test_proxy import Served, free_port, recording_upstream

Answer = Callable[[Request, dict[str, Any]], Awaitable[Response]]


class Fake:
    """A server whose every completion is ``answer``; it records the bodies
    it got, and ``gone`` is set when a client it was answering went away."""

    def __init__(self, answer: Answer) -> None:
        self.seen: list[dict[str, Any]] = []
        self.gone = threading.Event()
        self.release = threading.Event()
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            self.seen.append(body)
            return await answer(request, body)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        self.served = Served(app)
        self.url = self.served.url

    async def wait_for_release_or_disconnect(self, request: Request) -> None:
        deadline = time.monotonic() + 20
        while not self.release.is_set() and time.monotonic() < deadline:
            if await request.is_disconnected():
                self.gone.set()
                return
            await asyncio.sleep(0.02)


class Raw:
    """A bare TCP server that reads each request and answers with ``reply(socket)``."""

    def __init__(self, reply: Callable[[Any], None]) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                _read_request(self.request)
                try:
                    reply(self.request)
                except OSError:  # the proxy hung up: what a timeout does
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _read_request(sock: Any) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(65536)


def _event(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'text': text, 'index': 0}]})}\n\n".encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _cut_stream(sock: Any) -> None:
    """Two events and half a third, then the connection drops (no last chunk)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 + _chunk(_event("cut-0") + _event("cut-1")) + _chunk(b'data: {"choi'))


def _cut_body(sock: Any) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"choices\": [")


def _trickle(sock: Any) -> None:
    """Headers, then a byte every 0.2 s: never a read timeout, never an answer."""
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10000\r\n\r\n")
    for _ in range(150):
        sock.sendall(b" ")
        time.sleep(0.2)


@pytest.fixture()
def world() -> Iterator[dict[str, Any]]:
    """Healthy servers (p: a producer, d: a consumer) and a list of what
    each test starts, stopped at its end."""
    seen: list[tuple[str, str, dict[str, Any]]] = []
    started: list[Any] = []
    p, d = Served(recording_upstream("p", seen)), Served(recording_upstream("d", seen))

    def proxy(prefill: list[str], decode: list[str], **limits: Any) -> str:
        served = Served(build_app(prefill, decode, limits=ProxyLimits(**{"timeout_s": 30, **limits})))
        started.append(served)
        return served.url

    def fake(answer: Answer) -> Fake:
        server = Fake(answer)
        started.append(server.served)
        return server

    def raw(reply: Callable[[Any], None]) -> Raw:
        server = Raw(reply)
        started.append(server)
        return server

    yield {"p": p.url, "d": d.url, "seen": seen, "proxy": proxy, "fake": fake, "raw": raw}
    for server in [*started, p, d]:
        server.stop()


def _complete(url: str, body: dict[str, Any] | None = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body or {"model": "m", "prompt": "x", "max_tokens": 3},
                      timeout=kwargs.pop("timeout", 15), **kwargs)


def test_f1_a_busy_server_starves_neither_health_nor_the_other_server(world: dict[str, Any]) -> None:
    """Each server has its own pool (and /health its own): streams held on
    one decode server leave /health and the other server answering at once;
    when every server is full the client is told the proxy is saturated."""
    async def hold(request: Request, body: dict[str, Any]) -> Response:
        async def events() -> Any:
            yield _event("held")
            await holder.wait_for_release_or_disconnect(request)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    holder = world["fake"](hold)
    proxy = world["proxy"]([world["p"]], [holder.url, world["d"]], max_connections=2)
    alone = world["proxy"]([world["p"]], [holder.url], max_connections=1)
    streamed = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.Client(timeout=15) as client:
        opened = [client.send(client.build_request("POST", url + "/v1/completions", json=streamed), stream=True)
                  for url in (proxy, proxy, proxy, proxy, alone)]  # round-robin: 2 held on holder, 2 done on d
        try:
            assert len(holder.seen) == 3 and all(r.status_code == 200 for r in opened)
            started = time.monotonic()
            health = client.get(proxy + "/health")
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            assert health.json()["in_flight"][holder.url] == 2
            answer = client.post(proxy + "/v1/completions", json={"model": "m", "prompt": "y", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "d"
            assert time.monotonic() - started < 3 and len(holder.seen) == 3  # the full server was skipped, not waited on
            full = client.post(alone + "/v1/completions", json=streamed)
            assert full.status_code == 503, full.text
            message = full.json()["error"]["message"]
            assert "proxy saturated" in message and "--max-connections" in message and holder.url in message
        finally:
            holder.release.set()
            for response in opened:
                response.close()


def test_f3_a_stream_cut_midway_ends_with_an_error_event(world: dict[str, Any]) -> None:
    cut = world["raw"](_cut_stream)
    proxy = world["proxy"]([world["p"]], [cut.url])
    with httpx.stream("POST", proxy + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
                      timeout=15) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["cut-0", "cut-1"]
    assert len(events) == 3 and "[DONE]" not in events  # the half event is dropped, the error event parses
    error = json.loads(events[2])["error"]
    assert "broke midway" in error["message"] and cut.url in error["message"] and error["code"] == 502


def test_f3_the_openai_client_raises_on_a_stream_cut_midway(world: dict[str, Any]) -> None:
    openai = pytest.importorskip("openai")
    proxy = world["proxy"]([world["p"]], [world["raw"](_cut_stream).url])
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)
    texts = []
    with pytest.raises(openai.APIError, match="broke midway"):
        for chunk in client.completions.create(model="m", prompt="x", stream=True):
            texts.append(chunk.choices[0].text)
    assert texts == ["cut-0", "cut-1"]


def test_f4_a_client_that_leaves_cancels_the_upstream_work(world: dict[str, Any]) -> None:
    """Unstreamed (and the prefill of a stream): the proxy stops waiting on
    the server when its client goes, closing the upstream request (vLLM
    aborts it), and never calls decode for nobody."""
    async def never(request: Request, body: dict[str, Any]) -> Response:
        await server.wait_for_release_or_disconnect(request)
        return JSONResponse({})

    server = world["fake"](never)
    for prefill, decode in (([server.url], [world["d"]]), ([world["p"]], [server.url])):
        server.gone.clear()
        world["seen"].clear()
        proxy = world["proxy"](prefill, decode)
        with pytest.raises(httpx.TimeoutException):
            _complete(proxy, timeout=1)
        assert server.gone.wait(3), "the proxy kept waiting on the server for a client that left"
        time.sleep(0.3)
        assert not [name for name, _, _ in world["seen"] if name == "d"]  # decode never ran for nobody


def test_f5_a_trickling_server_is_bounded_by_the_timeouts(world: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A byte every 0.2 s never trips a per-read timeout; the deadlines
    bound the whole answer: the prefill falls back, the decode is a 504."""
    trickle = world["raw"](_trickle)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ucm_db.proxy"):
        response = _complete(world["proxy"]([trickle.url], [world["d"]], prefill_timeout_s=1), timeout=10)
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "failed"
    assert time.monotonic() - started < 4
    assert f"{trickle.url}: no answer within --prefill-timeout-s 1 s" in caplog.text
    started = time.monotonic()
    response = _complete(world["proxy"]([world["p"]], [trickle.url], timeout_s=1), timeout=10)
    assert response.status_code == 504 and "--timeout-s 1 s" in response.json()["error"]["message"]
    assert time.monotonic() - started < 4


@pytest.mark.parametrize("raw, message", [
    (b'{"model":"m","prompt":"x","temperature":NaN}', "NaN"),
    (b'{"model":"m","prompt":"x","temperature":-Infinity}', "-Infinity"),
    (b'{"model":"m","prompt":"x","temperature":1e400}', "1e400"),
    (b"[" * 200_000 + b"]" * 200_000, "nests too deeply"),
    (b'{"model":"m","prompt":' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nests too deeply"),
], ids=["nan", "infinity", "overflow", "deep", "deep-inside"])
def test_f6_hostile_bodies_are_a_400(world: dict[str, Any], raw: bytes, message: str) -> None:
    response = httpx.post(world["proxy"]([world["p"]], [world["d"]]) + "/v1/completions", content=raw, timeout=15)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert not world["seen"]


def test_f6_a_header_that_is_not_ascii_is_a_400(world: dict[str, Any]) -> None:
    proxy = world["proxy"]([world["p"]], [world["d"]])
    for name in ("Authorization", "X-Request-Id"):
        response = _complete(proxy, headers={name: b"Bearer \xe9"})
        assert response.status_code == 400 and f"header {name} must be ASCII" in response.json()["error"]["message"]
    assert not world["seen"]
    assert _complete(proxy, headers={"Authorization": "Bearer ok"}).status_code == 200


def test_f8_a_body_over_the_limit_is_a_413(world: dict[str, Any]) -> None:
    proxy = world["proxy"]([world["p"]], [world["d"]], max_body_bytes=1024)
    big = {"model": "m", "prompt": "x" * 2048}
    for response in (_complete(proxy, big),  # Content-Length says it
                     httpx.post(proxy + "/v1/completions", content=iter([json.dumps(big).encode()]), timeout=15)):  # chunked
        assert response.status_code == 413 and "--max-body-mb" in response.json()["error"]["message"]
    assert not world["seen"]
    assert _complete(proxy).status_code == 200


def test_f9_a_decode_timeout_is_a_504_and_is_not_sent_again(world: dict[str, Any]) -> None:
    async def never(request: Request, body: dict[str, Any]) -> Response:
        await slow.wait_for_release_or_disconnect(request)
        return JSONResponse({})

    slow = world["fake"](never)
    proxy = world["proxy"]([world["p"]], [slow.url, world["d"]], timeout_s=1)
    world["seen"].clear()
    response = _complete(proxy)
    assert response.status_code == 504, response.text
    message = response.json()["error"]["message"]
    assert slow.url in message and "did not answer within --timeout-s 1 s" in message
    assert response.headers["x-ucm-db-prefill"] == "ok"
    assert [name for name, _, _ in world["seen"]] == ["p"]  # not sent again to the next decode server
    cut = world["raw"](_cut_body)
    response = _complete(world["proxy"]([world["p"]], [cut.url]))
    assert response.status_code == 502 and "broke off its answer" in response.json()["error"]["message"]


def test_f10_server_urls_are_checked_at_start_up() -> None:
    """What httpx would refuse (a 500 per request) or route elsewhere (a
    query or fragment) stops start-up with a usage error, never a traceback."""
    for bad in ("http://127.0.0.1:abc", "http://[::1", "http://127.0.0.1:99999", "http://127.0.0.1:0",
                "http://127.0.0.1:8100?x=1", "http://127.0.0.1:8100#frag"):
        with pytest.raises(ConfigError, match="--decode"):
            parse_urls(bad, "decode")
    assert parse_urls("http://[::1]:8200,https://d:1", "decode") == ("http://[::1]:8200", "https://d:1")
    result = CliRunner().invoke(main, ["--prefill", "http://[::1", "--decode", "http://127.0.0.1:8200", "--port", "8000"])
    assert result.exit_code == 2 and "--prefill" in result.output and "Invalid IPv6 URL" in result.output, result.output


@pytest.mark.parametrize("not_finite", ["nan", "inf"])
def test_f10_options_that_would_break_every_request_stop_start_up(not_finite: str) -> None:
    base = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--port", "8000"]
    for extra in (["--timeout-s", not_finite], ["--prefill-timeout-s", not_finite], ["--max-body-mb", not_finite],
                  ["--host", "nosuchhost.invalid"]):
        result = CliRunner().invoke(main, [*base, *extra])
        assert result.exit_code == 2 and extra[0] in result.output, result.output


@pytest.mark.parametrize("status", [201, 204, 307, 408, 429, 503])
def test_f11_a_prefill_answer_but_200_or_the_clients_4xx_is_a_failed_prefill(world: dict[str, Any], status: int) -> None:
    async def odd(request: Request, body: dict[str, Any]) -> Response:
        return Response(b"" if status == 204 else b"{}", status_code=status, headers={"location": "http://x/"})

    response = _complete(world["proxy"]([world["fake"](odd).url], [world["d"]]))
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "failed"
    assert response.json()["choices"][0]["text"] == "d"


def test_f11_error_bodies_keep_their_content_type(world: dict[str, Any]) -> None:
    async def html(request: Request, body: dict[str, Any]) -> Response:
        return Response("<html>nope</html>", status_code=400 if body.get("max_tokens") == 1 else 500, media_type="text/html")

    server = world["fake"](html)
    rejected = _complete(world["proxy"]([server.url], [world["d"]]))
    assert rejected.status_code == 400 and rejected.text == "<html>nope</html>"
    assert rejected.headers["content-type"].startswith("text/html") and rejected.headers["x-ucm-db-prefill"] == "rejected"
    failed = _complete(world["proxy"]([world["p"]], [server.url]), {"model": "m", "prompt": "x", "stream": True})
    assert failed.status_code == 500 and failed.headers["content-type"].startswith("text/html")


def test_f12_failures_are_logged_and_error_answers_carry_the_prefill_state(
        world: dict[str, Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_params(request: Request, body: dict[str, Any]) -> Response:
        return JSONResponse({"choices": [{"text": "p"}]})

    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="ucm_db.proxy"):
        down = _complete(world["proxy"]([world["p"]], [dead]))
        lost = _complete(world["proxy"]([world["fake"](no_params).url], [world["d"]]))
    assert down.status_code == 503 and down.headers["x-ucm-db-prefill"] == "ok"
    assert lost.status_code == 200 and lost.headers["x-ucm-db-prefill"] == "no-params"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"decode side unavailable: {dead}" in logged and "has no kv_transfer_params" in logged
    ran: dict[str, Any] = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.update(kw))
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.NOTSET)
    result = CliRunner().invoke(main, ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "8000"])
    assert result.exit_code == 0 and ran["port"] == 8000, result.output
    assert logging.getLogger("httpx").level == logging.WARNING  # not two INFO lines per request


def test_proxy_limits_are_checked() -> None:
    for bad in ({"timeout_s": float("nan")}, {"prefill_timeout_s": float("inf")}, {"max_connections": 0}):
        with pytest.raises(ConfigError):
            ProxyLimits(**bad)


def test_a_long_event_is_relayed_whole_in_linear_time_and_an_endless_one_is_cut(world: dict[str, Any]) -> None:
    """The relay rescanned every pending byte at each chunk: one 16 MiB event in 4 KiB chunks took
    121 s of the proxy's only event loop (quadratic), with no bound on what it held."""
    from ucm_db.tools.proxy_relay import MAX_EVENT_BYTES

    def stream_of(event_bytes: int, end: bool) -> Any:
        async def answer(request: Request, body: dict[str, Any]) -> Response:
            async def events() -> Any:
                yield b"data: " + b"x" * 10
                for _ in range(event_bytes // 4096):
                    yield b"x" * 4096
                if end:
                    yield b"\n\ndata: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return answer

    long_event = world["fake"](stream_of(8 << 20, end=True))
    endless = world["fake"](stream_of(MAX_EVENT_BYTES + (1 << 20), end=False))
    streamed = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    for decode, whole in ((long_event, True), (endless, False)):
        proxy = world["proxy"]([world["p"]], [decode.url])
        started = time.monotonic()
        with httpx.stream("POST", proxy + "/v1/completions", json=streamed, timeout=60) as response:
            text = response.read()
        elapsed_s = time.monotonic() - started
        assert elapsed_s < 20, f"{elapsed_s:.1f} s to relay one long event"
        if whole:
            assert text.endswith(b"data: [DONE]\n\n") and len(text) > 8 << 20
        else:
            assert b"over 16 MiB" in text and b"[DONE]" not in text and len(text) < 1 << 20
