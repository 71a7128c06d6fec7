"""The PD proxy's own rules: what it sends each side, round-robin, streaming
relay, a side that is down, ``/health``, its command line.

The servers behind the proxy here are small recording HTTP servers (real
sockets, real uvicorn), stand-ins for vLLM: they let a test see the exact
bodies the proxy sends and take a side down at will, in a second instead of
two engine start-ups. The proxy against real vLLM servers and the real
store is tests/vllm/test_pd_http.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ucm_db import ConfigError
from ucm_db.tools.proxy import build_app, main, parse_urls, prefill_body
from ucm_db.tools.proxy_request import merge_params

PARAMS = {"ucm_db": {"version": 1, "blocks": 3}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """An ASGI app on a real port, in a thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError("test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def recording_upstream(name: str, seen: list[tuple[str, str, dict[str, Any]]]) -> FastAPI:
    """A recording stand-in of a vLLM server: answers with its name and,
    like a kv_producer, with kv_transfer_params."""
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            # vLLM's OpenAI server refuses any other body (a 400 "Unsupported Media Type" there)
            return JSONResponse({"error": {"message": "Unsupported Media Type: Only 'application/json' is allowed"}},
                                status_code=400)
        body = await request.json()
        seen.append((name, request.url.path, body))
        if body.get("prompt") == "bad":
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        if (body.get("min_tokens") or 0) > (body.get("max_completion_tokens") or body.get("max_tokens") or 16):
            # vLLM's own check (SamplingParams._verify_args), a 400 there too
            message = f"min_tokens must be less than or equal to max_tokens={body.get('max_tokens')}, got {body['min_tokens']}."
            return JSONResponse({"error": {"message": message}}, status_code=400)
        if body.get("stream"):
            async def events() -> Any:
                for i in range(3):
                    yield f"data: {json.dumps({'choices': [{'text': f'{name}-{i}'}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": name}], "kv_transfer_params": PARAMS}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": name}]}

    return app


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    servers = {name: Served(recording_upstream(name, seen)) for name in ("p0", "p1", "d0", "d1")}
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxies = {
        "two_each": Served(build_app([servers["p0"].url, servers["p1"].url], [servers["d0"].url, servers["d1"].url], 30)),
        "prefill_down": Served(build_app([dead], [servers["d0"].url], 30)),
        "decode_down": Served(build_app([servers["p0"].url], [dead], 30)),
        "one_decode_down": Served(build_app([servers["p0"].url], [dead, servers["d1"].url], 30)),
    }
    yield {"seen": seen, "servers": servers, "proxies": proxies, "dead": dead}
    for served in [*proxies.values(), *servers.values()]:
        served.stop()


