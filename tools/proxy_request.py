"""What the PD proxy reads from a client and what it sends each side: the
client's body (bounded, strict JSON), the headers it passes on, the prefill
request and the decode request (:mod:`ucm_db.tools.proxy`).

Invariants:
    * A request that cannot be forwarded as it is gets a 4xx JSON error
      (:class:`BadRequest`) before any server is called: a body over the
      limit (413), one that is not a JSON object, holds ``NaN``/``Infinity``
      or a number out of float range (JSON has neither, and vLLM's encoder
      refuses them), or nests deeper than Python's JSON parser goes, and a
      passed-on header that is not ASCII (400). Nothing a client sends ends
      in a 500 with a traceback.
    * The client's body is never modified: each side gets its own copy.
    * The prefill request asks for one token, unstreamed, one choice, and
      drops what conflicts with one token: ``min_tokens`` (vLLM refuses
      ``min_tokens > max_tokens``; it is the only sampling field vLLM checks
      against ``max_tokens``). It drops ``prompt_logprobs`` and ``echo``
      too: its answer is read only for its params, and with them it held a
      whole prompt's logprobs (a long prompt's ran past the 16 MiB the proxy
      reads of a prefill answer, so the reuse was lost), computed with
      vLLM's prefix cache and ucm-db's loads off (vLLM turns both off for a
      request that asks for prompt logprobs). The decode request keeps
      both: its server computes the prompt itself for them.
    * The decode request is the client's body with ``kv_transfer_params``
      merged (:func:`merge_params`): the client's own controls
      (``{"ucm_db": {"load": false, "max_load_tokens": N}}``) and other
      connectors' keys stay; the producer's publication wins a field both
      name (what was committed is the producer's to announce).
    * Both requests are spliced from one encoding of the body's other
      fields (:func:`prepare`): the body is parsed once and encoded once,
      whatever its size, and the decode request is finished when the
      publication is known without touching the body again. The client's
      ``kv_transfer_params`` are parsed again for the merge, so they are
      bounded (:data:`MAX_CLIENT_PARAMS_BYTES`, else a 400).
    * A body over ``offload_body_bytes`` is prepared in a worker process
      (:class:`BodyPool`), never on the event loop: see there.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucm_db.tools.proxy_upstreams import MIB

if TYPE_CHECKING:  # the body pool's workers import this module: they need no web framework
    from fastapi import Request

#: Body fields dropped from the prefill request (it answers one token, unstreamed;
#: vLLM refuses min_tokens above max_tokens; the prompt's logprobs and echo are the decode answer's).
PREFILL_DROPPED = ("stream", "stream_options", "min_tokens", "prompt_logprobs", "echo")
#: Headers passed on to the servers, sent under these names (the client's are matched without regard to case).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
#: The fields each side sets its own way; every other field is encoded once and shared by both requests.
SIDE_FIELDS = ("stream", "stream_options", "min_tokens", "max_tokens", "max_completion_tokens", "n",
               "prompt_logprobs", "echo", "kv_transfer_params")
#: The client's ``kv_transfer_params`` are parsed a second time, on the event loop, to merge the publication
#: in: a larger object (vLLM's are a few hundred bytes) is refused.
MAX_CLIENT_PARAMS_BYTES = 1 * MIB
#: How long a stopping proxy waits for a body worker to take its stop message before terminating it.
WORKER_STOP_WAIT_S = 5.0
#: How long a dead worker's exit code may take to appear where the pool's manager thread reaped it.
EXIT_CODE_WAIT_S = 0.5


class BadRequest(Exception):
    """The client's request cannot be forwarded; ``status`` is the 4xx to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ProxyBusy(Exception):
    """Too many large bodies are being prepared; the client gets a 503 and may retry."""


