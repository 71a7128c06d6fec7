"""One request's exchanges with the servers behind the PD proxy
(:mod:`ucm_db.tools.proxy`): the prefill, the decode, and the relay of the
decode's answer or event stream.

Invariants:
    * The prefill phase has one deadline for all its tries and reads
      (``--prefill-timeout-s``; ``--timeout-s`` does not cut it short); a
      server that cannot be reached, is saturated, answers a server error,
      ``408``/``429``, a redirect or any status but 200 and the client's
      4xx, or an answer over :data:`PREFILL_ANSWER_MAX_BYTES`, is skipped
      for the next; when none answers, decode computes the prompt itself.
      Only a 4xx that is the client's fault goes back to the client, as
      the server wrote it. A 200 is read as strictly as a client's body:
      params a decode request could not carry (``NaN``) are no params.
    * A decode request goes to the next decode server only when it was
      never sent (unreachable or saturated). Once sent, a timeout is a 504
      and a broken answer a 502 naming the server: a generation is never
      run twice.
    * An unstreamed decode answer is bounded as a whole by ``--timeout-s``;
      a stream's first bytes are too, then each gap between two chunks.
    * A stream that breaks midway (or stalls past ``--timeout-s``) ends with
      an SSE error event in the OpenAI style (``data: {"error": {...}}``),
      never with ``[DONE]``: the OpenAI client raises, so no client takes a
      truncated answer for a whole one. Events are relayed whole (a partial
      event at the break is dropped), so the error event always parses.
    * Every request counted in flight on a server is released exactly once,
      whether its answer ended, broke, or its client went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ucm_db.tools.proxy_request import BadRequest, parse_body
from ucm_db.tools.proxy_upstreams import CONNECT_TIMEOUT_S, POOL_WAIT_S, Side, Upstream, describe, unsent

logger = logging.getLogger("ucm_db.proxy")

#: A prefill answer is one token; anything longer is not a producer's answer.
PREFILL_ANSWER_MAX_BYTES = 16 << 20
#: Where SSE events end (a blank line, in any of SSE's line endings).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_LONGEST_END = max(map(len, _EVENT_ENDS))
#: The longest event relayed; a stream past it without an event end is cut with an error event (each chunk
#: is scanned once, but the pending bytes are the proxy's memory).
MAX_EVENT_BYTES = 16 << 20


def error_response(status: int, message: str, kind: str = "proxy_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


class SideDown(Exception):
    """A side could not answer; ``status`` is what the client gets (502, 503, 504)."""

    def __init__(self, status: int, message: str, kind: str = "service_unavailable") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass
class Prefill:
    """The prefill phase's outcome: ``state`` is the ``x-ucm-db-prefill``
    header (``ok``, ``no-params``, ``failed``, ``rejected``)."""

    state: str
    params: dict[str, Any] | None = None
    #: The client's error, as the prefill server answered it (state ``rejected``).
    answer: Response | None = None


async def run_prefill(side: Side, path: str, payload: bytes, headers: dict[str, str], deadline_s: float,
                      option: str = "--prefill-timeout-s") -> Prefill:
    """Asks the prefill side for one token (see module invariants);
    ``option`` names what set ``deadline_s``."""
    failures: list[str] = []
    server = None
    try:
        async with asyncio.timeout(deadline_s):
            for server in side.order():
                outcome = await _ask_prefill(server, path, payload, headers, failures, (deadline_s, option))
                if outcome is not None:
                    return outcome
    except TimeoutError:
        failures.append(f"{server.url if server else side.name}: no answer within {option} {deadline_s:g} s")
    logger.warning("ucm-db proxy: prefill side unavailable: %s; decode computes the prompt itself", "; ".join(failures))
    return Prefill("failed")


async def _ask_prefill(server: Upstream, path: str, payload: bytes, headers: dict[str, str], failures: list[str],
                       deadline: tuple[float, str]) -> Prefill | None:
    if not server.try_acquire():
        failures.append(server.saturated())
        return None
    # Each read may take the phase's whole deadline, not --timeout-s: a longer --prefill-timeout-s holds.
    timeout = httpx.Timeout(deadline[0], connect=CONNECT_TIMEOUT_S, pool=POOL_WAIT_S)
    try:
        async with server.client.stream("POST", server.url + path, content=payload, headers=headers,
                                        timeout=timeout) as response:
            raw = await _read_capped(response, PREFILL_ANSWER_MAX_BYTES)
    except httpx.HTTPError as exc:
        failures.append(f"{server.url}: {describe(exc, *deadline)}")
        return None
    finally:
        server.release()
    status = response.status_code
    if raw is None:
        failures.append(f"{server.url}: an answer over {PREFILL_ANSWER_MAX_BYTES >> 20} MiB")
    elif status == 200:
        return _published(server.url, raw)
    elif 400 <= status < 500 and status not in (408, 429):
        content_type = response.headers.get("content-type", "application/json")
        return Prefill("rejected", answer=Response(raw, status_code=status, media_type=content_type))
    else:
        failures.append(f"{server.url}: HTTP {status}")
    return None


async def _read_capped(response: httpx.Response, cap: int) -> bytes | None:
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _published(url: str, raw: bytes) -> Prefill:
    try:  # as strictly as a client's body: params holding NaN or 1e400 could not be sent on to decode
        answer: Any = parse_body(raw)
    except BadRequest:
        answer = None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if isinstance(params, dict):
        return Prefill("ok", params)
    what = "has no kv_transfer_params object" if isinstance(answer, dict) else "is not a JSON object (or holds NaN)"
    logger.warning("ucm-db proxy: the answer of prefill server %s %s (is it a kv_producer?); decode computes the "
                   "prompt itself", url, what)
    return Prefill("no-params")


async def run_decode(side: Side, path: str, payload: bytes, headers: dict[str, str], stream: bool, timeout_s: float,
                     extra: dict[str, str]) -> Response:
    """The decode side's answer, or its event stream, as the client's response."""
    failures: list[str] = []
    saturated = 0
    for server in side.order():
        if not server.try_acquire():
            failures.append(server.saturated())
            saturated += 1
            continue
        try:
            return await _decode_on(server, path, payload, headers, stream, timeout_s, extra)
        except httpx.HTTPError as exc:
            if not unsent(exc):
                raise _lost(server.url, exc, timeout_s) from exc
            failures.append(f"{server.url}: {describe(exc, timeout_s)}")
        except TimeoutError as exc:
            raise _lost(server.url, exc, timeout_s) from exc
    full = saturated == len(failures)
    hint = "raise --max-connections or add decode servers" if full else "start a decode server or check --decode"
    raise SideDown(503, f"decode side unavailable: {'; '.join(failures)}; {hint}")


def _lost(url: str, exc: BaseException, timeout_s: float) -> SideDown:
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return SideDown(504, f"decode server {url} did not answer within --timeout-s {timeout_s:g} s; raise "
                             "--timeout-s or check the server", "timeout")
    return SideDown(502, f"decode server {url} broke off its answer: {describe(exc, timeout_s)}", "upstream_error")


async def _decode_on(server: Upstream, path: str, payload: bytes, headers: dict[str, str], stream: bool,
                     timeout_s: float, extra: dict[str, str]) -> Response:
    """One decode server's answer; releases ``server`` unless a stream now holds it."""
    relayed = False
    try:
        async with asyncio.timeout(timeout_s):
            request = server.client.build_request("POST", server.url + path, content=payload, headers=headers)
            response = await server.client.send(request, stream=True)
            try:
                if not stream or response.status_code != 200:
                    content = await response.aread()
                    media_type = response.headers.get("content-type", "application/json")
                    return Response(content, status_code=response.status_code, headers=extra, media_type=media_type)
                relayed = True
                return RelayResponse(server, response, timeout_s, extra)
            finally:
                if not relayed:
                    await response.aclose()
    finally:
        if not relayed:
            server.release()


