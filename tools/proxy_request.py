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
      (:class:`~ucm_db.tools.proxy_bodies.BodyPool`), never on the event
      loop: see there.
"""

from __future__ import annotations

import json
import math
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
