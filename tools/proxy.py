"""The prefill/decode proxy: one OpenAI-compatible endpoint in front of
prefill (``kv_producer``) and decode (``kv_consumer``) vLLM servers that
share a ucm-db store.

    ucm-db proxy --prefill http://p1:8100,http://p2:8100 \\
        --decode http://d1:8200 --port 8000

For each ``/v1/completions`` or ``/v1/chat/completions`` request it sends the
body to a prefill server with ``max_tokens=1`` and no streaming, takes the
``kv_transfer_params`` of its answer (what the producer published, see
:mod:`ucm_db.connector.roles`) and sends the original body with those params
to a decode server, whose answer or event stream goes back to the client.
``GET /health`` reports every server; ``GET /v1/models`` asks a decode server.

Invariants:
    * Servers of each side are used round-robin; a server that cannot be
      reached is skipped for the next one of its side within the request.
    * A prefill side that is down, or answers with a server error, costs
      only the reuse: the request goes to decode without params and the
      consumer computes the prompt itself (logged, and the response carries
      ``x-ucm-db-prefill: failed``). A prefill answer with a client error
      (4xx: the request itself is bad) is returned to the client as is.
    * A decode side that is down is a 503 whose message names the servers
      tried; the client never gets a truncated answer presented as whole:
      a stream broken midway ends without its ``[DONE]`` line.
    * No vLLM, no torch: this module imports only FastAPI, uvicorn, httpx
      and click (all installed with vLLM), and ``ucm_db.connector`` does not
      import it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import click
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ucm_db import ConfigError

logger = logging.getLogger("ucm_db.proxy")

#: Endpoints proxied through prefill then decode.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Body fields dropped from the prefill request (it answers one token, unstreamed).
_PREFILL_DROPPED = ("stream", "stream_options")
#: Headers passed on to the servers.
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def parse_urls(value: str, side: str) -> tuple[str, ...]:
    """``URL[,URL...]`` of one side, each ``http(s)://host:port`` (no path)."""
    urls = tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
    if not urls:
        raise ConfigError(f"--{side} names no server", hint=f"pass --{side} http://127.0.0.1:8100[,http://...]")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ConfigError(
                f"--{side}: {url!r} is not a server URL",
                hint=f"write each {side} server as http://HOST:PORT, comma-separated",
            )
    return urls


@dataclass
class _Side:
    """The servers of one side, handed out round-robin."""

    name: str
    urls: tuple[str, ...]
    _next: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next = itertools.cycle(range(len(self.urls)))

    def order(self) -> list[str]:
        """Every server once, starting with this request's turn."""
        start = next(self._next)
        return [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]


class _SideDown(Exception):
    """No server of a side could be reached (or all failed with 5xx)."""

    def __init__(self, side: str, failures: list[str]) -> None:
        super().__init__(f"{side} side unavailable: " + "; ".join(failures))
        self.side = side
        self.failures = failures