class RelayResponse(StreamingResponse):
    """The decode server's event stream; closes the upstream response and
    releases its server once, however the relay ends."""

    def __init__(self, server: Upstream, upstream: httpx.Response, timeout_s: float, extra: dict[str, str]) -> None:
        media_type = upstream.headers.get("content-type", "text/event-stream")
        events = media_type.startswith("text/event-stream")
        super().__init__(relay(upstream, server.url, timeout_s, events), status_code=200, headers=extra,
                         media_type=media_type)
        self._server, self._upstream, self._closed = server, upstream, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.release()
        with anyio.CancelScope(shield=True):  # a client that went away cancels us; the upstream must still close
            await self._upstream.aclose()


async def relay(upstream: httpx.Response, url: str, timeout_s: float, events: bool = True) -> AsyncIterator[bytes]:
    """The upstream's stream, whole events at a time; a break ends it with an error event."""
    pending = bytearray()
    try:
        async for chunk in upstream.aiter_bytes():
            if not events:
                yield chunk
                continue
            searched = max(0, len(pending) - _LONGEST_END + 1)  # only the new bytes (and a separator's start before them)
            pending += chunk
            end = max((pending.rfind(sep, searched) + len(sep) for sep in _EVENT_ENDS if pending.find(sep, searched) >= 0),
                      default=0)
            if end:
                yield bytes(pending[:end])
                del pending[:end]
            elif len(pending) > MAX_EVENT_BYTES:  # no event end in sight: not a stream of events a client can take
                logger.warning("ucm-db proxy: decode stream from %s sent %d bytes without ending an event", url, len(pending))
                yield sse_error(502, f"decode stream from {url} sent an event over {MAX_EVENT_BYTES >> 20} MiB")
                return
    except httpx.HTTPError as exc:
        if isinstance(exc, httpx.TimeoutException):
            reason, status = f"nothing for --timeout-s {timeout_s:g} s", 504
        else:
            reason, status = describe(exc, timeout_s), 502
        logger.warning("ucm-db proxy: decode stream from %s broke midway: %s (%d bytes of a partial event dropped)",
                       url, reason, len(pending))
        yield sse_error(status, f"decode stream from {url} broke midway: {reason}")
        return
    if pending:
        yield bytes(pending)


def sse_error(status: int, message: str) -> bytes:
    """An error event as vLLM streams one (the OpenAI client raises ``APIError`` on it)."""
    error = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return f"data: {json.dumps(error)}\n\n".encode()