class _NotFinite(ValueError):
    pass


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The client's body, read at most ``max_body_bytes`` far (a declared
    ``Content-Length`` over it is refused before reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_body_bytes: int) -> BadRequest:
    return BadRequest(413, f"the request body is over {max_body_bytes / MIB:g} MiB; raise --max-body-mb to allow it")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, strictly (see module invariants)."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise BadRequest(400, f"the request body has {exc}, which JSON does not allow") from exc
    except RecursionError as exc:
        raise BadRequest(400, "the request body nests too deeply") from exc
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer of too many digits
        raise BadRequest(400, "the request body is not JSON") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    return body


def _refuse_constant(name: str) -> float:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"the number {text[:40]} (out of float range)")
    return value


def encode(body: Any) -> bytes:
    """``body`` (or one value of it) as the JSON a server gets (ASCII-escaped: a lone surrogate a
    client escaped into a string cannot break the encoding)."""
    try:
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    except RecursionError as exc:
        raise BadRequest(400, "the request body nests too deeply") from exc


def forwarded_headers(request: Request) -> dict[str, str]:
    """The headers passed on to the servers; each must be ASCII (httpx, and
    HTTP itself, take nothing else in practice). The bodies sent are the
    JSON :func:`encode` writes: vLLM's server refuses any other media type."""
    out = {"content-type": "application/json"}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is None:
            continue
        if not value.isascii():
            raise BadRequest(400, f"header {name} must be ASCII")
        out[name] = value
    return out


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    return out


def decode_body(body: dict[str, Any], published: dict[str, Any] | None) -> dict[str, Any]:
    """The decode server's request: the client's body, with the producer's
    publication (None: none) merged into its ``kv_transfer_params``."""
    out = dict(body)
    if published is not None:
        out["kv_transfer_params"] = merge_params(body.get("kv_transfer_params"), published)
    return out


def merge_params(client: Any, published: dict[str, Any]) -> dict[str, Any]:
    """The client's ``kv_transfer_params`` with the publication merged in:
    under a key both hold as objects (``ucm_db``), the client's fields stay
    and the publication's win where both name one; any other key of either
    stays. A client value that is not an object is replaced."""
    if not isinstance(client, dict):
        return dict(published)
    merged = dict(client)
    for key, value in published.items():
        mine = client.get(key)
        merged[key] = {**mine, **value} if isinstance(mine, dict) and isinstance(value, dict) else value
    return merged


@dataclass(frozen=True)
class Prepared:
    """A client's body made ready for both sides, as JSON object members
    (no braces): the body's fields but :data:`SIDE_FIELDS`, encoded once
    and shared; each side's own fields; the client's ``kv_transfer_params``
    (None: it sent none). Each request is joined when it is sent."""

    members: bytes
    prefill_fields: bytes
    decode_fields: bytes
    client_params: bytes | None
    stream: bool

    def prefill_payload(self) -> bytes:
        """The prefill request, JSON-equal to ``encode(prefill_body(body))``."""
        return _object(self.members, self.prefill_fields)

    def decode_payload(self, published: dict[str, Any] | None) -> bytes:
        """The decode request, JSON-equal to ``encode(decode_body(body, published))``."""
        params = self.client_params
        if published is not None:
            client = json.loads(self.client_params) if self.client_params is not None else None
            params = encode(merge_params(client, published))
        merged = _members({} if params is None else {"kv_transfer_params": params})
        return _object(self.members, self.decode_fields, merged)


def prepare(raw: bytes) -> Prepared:
    """``raw`` parsed strictly (:func:`parse_body`) and encoded once, as
    both sides' requests (see module invariants)."""
    body = parse_body(raw)
    members = encode({k: v for k, v in body.items() if k not in SIDE_FIELDS})[1:-1]
    prefill_fields = {k: encode(v) for k, v in prefill_body(body).items() if k in SIDE_FIELDS}
    decode_fields = {k: encode(body[k]) for k in SIDE_FIELDS if k in body and k != "kv_transfer_params"}
    client_params = encode(body["kv_transfer_params"]) if "kv_transfer_params" in body else None
    if client_params is not None and len(client_params) > MAX_CLIENT_PARAMS_BYTES:
        raise BadRequest(400, f"kv_transfer_params are over {MAX_CLIENT_PARAMS_BYTES / MIB:g} MiB of JSON; "
                              "send only the connectors' controls there")
    return Prepared(members, _members(prefill_fields), _members(decode_fields), client_params, bool(body.get("stream")))


