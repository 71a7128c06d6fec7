"""The prefill/decode proxy: one OpenAI-compatible endpoint in front of
prefill (``kv_producer``) and decode (``kv_consumer``) vLLM servers that
share a ucm-db store.

    ucm-db proxy --prefill http://p1:8100,http://p2:8100 \\
        --decode http://d1:8200 --port 8000

For each ``/v1/completions`` or ``/v1/chat/completions`` request it sends the
body to a prefill server with ``max_tokens=1`` and no streaming, takes the
``kv_transfer_params`` of its answer (what the producer published, see
:mod:`ucm_db.connector.roles`), merges them into the body's own and sends
it to a decode server, whose answer or event stream goes back to the
client. ``GET /health`` reports every server; ``GET /v1/models`` asks every
decode server at once and returns the first success. The parts:
:mod:`~ucm_db.tools.proxy_request` (what is read from the client and sent
each side), :mod:`~ucm_db.tools.proxy_upstreams` (URLs, limits, a pool per
server), :mod:`~ucm_db.tools.proxy_relay` (the
exchanges and the stream relay).

Invariants:
    * Servers of each side are used round-robin; a server that cannot be
      reached (or whose ``--max-connections`` are all in use) is skipped
      for the next one of its side within the request.
    * A prefill side that fails in any way (down, a server error, a
      timeout, no params) costs only the reuse: the request goes to decode
      without params and the consumer computes the prompt itself (logged,
      and the response carries ``x-ucm-db-prefill: failed`` or
      ``no-params``). A prefill answer that is the client's error (a 4xx
      but 408/429) is returned to the client as is (``rejected``).
    * A decode side that cannot be reached is a 503 whose message names the
      servers tried; a decode server that times out is a 504, one that
      breaks its answer a 502; a stream broken midway ends with an SSE error
      event, never with ``[DONE]``: no client gets a truncated answer
      presented as whole.
    * A client that goes away before its answer starts cancels the upstream
      work (a vLLM server aborts a request whose connection closes); a
      streaming client that goes away closes the upstream stream.
    * A client's input never makes a 500: what cannot be forwarded is a 4xx
      JSON error (:mod:`~ucm_db.tools.proxy_request`), checked before any
      server is called.
    * One client's large body stalls no other client's stream: a body over
      256 KiB is parsed and encoded in a worker process
      (:class:`~ucm_db.tools.proxy_bodies.BodyPool`; measured with a 94 MiB
      body of token ids, the other streams stalled 2.7-5.3 s when it was
      done on the event loop). Large bodies in flight are bounded in bytes;
      past the bound a client gets 503 with ``Retry-After``. A body is
      bounded by ``--max-body-mb``, 32 MiB by default: a worker parsing a
      body of numbers peaks at 10-16 times its size (measured: 97 MiB of
      token ids 0.95 GiB, 47 MiB of ``logit_bias`` 0.7 GiB), so 32 MiB keeps
      two workers under 1 GiB while allowing 30 times a 128K-token prompt
      sent as token ids (about 1 MiB) and chat bodies with several base64
      images; a client with more raises the option (the 413 names it).
    * No vLLM, no torch: this module imports only FastAPI, uvicorn, httpx
      and click (all installed with vLLM), and ``ucm_db.connector`` does not
      import it.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import click
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ucm_db import ConfigError
from ucm_db.tools.proxy_relay import SideDown, error_response, run_decode, run_prefill
from ucm_db.tools.proxy_bodies import BodyPool
from ucm_db.tools.proxy_request import BadRequest, Prepared, ProxyBusy, forwarded_headers, prefill_body, read_body
from ucm_db.tools.proxy_upstreams import HEALTH_TIMEOUT_S, MIB, ProxyLimits, Side, Upstream, parse_urls

__all__ = ["COMPLETION_PATHS", "ProxyLimits", "build_app", "main", "parse_urls", "prefill_body"]

logger = logging.getLogger("ucm_db.proxy")

#: Endpoints proxied through prefill then decode.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: The status of a request whose client left first (nginx's "client closed request"; nobody reads it).
CLIENT_GONE = 499


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0,
              limits: ProxyLimits | None = None) -> FastAPI:
    """The proxy as an ASGI app (see module docstring); ``limits`` overrides
    ``timeout_s``. Large bodies go to spawned workers: serve it from under
    ``if __name__ == "__main__":``."""
    limits = limits or ProxyLimits(timeout_s=timeout_s)
    prefill, decode = Side("prefill", prefill_urls, limits), Side("decode", decode_urls, limits)
    bodies = BodyPool(limits.offload_body_bytes, limits.offload_budget_bytes, limits.body_workers)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        prefill.open()
        decode.open()
        try:
            yield
        finally:
            await asyncio.to_thread(bodies.close)  # uvicorn has waited for the requests in flight
            await asyncio.gather(prefill.aclose(), decode.aclose())

    app = FastAPI(title="ucm-db PD proxy", lifespan=lifespan)

    async def exchange(path: str, body: Prepared, headers: dict[str, str]) -> Response:
        started = time.perf_counter()
        outcome = await run_prefill(prefill, path, body.prefill_payload(), headers, *limits.prefill_deadline)
        extra = {"x-ucm-db-prefill": outcome.state, "x-ucm-db-prefill-ms": f"{1e3 * (time.perf_counter() - started):.1f}"}
        if outcome.answer is not None:
            outcome.answer.headers.update(extra)
            return outcome.answer
        try:
            payload = body.decode_payload(outcome.params)
            return await run_decode(decode, path, payload, headers, body.stream, limits.timeout_s, extra)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, "invalid_request_error", extra)
        except SideDown as exc:
            logger.warning("ucm-db proxy: %s", exc)
            return error_response(exc.status, str(exc), exc.kind, extra)

    async def proxy_completion(request: Request, path: str) -> Response:
        try:
            body = await bodies.prepare(await read_body(request, limits.max_body_bytes))
            headers = forwarded_headers(request)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, "invalid_request_error")
        except ProxyBusy as exc:
            return error_response(503, str(exc), "service_unavailable", {"retry-after": "1"})
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        try:
            return await until_disconnected(request, exchange(path, body, headers))
        except Exception as exc:  # a bug of the proxy's own: a JSON 500, logged once with its traceback
            logger.exception("ucm-db proxy: %s failed", path)
            return error_response(500, f"internal proxy error: {type(exc).__name__}: {exc}")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy_completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy_completion(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await _first_answer(decode.order(), "/v1/models")
        if answer is None:
            return error_response(503, f"no decode server reachable ({', '.join(decode.urls)})", "service_unavailable")
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))

    @app.get("/health")
    async def health() -> JSONResponse:
        servers = [*prefill.servers, *decode.servers]
        states = await asyncio.gather(*(_server_health(server) for server in servers))
        by_url = dict(zip([server.url for server in servers], states))
        # Serving needs one decode server; without prefill it only loses reuse.
        ok = any(by_url[u] == "ok" for u in decode.urls)
        degraded = not all(by_url[u] == "ok" for u in prefill.urls)
        report: dict[str, Any] = {
            "status": ("degraded" if degraded else "ok") if ok else "down",
            "prefill": {u: by_url[u] for u in prefill.urls},
            "decode": {u: by_url[u] for u in decode.urls},
            "in_flight": {s.url: s.in_flight for s in [*prefill.servers, *decode.servers]},
        }
        return JSONResponse(report, status_code=200 if ok else 503)

    return app


async def _first_answer(servers: list[Upstream], path: str) -> httpx.Response | None:
    """The first 2xx answer to ``GET path`` of any of ``servers``, asked all
    at once (one that hangs or is down delays no other: asked one after
    another, each dead server cost ``HEALTH_TIMEOUT_S``); with none, the
    first other answer (a broken server's fast 500 never beats a healthy
    server's slower 200); None when none answers within the timeout. The
    others' requests are cancelled."""
    async def ask(server: Upstream) -> httpx.Response:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            return await server.control.get(server.url + path)

    pending = {asyncio.ensure_future(ask(server)) for server in servers}
    fallback: httpx.Response | None = None
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            errors = [task.exception() for task in done]  # each retrieved: none logged as never retrieved
            for task, exc in zip(done, errors):
                if exc is None:
                    answer = task.result()
                    if answer.is_success:
                        return answer
                    fallback = fallback or answer
                elif not isinstance(exc, (httpx.HTTPError, TimeoutError)):
                    raise exc  # a bug of the proxy's own
        return fallback
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def until_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response, or, when the client goes away first, ``work``
    cancelled (its upstream requests closed: vLLM aborts them)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        logger.info("ucm-db proxy: the client left before its answer; its upstream requests were cancelled")
        return Response(status_code=CLIENT_GONE)
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _server_health(server: Upstream) -> str:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            response = await server.control.get(server.url + "/health")
    except TimeoutError:
        return f"unreachable: no answer within {HEALTH_TIMEOUT_S:g} s"
    except httpx.HTTPError as exc:
        return f"unreachable: {type(exc).__name__}"
    return "ok" if response.status_code == 200 else f"HTTP {response.status_code}"


def _finite(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not value < float("inf"):  # FloatRange lets nan (and inf) through
        raise click.BadParameter(f"{value} is not a finite number (pass a large one for a long wait)")
    return value


def _resolvable(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise click.BadParameter(f"{value!r} cannot be resolved ({exc.strerror or exc}); pass an address of this "
                                 "machine such as 127.0.0.1 or 0.0.0.0") from exc
    return value


def _raise_open_files_limit() -> None:
    """Every relayed request holds two sockets; lift the soft limit to the
    hard one as vLLM's server does (a default of 1024 runs out first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.warning("ucm-db proxy: open files stay limited to %d (%s)", soft, exc)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prefill", "prefill", required=True, metavar="URL[,URL...]", help="Prefill (kv_producer) servers.")
@click.option("--decode", "decode", required=True, metavar="URL[,URL...]", help="Decode (kv_consumer) servers.")
@click.option("--host", default="127.0.0.1", show_default=True, callback=_resolvable, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="Port to listen on.")
@click.option("--timeout-s", type=click.FloatRange(min=1), default=600.0, show_default=True, callback=_finite,
              help="Longest wait for a decode server: its whole answer, or for a stream its first bytes and then "
                   "each gap between two chunks (a stream may last longer); then 504.")
@click.option("--prefill-timeout-s", type=click.FloatRange(min=1), default=None, callback=_finite,
              show_default="--timeout-s", help="Longest wait for the prefill phase, every prefill server tried; then "
                                               "decode computes the prompt itself.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests in flight to one server (each server has its own pool); past it the side's next "
                   "server is used, or the client gets 503 'proxy saturated'.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=32.0, show_default=True, callback=_finite,
              help="Largest request body, in MiB; a larger one gets 413.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def main(prefill: str, decode: str, host: str, port: int, timeout_s: float, prefill_timeout_s: float | None,
         max_connections: int, max_body_mb: float, log_level: str) -> None:
    """Serve an OpenAI-compatible endpoint that prefills on --prefill servers
    and decodes on --decode servers sharing a ucm-db store.

    Example: ucm-db proxy --prefill http://127.0.0.1:8100
    --decode http://127.0.0.1:8200 --port 8000
    """
    import uvicorn

    try:
        prefill_urls, decode_urls = parse_urls(prefill, "prefill"), parse_urls(decode, "decode")
        limits = ProxyLimits(timeout_s=timeout_s, prefill_timeout_s=prefill_timeout_s, max_connections=max_connections,
                             max_body_bytes=max(1, int(max_body_mb * MIB)))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":  # httpx logs every upstream request at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    _raise_open_files_limit()
    logger.info("ucm-db proxy on %s:%d: prefill %s, decode %s", host, port, ", ".join(prefill_urls), ", ".join(decode_urls))
    uvicorn.run(build_app(prefill_urls, decode_urls, limits=limits), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    main()