def _error(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    return out


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0) -> FastAPI:
    """The proxy as an ASGI app (see module docstring)."""
    prefill, decode = _Side("prefill", tuple(prefill_urls)), _Side("decode", tuple(decode_urls))
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        clients["http"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits)
        try:
            yield
        finally:
            await clients["http"].aclose()

    app = FastAPI(title="ucm-db PD proxy", lifespan=lifespan)

    async def run_prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        failures = []
        for url in prefill.order():
            try:
                response = await clients["http"].post(url + path, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code}")
                continue
            return response
        raise _SideDown("prefill", failures)

    async def open_decode(path: str, body: dict[str, Any], headers: dict[str, str], stream: bool) -> httpx.Response:
        failures = []
        for url in decode.order():
            try:
                request = clients["http"].build_request("POST", url + path, json=body, headers=headers)
                return await clients["http"].send(request, stream=stream)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
        raise _SideDown("decode", failures)

    async def proxy_completion(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        headers = _forwarded_headers(request)
        started = time.perf_counter()
        prefill_state = "ok"
        decode_body = dict(body)
        try:
            answer = await run_prefill(path, body, headers)
        except _SideDown as exc:
            logger.warning("ucm-db proxy: %s; decode computes the prompt itself", exc)
            prefill_state = "failed"
        else:
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
            params = _json_or_none(answer).get("kv_transfer_params")
            if params is not None:
                decode_body["kv_transfer_params"] = params
            else:
                prefill_state = "no-params"
        extra = {"x-ucm-db-prefill": prefill_state, "x-ucm-db-prefill-ms": f"{1e3 * (time.perf_counter() - started):.1f}"}
        stream = bool(body.get("stream"))
        try:
            response = await open_decode(path, decode_body, headers, stream)
        except _SideDown as exc:
            return _error(503, f"{exc}; start a decode server or check --decode", "service_unavailable")
        if not stream:
            return Response(response.content, status_code=response.status_code, headers=extra,
                            media_type=response.headers.get("content-type", "application/json"))
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            return Response(content, status_code=response.status_code, headers=extra, media_type="application/json")
        return StreamingResponse(
            _relay(response), status_code=200, headers=extra,
            media_type=response.headers.get("content-type", "text/event-stream"), background=BackgroundTask(response.aclose),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy_completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy_completion(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for url in decode.order():
            try:
                response = await clients["http"].get(url + "/v1/models")
            except httpx.HTTPError:
                continue
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        return _error(503, f"no decode server reachable ({', '.join(decode.urls)})", "service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        urls = [*prefill.urls, *decode.urls]
        states = await asyncio.gather(*(_server_health(clients["http"], url) for url in urls))
        by_url = dict(zip(urls, states))
        # Serving needs one decode server; without prefill it only loses reuse.
        ok = any(by_url[u] == "ok" for u in decode.urls)
        degraded = not all(by_url[u] == "ok" for u in prefill.urls)
        report: dict[str, Any] = {
            "status": ("degraded" if degraded else "ok") if ok else "down",
            "prefill": {u: by_url[u] for u in prefill.urls},
            "decode": {u: by_url[u] for u in decode.urls},
        }
        return JSONResponse(report, status_code=200 if ok else 503)

    return app


async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
    """The decode server's stream, chunk by chunk. A broken upstream ends
    the stream early (no ``[DONE]``), which SSE clients report as an error."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        logger.warning("ucm-db proxy: decode stream broke midway: %s", exc)


async def _server_health(client: httpx.AsyncClient, url: str) -> str:
    try:
        response = await client.get(url + "/health", timeout=5.0)
    except httpx.HTTPError as exc:
        return f"unreachable: {type(exc).__name__}"
    return "ok" if response.status_code == 200 else f"HTTP {response.status_code}"


def _json_or_none(response: httpx.Response) -> dict[str, Any]:
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prefill", "prefill", required=True, metavar="URL[,URL...]", help="Prefill (kv_producer) servers.")
@click.option("--decode", "decode", required=True, metavar="URL[,URL...]", help="Decode (kv_consumer) servers.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="Port to listen on.")
@click.option("--timeout-s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Longest wait for one server's answer.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def main(prefill: str, decode: str, host: str, port: int, timeout_s: float, log_level: str) -> None:
    """Serve an OpenAI-compatible endpoint that prefills on --prefill servers
    and decodes on --decode servers sharing a ucm-db store.

    Example: ucm-db proxy --prefill http://127.0.0.1:8100
    --decode http://127.0.0.1:8200 --port 8000
    """
    import uvicorn

    try:
        prefill_urls, decode_urls = parse_urls(prefill, "prefill"), parse_urls(decode, "decode")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("ucm-db proxy on %s:%d: prefill %s, decode %s", host, port, ", ".join(prefill_urls), ", ".join(decode_urls))
    uvicorn.run(build_app(prefill_urls, decode_urls, timeout_s), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    main()