def _members(fields: dict[str, bytes]) -> bytes:
    """Encoded values as JSON object members (no braces)."""
    return b",".join(json.dumps(name).encode() + b":" + value for name, value in fields.items())


def _object(*members: bytes) -> bytes:
    """A JSON object of members (no braces; empty ones skipped), copied once."""
    return b"{" + b",".join(part for part in members if part) + b"}"


class BodyPool:
    """Prepares a body over ``offload_body_bytes`` in a worker process; a
    smaller one on the event loop (a few ms at most).

    Invariants:
        * The C JSON parser holds the GIL for a whole call, so a thread
          would stall every other stream as the event loop would: a large
          body is parsed and encoded in a process of a pool started on first
          need (``spawn``: no copy of the server's event loop or sockets),
          of ``workers`` processes. A spawned worker imports the main
          module: a program serving :func:`~ucm_db.tools.proxy.build_app`
          itself starts it under ``if __name__ == "__main__":`` (``ucm-db
          proxy`` and ``python -m ucm_db.tools.proxy`` do).
        * What crosses the pipe is the raw body one way and
          :func:`prepare_in_worker`'s bytes, str and int the other: never an
          object graph of the body.
        * A worker's answer is :func:`prepare`'s to the byte: the same
          requests, the same 400 for the same bad body, before any server is
          called.
        * Large bodies in flight (waiting for a worker or prepared by one)
          hold at most ``budget_bytes`` (one is always let in): past it the
          client gets 503 with ``Retry-After`` (:class:`ProxyBusy`), not an
          unbounded queue of bodies in memory. A body counts until its
          worker is done with it, even when its client left first.
        * A worker that dies while preparing bodies is a 503 for the
          requests it held (the message says how it ended: signal 9 is
          likely the out-of-memory killer). One that died idle costs no
          request: the body was not sent, a fresh pool takes it.
        * :meth:`close` waits for every worker to exit (terminating one
          that does not within :data:`WORKER_STOP_WAIT_S`): uvicorn re-raises
          SIGTERM after the lifespan ends, so no exit hook would stop them.

    Why a process pool: a thread does not help (the GIL), and a lower
    ``--max-body-mb`` alone does not either (measured on the event loop:
    1 MiB of ``logit_bias`` held it 140 ms, 24 MiB 3.3 s). The threshold,
    256 KiB, holds the loop at most ~20 ms (0.25 MiB of ``logit_bias``
    measured 20 ms to parse and encode); a 128K-token prompt sent as token
    ids (about 1 MiB) goes to a worker, whose round trip adds a few ms.
    """

    def __init__(self, offload_body_bytes: int, budget_bytes: int, workers: int) -> None:
        self.offload_body_bytes, self.budget_bytes, self.workers = offload_body_bytes, budget_bytes, workers
        self._pool: ProcessPoolExecutor | None = None
        self._held_bytes = 0
        self._lock = threading.Lock()  # done-callbacks run on the pool's own thread

    async def prepare(self, raw: bytes) -> Prepared:
        if len(raw) <= self.offload_body_bytes:
            return prepare(raw)
        with self._lock:
            if self._held_bytes and self._held_bytes + len(raw) > self.budget_bytes:
                raise ProxyBusy(f"{self._held_bytes / MIB:.0f} MiB of large request bodies are being prepared "
                                f"(the bound is {self.budget_bytes / MIB:g} MiB); retry shortly")
            self._held_bytes += len(raw)
        try:
            pool, future = self._submit(raw)
        except BrokenProcessPool as exc:
            self._release(len(raw))
            raise ProxyBusy("the workers preparing large request bodies cannot be started; retry shortly") from exc
        except BaseException:
            self._release(len(raw))
            raise
        future.add_done_callback(lambda _: self._release(len(raw)))
        try:
            status, message, members, prefill_fields, decode_fields, params, flags = await asyncio.wrap_future(future)
        except BrokenProcessPool as exc:
            codes = await asyncio.to_thread(_exit_codes, pool)
            raise self._dropped(pool, codes) from exc
        if status:
            raise BadRequest(status, message)
        return Prepared(members, prefill_fields, decode_fields, params if flags & 2 else None, bool(flags & 1))

    def close(self) -> None:
        """Stops the workers and waits for them to exit (blocking: call it
        off the event loop). A worker still running after
        :data:`WORKER_STOP_WAIT_S` is terminated: nothing outlives the proxy."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool)

    def _submit(self, raw: bytes) -> tuple[ProcessPoolExecutor, Future[Any]]:
        pool = self._pool or self._start()
        try:
            return pool, pool.submit(prepare_in_worker, raw)
        except BrokenProcessPool:
            # A worker died while idle: nothing was sent, so a fresh pool takes the body.
            self._discard(pool)
        pool = self._start()
        return pool, pool.submit(prepare_in_worker, raw)

    def _start(self) -> ProcessPoolExecutor:
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)  # a broken pool's manager thread ends it itself

    def _dropped(self, pool: ProcessPoolExecutor, codes: list[int]) -> ProxyBusy:
        self._discard(pool)
        if -9 in codes:
            why = "was killed by signal 9 (out of memory?)"
        elif codes:
            why = "exited with " + ", ".join(f"signal {-c}" if c < 0 else f"code {c}" for c in codes)
        else:
            why = "died"
        return ProxyBusy(f"the worker preparing large request bodies {why} while preparing this one; retry shortly")

    def _release(self, size: int) -> None:
        with self._lock:
            self._held_bytes -= size


def prepare_in_worker(raw: bytes) -> tuple[int, str, bytes, bytes, bytes, bytes, int]:
    """:func:`prepare` in a worker: ``(status, message, members, prefill
    fields, decode fields, client params, flags)``; a status is a
    :class:`BadRequest`'s, 0 for none; flags: 1 stream, 2 client params sent."""
    try:
        done = prepare(raw)
    except BadRequest as exc:
        return exc.status, exc.message, b"", b"", b"", b"", 0
    except MemoryError:
        message = "the request body is too large to prepare in the proxy's memory; send a smaller one"
        return 413, message, b"", b"", b"", b"", 0
    flags = int(done.stream) | (2 if done.client_params is not None else 0)
    return 0, "", done.members, done.prefill_fields, done.decode_fields, done.client_params or b"", flags