def _post(cluster: dict[str, Any], proxy: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    cluster["seen"].clear()
    return httpx.post(cluster["proxies"][proxy].url + path, json=body, timeout=30)


def test_prefill_gets_one_token_and_decode_gets_its_params(cluster: dict[str, Any]) -> None:
    response = _post(cluster, "two_each", {"model": "m", "prompt": "hello", "max_tokens": 20, "stream": False, "n": 1})
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok"
    (p_name, _, p_body), (d_name, _, d_body) = cluster["seen"]
    assert p_name.startswith("p") and d_name.startswith("d")
    assert p_body["max_tokens"] == 1 and "stream" not in p_body and "kv_transfer_params" not in p_body
    assert d_body["max_tokens"] == 20 and d_body["kv_transfer_params"] == PARAMS
    assert response.json()["choices"][0]["text"] == d_name


def test_chat_completions_too(cluster: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    response = _post(cluster, "two_each", body, "/v1/chat/completions")
    assert response.status_code == 200
    (_, p_path, p_body), (_, d_path, d_body) = cluster["seen"]
    assert p_path == d_path == "/v1/chat/completions"
    assert p_body["max_completion_tokens"] == 1 and d_body["max_completion_tokens"] == 9


def test_round_robin_over_each_side(cluster: dict[str, Any]) -> None:
    used = []
    for _ in range(4):
        _post(cluster, "two_each", {"model": "m", "prompt": "x", "max_tokens": 2})
        used.append(tuple(name for name, _, _ in cluster["seen"]))
    assert {u[0] for u in used} == {"p0", "p1"} and {u[1] for u in used} == {"d0", "d1"}
    assert used[0] != used[1] and used[0] == used[2]


def test_streaming_is_relayed_whole(cluster: dict[str, Any]) -> None:
    cluster["seen"].clear()
    with httpx.stream("POST", cluster["proxies"]["two_each"].url + "/v1/completions",
                      json={"model": "m", "prompt": "s", "max_tokens": 3, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 4
    (_, _, p_body), (d_name, _, d_body) = cluster["seen"]
    assert "stream" not in p_body and d_body["stream"] is True
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f"{d_name}-{i}" for i in range(3)]


def test_a_bad_request_is_returned_not_decoded(cluster: dict[str, Any]) -> None:
    response = _post(cluster, "two_each", {"model": "m", "prompt": "bad", "max_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["message"] == "bad prompt"
    assert len(cluster["seen"]) == 1  # decode never saw it
    assert httpx.post(cluster["proxies"]["two_each"].url + "/v1/completions", content=b"{", timeout=30).status_code == 400


def test_prefill_down_decode_recomputes(cluster: dict[str, Any]) -> None:
    response = _post(cluster, "prefill_down", {"model": "m", "prompt": "x", "max_tokens": 3})
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "failed"
    ((name, _, body),) = cluster["seen"]
    assert name == "d0" and "kv_transfer_params" not in body


def test_decode_down_is_a_clear_503(cluster: dict[str, Any]) -> None:
    response = _post(cluster, "decode_down", {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True})
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "decode side unavailable" in message and cluster["dead"] in message and "--decode" in message


def test_an_unreachable_server_is_skipped_for_the_next(cluster: dict[str, Any]) -> None:
    for _ in range(3):
        response = _post(cluster, "one_decode_down", {"model": "m", "prompt": "x", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "d1"


def test_health_reports_each_server(cluster: dict[str, Any]) -> None:
    proxies = cluster["proxies"]
    ok = httpx.get(proxies["two_each"].url + "/health", timeout=30)
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    degraded = httpx.get(proxies["prefill_down"].url + "/health", timeout=30)
    assert degraded.status_code == 200 and degraded.json()["status"] == "degraded"
    assert degraded.json()["prefill"][cluster["dead"]].startswith("unreachable")
    down = httpx.get(proxies["decode_down"].url + "/health", timeout=30)
    assert down.status_code == 503 and down.json()["status"] == "down"
    assert httpx.get(proxies["one_decode_down"].url + "/v1/models", timeout=30).json()["data"][0]["id"] == "d1"


def test_urls_and_prefill_body() -> None:
    assert parse_urls("http://a:1, http://b:2/", "prefill") == ("http://a:1", "http://b:2")
    for bad in ("", "a:1", "ftp://a:1", "http://a:1/v1"):
        with pytest.raises(ConfigError) as err:
            parse_urls(bad, "decode")
        assert "--decode" in str(err.value)
    body = {"prompt": "p", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50, "n": 2,
            "min_tokens": 5}
    assert prefill_body(body) == {"prompt": "p", "max_tokens": 1, "n": 1}
    assert body["stream"] is True and body["min_tokens"] == 5  # the caller's body is untouched


def test_min_tokens_reaches_decode_not_prefill(cluster: dict[str, Any]) -> None:
    """vLLM refuses min_tokens > max_tokens: the one-token prefill request
    drops it (it was a 400 for a request vLLM serves directly), decode keeps it."""
    for path, body in (("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 20, "min_tokens": 5}),
                       ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 9, "min_tokens": 3, "stream": True})):
        response = _post(cluster, "two_each", body, path)
        assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok", response.text
        (_, _, p_body), (_, _, d_body) = cluster["seen"]
        assert "min_tokens" not in p_body and d_body["min_tokens"] == body["min_tokens"]


def test_the_clients_kv_transfer_params_are_merged_with_the_publication(cluster: dict[str, Any]) -> None:
    """The client's controls (load, max_load_tokens) and other connectors'
    keys reach decode; the producer's publication wins a field both name."""
    mine = {"ucm_db": {"load": False, "max_load_tokens": 0, "blocks": 99}, "OtherConnector": {"k": 1}}
    response = _post(cluster, "two_each", {"model": "m", "prompt": "x", "max_tokens": 3, "kv_transfer_params": mine})
    assert response.status_code == 200
    (_, _, p_body), (_, _, d_body) = cluster["seen"]
    assert p_body["kv_transfer_params"] == mine  # the prefill gets the client's own
    assert d_body["kv_transfer_params"] == {"ucm_db": {"load": False, "max_load_tokens": 0, **PARAMS["ucm_db"]},
                                            "OtherConnector": {"k": 1}}
    assert merge_params("not an object", PARAMS) == PARAMS and merge_params(None, PARAMS) == PARAMS
    assert merge_params({"ucm_db": 5}, PARAMS) == PARAMS


def test_command_line() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0 and "--prefill" in result.output and "Example" in result.output
    result = runner.invoke(main, ["--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200", "--port", "8000"])
    assert result.exit_code == 2 and "http://HOST:PORT" in result.output


def test_module_entry_point_and_no_engine_imports() -> None:
    code = (
        "import sys, ucm_db.connector; assert 'ucm_db.tools.proxy' not in sys.modules;"
        "import ucm_db.tools.proxy; assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.proxy", "--prefill", "http://a:1", "--decode", "x", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--decode" in done.stderr


def test_ucm_db_proxy_is_the_same_command_and_loads_nothing_for_the_others() -> None:
    """The proxy is ``ucm-db proxy`` (issue 47: out of the connector, the
    package vLLM loads); FastAPI, httpx and uvicorn load only when it runs."""
    code = "import sys, ucm_db.tools.cli; print(sorted(m for m in ('fastapi', 'httpx', 'uvicorn') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "proxy", "--prefill", "http://a:1", "--decode", "x",
                           "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--decode" in done.stderr, done.stderr
    helped = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", "proxy", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "--prefill" in helped.stdout
