"""The PD proxy with large request bodies: one client's large body stalls no
other client's stream, and a body prepared in a worker process is answered
exactly as one prepared on the event loop (the same 400s, the same
requests to both sides).

The servers behind the proxy are stand-ins (real sockets, real uvicorn, in
threads of this process, as in test_proxy.py). They record the raw bytes
they get and parse nothing large while a test measures: a JSON parse here
would hold the GIL and stall the proxy's thread as much as the proxy's own
parse did. The workers are real processes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ucm_db.tools.proxy import ProxyLimits, build_app
from ucm_db.tools.proxy_bodies import BodyPool
from ucm_db.tools.proxy_request import MAX_CLIENT_PARAMS_BYTES, BadRequest, ProxyBusy, decode_body, prefill_body, prepare

from test_proxy import Served

PARAMS = {"ucm_db": {"version": 1, "blocks": 3}}
#: How often the stand-in decode server sends an event of a stream.
EVENT_EVERY_S = 0.05


class Recorder:
    """A stand-in vLLM server: records each body's raw bytes; answers a
    stream with an event every 50 ms until ``stop`` is set, anything else
    with kv_transfer_params, like a kv_producer."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.stop = threading.Event()
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> Response:
            raw = await request.body()
            self.seen.append(raw)
            if b'"stream":true' not in raw:
                return Response(json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}),
                                media_type="application/json")

            async def events() -> Any:
                deadline = time.monotonic() + 120
                while not self.stop.is_set() and time.monotonic() < deadline:
                    yield f"data: {json.dumps({'choices': [{'text': 'e'}]})}\n\n"
                    await asyncio.sleep(EVENT_EVERY_S)
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        self.served = Served(app)
        self.url = self.served.url


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    prefill, decode = Recorder(), Recorder()
    proxies: dict[str, Served] = {}

    def proxy(name: str, **limits: Any) -> str:
        if name not in proxies:
            proxies[name] = Served(build_app([prefill.url], [decode.url], limits=ProxyLimits(**limits)))
        prefill.seen.clear()
        decode.seen.clear()
        return proxies[name].url

    yield {"prefill": prefill, "decode": decode, "proxy": proxy}
    for served in [*proxies.values(), prefill.served, decode.served]:
        served.stop()


def _post(url: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=120)


def _logit_bias_body(size_bytes: int) -> bytes:
    """A body whose parse is slow for its size (every number goes through the strict float check)."""
    entries = size_bytes // 14
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4,
                       "logit_bias": {str(100000 + i): -1.5 for i in range(entries)}}, separators=(",", ":")).encode()


def _spawned_workers() -> list[psutil.Process]:
    workers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:  # it exited meanwhile
            pass
    return workers


def test_a_large_body_stalls_no_other_clients_stream(world: dict[str, Any]) -> None:
    # 24 MiB of logit_bias: seconds of parsing and encoding, under the default --max-body-mb and threshold.
    url, decode = world["proxy"]("defaults"), world["decode"]
    raw = _logit_bias_body(24 << 20)
    arrivals: list[float] = []
    first = threading.Event()

    def stream() -> None:  # another client's stream, read line by line, each arrival timed
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "s", "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    arrivals.append(time.monotonic())
                    first.set()

    decode.stop.clear()
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(20), "the stream never started"
    started = time.monotonic()
    answer = _post(url, raw)
    ended = time.monotonic()
    time.sleep(0.3)
    decode.stop.set()
    reader.join(20)
    assert answer.status_code == 200, answer.text
    during = [t for t in arrivals if started <= t <= ended]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # a generous bound (events are sent every 50 ms): the large body never held the proxy's loop for a second
    assert max(gaps) < 1.0, f"the other stream stalled {max(gaps):.2f} s while a {len(raw) >> 20} MiB body was handled"
    assert len(during) >= 3, "the other stream got no events while the large body was handled"
    assert len(decode.seen[-1]) > len(raw), "the large body did not reach decode whole"