def _workers_of(pool: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    # ProcessPoolExecutor exposes neither its processes nor their exit codes; read its own table.
    return list((getattr(pool, "_processes", None) or {}).values())


def _exit_codes(pool: ProcessPoolExecutor) -> list[int]:
    """The non-zero exit codes of a broken pool's workers (blocking, briefly: its manager thread may
    see a worker's pipe close before the worker can be reaped, and terminates the others).

    That thread joins the workers too: where it reaped one between this thread's wait and its
    own ``waitpid`` (which then finds no child), the exit code reads None until that thread has
    stored it, so it is read again for a moment."""
    codes = set()
    for worker in _workers_of(pool):
        worker.join(WORKER_STOP_WAIT_S)
        deadline_s = time.monotonic() + EXIT_CODE_WAIT_S
        while worker.exitcode is None and time.monotonic() < deadline_s:
            time.sleep(0.005)
        if worker.exitcode:
            codes.add(worker.exitcode)
    return sorted(codes)


def _stop(pool: ProcessPoolExecutor) -> None:
    """``pool`` shut down and its workers gone: its manager thread sends each
    worker its stop message and joins it; one that has not exited within
    :data:`WORKER_STOP_WAIT_S` is terminated."""
    workers = _workers_of(pool)
    stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True},
                               name="ucm-db-body-pool-stop", daemon=True)
    stopper.start()
    stopper.join(WORKER_STOP_WAIT_S)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(WORKER_STOP_WAIT_S)
    stopper.join(WORKER_STOP_WAIT_S)
