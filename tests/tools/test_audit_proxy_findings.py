"""The second audit of ``ucm-db proxy``: each test reproduces a finding
(A1 to A5) against the real app on real sockets, and failed before its fix.

The servers behind the proxy are the stand-ins of test_proxy_robustness.py
(FastAPI apps on real ports; a bare listening socket for a server that
accepts connections and never answers).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ucm_db import ConfigError
from ucm_db.tools.proxy import main, parse_urls

from test_proxy import free_port
from test_proxy_robustness import _complete, world  # noqa: F401  (world: the fixture)


@pytest.fixture()
def hanging() -> Iterator[str]:
    """A server that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("number", [b"NaN", b"-Infinity", b"1e400"])
def test_a1_a_prefill_answer_with_a_number_json_lacks_costs_only_the_reuse(world: dict[str, Any], number: bytes) -> None:
    """A1: the prefill answer was parsed leniently and its params re-encoded
    strictly: a producer (or another connector) answering NaN/Infinity or an
    overflowing number in its kv_transfer_params made every request a 500
    "internal proxy error: ValueError: Out of range float values"."""
    async def odd(request: Request, body: dict[str, Any]) -> Response:
        return Response(b'{"choices":[],"kv_transfer_params":{"ucm_db":{"blocks":' + number + b"}}}",
                        media_type="application/json")

    response = _complete(world["proxy"]([world["fake"](odd).url], [world["d"]]))
    assert response.status_code == 200, response.text
    assert response.headers["x-ucm-db-prefill"] == "no-params" and response.json()["choices"][0]["text"] == "d"
    assert "kv_transfer_params" not in world["seen"][-1][2]  # decode computes the prompt itself


def test_a2_a_prefill_timeout_above_timeout_s_is_the_prefill_deadline(world: dict[str, Any]) -> None:
    """A2: each prefill read was also bounded by --timeout-s (httpx's read
    timeout), so with --prefill-timeout-s 10 --timeout-s 1 a 2 s prefill
    failed after 1 s, was sent again to the next prefill server (a second
    prefill of the same prompt), and was logged as "no answer within
    --prefill-timeout-s 10 s"."""
    async def slow(request: Request, body: dict[str, Any]) -> Response:
        await asyncio.sleep(2)
        return JSONResponse({"choices": [{"text": "p"}], "kv_transfer_params": {"ucm_db": {"blocks": 1}}})

    producer = world["fake"](slow)
    proxy = world["proxy"]([producer.url, world["p"]], [world["d"]], timeout_s=1, prefill_timeout_s=10)
    response = _complete(proxy)
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok", response.headers
    assert len(producer.seen) == 1 and [name for name, _, _ in world["seen"]] == ["d"]  # one prefill, on the slow server


def test_a3_a_server_named_twice_on_a_side_stops_start_up() -> None:
    """A3: a repeated URL (or the same one spelled with a trailing slash, in
    capitals, or with its default port) was accepted as a second server: the
    server got twice --max-connections, twice the round-robin share, and
    /health listed it once, with one of its two counts."""
    for twice in ("http://127.0.0.1:8100,http://127.0.0.1:8100/", "http://d:80,HTTP://D", "https://d,https://d:443"):
        with pytest.raises(ConfigError, match="more than once"):
            parse_urls(twice, "decode")
    assert parse_urls("http://d:8100,http://d:8101,https://d:8100", "decode") == ("http://d:8100", "http://d:8101",
                                                                                    "https://d:8100")
    result = CliRunner().invoke(main, ["--prefill", "http://127.0.0.1:8100", "--decode",
                                       "http://127.0.0.1:8200,http://127.0.0.1:8200", "--port", "8000"])
    assert result.exit_code == 2 and "--decode" in result.output and "more than once" in result.output, result.output


def test_a4_a_server_url_with_credentials_stops_start_up(world: dict[str, Any]) -> None:
    """A4: ``http://user:secret@host`` was accepted: the password was then
    shown to every client in 503 messages and by /health, and httpx's basic
    auth replaced the client's own Authorization header (vLLM's --api-key)."""
    for url in ("http://user:secret@127.0.0.1:8100", "http://user@127.0.0.1:8100", "http://:pw@127.0.0.1:8100"):
        with pytest.raises(ConfigError, match="user or password"):
            parse_urls(url, "prefill")
    result = CliRunner().invoke(main, ["--prefill", "http://u:secret@127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
                                       "--port", "8000"])
    assert result.exit_code == 2 and "--prefill" in result.output and "secret" not in result.output, result.output


def test_a5_probes_of_healthy_servers_are_not_starved_by_a_hanging_one(world: dict[str, Any], hanging: str) -> None:
    """A5: /health and /v1/models shared one pool of 64 connections for all
    servers: a prefill server that accepts and never answers held them for
    5 s each, so of 100 concurrent probes a third reported the healthy decode
    server "unreachable" and the proxy "down" (503): a load balancer would
    take a serving proxy out."""
    proxy = world["proxy"]([hanging], [world["d"]])

    async def probe_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(client.get(proxy + "/health") for _ in range(100)))

    reports = [r.json() for r in asyncio.run(probe_all())]
    assert all(r["status"] == "degraded" and r["decode"][world["d"]] == "ok" for r in reports), \
        sorted({(r["status"], r["decode"][world["d"]]) for r in reports})
    assert all(r["prefill"][hanging].startswith("unreachable") for r in reports)


def test_a6_servers_are_reached_directly_whatever_http_proxy_says(world: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A6: httpx read HTTP_PROXY/ALL_PROXY from the environment, so on a host
    with a forward proxy set (and no NO_PROXY for the servers) every request
    went to that proxy: with one that does not answer, a 503 "decode side
    unavailable ... start a decode server" and /health "down" while both
    servers were up."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, nowhere)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxy = world["proxy"]([world["p"]], [world["d"]])  # its pools open now, in this environment
    with httpx.Client(trust_env=False, timeout=15) as client:
        response = client.post(proxy + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
        assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok", response.text
        assert client.get(proxy + "/health").json()["status"] == "ok"