@pytest.mark.parametrize("tail, message", [
    (b"NaN]}", "the request body has NaN, which JSON does not allow"),
    (b"1e400]}", "the request body has the number 1e400 (out of float range), which JSON does not allow"),
    (b"1,", "the request body is not JSON"),
    (b"\xff]}", "the request body is not JSON"),
])
def test_a_large_malformed_body_is_the_same_400_as_a_small_one(world: dict[str, Any], tail: bytes,
                                                                message: str) -> None:
    inline = world["proxy"]("inline", offload_body_bytes=1 << 30)
    offloaded = world["proxy"]("offloaded", offload_body_bytes=1024)
    small = b'{"prompt": [' + tail
    large = b'{"prompt": [' + b"1," * (64 << 10) + tail
    answers = [_post(url, body) for url in (inline, offloaded) for body in (small, large)]
    assert [a.status_code for a in answers] == [400] * 4
    expected = {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
    assert all(a.json() == expected for a in answers)
    assert world["prefill"].seen == [] and world["decode"].seen == [], "a server was called for a bad body"
    assert _spawned_workers(), "the large body was not prepared in a worker process"


def test_a_large_body_that_is_not_an_object_is_the_same_400(world: dict[str, Any]) -> None:
    offloaded = world["proxy"]("offloaded", offload_body_bytes=1024)
    answer = _post(offloaded, json.dumps(list(range(100_000))).encode())
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "the request body must be a JSON object"


@pytest.mark.parametrize("stream", [False, True])
def test_a_large_body_reaches_both_sides_as_a_small_one_does(world: dict[str, Any], stream: bool) -> None:
    body = {"model": "m", "prompt": list(range(50_000)), "stream": stream, "min_tokens": 2, "max_tokens": 9,
            "max_completion_tokens": 9, "n": 1, "temperature": 0.5, "logit_bias": {"7": -1.5},
            "kv_transfer_params": {"ucm_db": {"load": False}, "other": {"k": 1}}}
    raw = json.dumps(body).encode()
    world["decode"].stop.set()  # a stream ends at once
    sent = {}
    for name, threshold in (("inline", 1 << 30), ("offloaded", 1024)):
        answer = _post(world["proxy"](name, offload_body_bytes=threshold), raw)
        assert answer.status_code == 200, answer.text
        assert ("data: [DONE]" in answer.text) == stream
        sent[name] = (world["prefill"].seen[0], world["decode"].seen[0])
    assert sent["inline"] == sent["offloaded"], "the worker's requests differ from the event loop's"
    prefill_sent, decode_sent = (json.loads(raw_sent) for raw_sent in sent["offloaded"])
    assert prefill_sent == prefill_body(body)
    assert decode_sent == decode_body(body, PARAMS)
    assert decode_sent["kv_transfer_params"] == {"ucm_db": {"load": False, **PARAMS["ucm_db"]}, "other": {"k": 1}}


def test_large_bodies_in_flight_are_bounded_and_the_bound_frees() -> None:
    raw = json.dumps({"prompt": list(range(20_000))}).encode()

    async def scenario() -> list[Any]:
        pool = BodyPool(offload_body_bytes=0, budget_bytes=1, workers=1)  # one body in flight at a time
        try:
            both = await asyncio.gather(pool.prepare(raw), pool.prepare(raw), return_exceptions=True)
            after = await pool.prepare(raw)  # the first one's bytes were released when its worker finished
            return [*both, after]
        finally:
            pool.close()

    first, second, after = asyncio.run(scenario())
    assert isinstance(second, ProxyBusy) and "retry shortly" in str(second)
    assert first == after == prepare(raw)


def test_the_clients_kv_transfer_params_are_bounded() -> None:
    body = {"prompt": "p", "kv_transfer_params": {"ucm_db": {"load": False}, "pad": "x" * MAX_CLIENT_PARAMS_BYTES}}
    with pytest.raises(BadRequest) as caught:
        prepare(json.dumps(body).encode())
    assert caught.value.status == 400 and "kv_transfer_params" in caught.value.message


def test_a_proxy_answers_503_with_retry_after_when_the_bound_is_reached(world: dict[str, Any]) -> None:
    # budget 1 byte: one large body at a time; one sent while another is in its worker is refused
    url = world["proxy"]("tight", offload_body_bytes=1024, offload_budget_bytes=1)
    raw = _logit_bias_body(2 << 20)
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(_post(url, raw)))
    first.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and first.is_alive() and 503 not in [a.status_code for a in answers]:
        answers.append(_post(url, raw))
    first.join(60)
    assert {a.status_code for a in answers} == {200, 503}, [a.status_code for a in answers]
    refused = next(a for a in answers if a.status_code == 503)
    assert refused.headers["retry-after"] == "1" and "retry shortly" in refused.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    {},
    {"prompt": "p"},
    {"stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3, "max_completion_tokens": 9},
    {"prompt": [1, 2], "n": 3, "kv_transfer_params": None},
    {"prompt": "p", "kv_transfer_params": 5, "max_tokens": 7, "stream": "yes"},
    {"kv_transfer_params": {"ucm_db": {"load": False, "version": 0}, "other": [1]}, "prompt": "\ud800 lone"},
])
def test_the_joined_requests_are_the_dict_rules(body: dict[str, Any]) -> None:
    # the requests are joined from encoded parts; they must say what prefill_body and decode_body say
    done = prepare(json.dumps(body).encode())
    assert json.loads(done.prefill_payload()) == prefill_body(body)
    for published in (None, PARAMS, {"other": {"k": 2}}):
        assert json.loads(done.decode_payload(published)) == decode_body(body, published)
    assert done.stream == bool(body.get("stream"))
