"""The messages between a parent and its commit process, over one Unix
stream socket.

A message is a 5-byte head (``op``: u8, payload length: u32) and its
payload; a :data:`MAP` message carries one file descriptor (a shared
buffer's memfd) as ancillary data on its head. Payloads are JSON objects
(a request's namespace, keys in hex, offsets) or, for replies, a status
byte, two doubles and a UTF-8 message: nothing is unpickled, and the child
reads only what its own parent wrote.

Invariants:
    * Every request with a reply (:data:`OPEN`, :data:`PUT`, :data:`DELETE`)
      gets exactly one, in request order; :data:`MAP`, :data:`FORGET` and
      :data:`CLOSE` get none. A put's :data:`OK` names the keys it stored
      (:func:`pack_stored_keys`).
    * The child answers its :data:`OPEN` with its :data:`IDENTITY`; the
      parent sends nothing else to a child whose identity is not its own
      (another ucm-db version, or a ``ucm_db`` found elsewhere).
    * A short read (the peer gone) raises :class:`ConnectionError`; the
      caller decides what that means (the child exits, the parent falls
      back to committing itself).
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_db import errors
from ucm_db.errors import ConfigError
from ucm_db.version import __version__

OPEN, MAP, FORGET, PUT, DELETE, CLOSE = 1, 2, 3, 4, 5, 6
#: Reply statuses: the put or delete committed; it raised MissingAncestorError;
#: StoreFullError; another ucm-db or OS error. A failure's message is
#: :func:`pack_error`'s JSON: the parent raises the same public error class
#: with the same message and hint (:func:`unpack_error`).
OK, MISSING_ANCESTOR, STORE_FULL, FAILED = 0, 1, 2, 3
#: The messages' version: raised with any change of their layout or meaning.
VERSION = 1
#: What a child answers its OPEN with: the messages' version, ucm-db's, and where this module lies.
IDENTITY = json.dumps({"wire": VERSION, "ucm_db": __version__, "at": str(Path(__file__).resolve())}, separators=(",", ":"))
_HEAD = struct.Struct("<BI")
_REPLY = struct.Struct("<Bdd")
#: Longest payload either side accepts: the child ends on a longer one (a
#: broken stream), so the parent never writes one (a request over it is
#: refused unsent: ucm_db.committer's invariants). Most rounds' keys and
#: event fields are far below it; a whole long prompt's save of many heads
#: (~1M unit keys, or fewer with event fields) is not.
MAX_PAYLOAD_BYTES = 64 << 20


@dataclass(frozen=True)
class Reply:
    """The child's answer to one request."""

    status: int
    wall_s: float
    cpu_s: float  # CPU seconds of the child's committing thread
    message: str = ""


def check_units(at: int, n_units: int, buffer_id: int, buffer_nbytes: int, offset: Any, stride_bytes: Any, unit_bytes: Any) -> None:
    """Refuses chain ``at`` unless each of its ``n_units`` units lies whole
    inside its buffer: ``unit_bytes > 0``, ``offset >= 0``, ``stride_bytes
    >= unit_bytes`` (equal: units back to back) and the last unit's end
    within ``buffer_nbytes``. Checked by the caller and again by the child
    before it takes a view: its slices, Python's, stored a unit past the
    end as a short or empty block and read a negative offset from the end
    (another unit's bytes under this key).

    Raises:
        ConfigError: naming the chain and what is wrong (nothing stored).
    """
    hint = "name units inside the shared buffer: SharedChain(keys, buffer.id, offset, stride_bytes, unit_bytes)"
    for name, value in (("offset", offset), ("stride_bytes", stride_bytes), ("unit_bytes", unit_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"chain {at}: {name} must be an int, got {type(value).__name__}", hint=hint)
    if unit_bytes <= 0 or offset < 0 or stride_bytes < unit_bytes:
        raise ConfigError(f"chain {at}: unit_bytes {unit_bytes}, offset {offset}, stride_bytes {stride_bytes}: a unit must have"
                          " bytes, start at offset >= 0 and the stride be at least unit_bytes", hint=hint)
    end = offset + (n_units - 1) * stride_bytes + unit_bytes
    if n_units and end > buffer_nbytes:
        raise ConfigError(f"chain {at}: its {n_units} units end at byte {end}, past the {buffer_nbytes} bytes of buffer {buffer_id}",
                          hint=hint)


def send(sock: socket.socket, op: int, payload: bytes = b"", fd: int | None = None) -> None:
    """Writes one message (``fd`` passed along it where given)."""
    head = _HEAD.pack(op, len(payload))
    if fd is None:
        sock.sendall(head + payload)
        return
    # One write for head and payload: after a socket polled writable (writable_now) a small message goes whole,
    # where a payload written apart could find it full and wait (the model's thread, in share).
    message = head + payload
    sent = socket.send_fds(sock, [message], [fd])
    if sent == 0:
        raise ConnectionError("sent nothing of a message with a descriptor")
    if sent < len(message):  # (sendall of nothing would still wait for the socket to poll writable)
        sock.sendall(message[sent:])


def writable_now(sock: socket.socket) -> bool:
    """True if ``sock`` takes a small message without blocking (a Unix
    stream socket polls writable while at most a quarter of its send buffer
    is queued)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return any(mask & select.POLLOUT for _fd, mask in poller.poll(0))


def pack_json(body: dict[str, Any]) -> bytes:
    """A JSON payload (compact); the sender checks it against :data:`MAX_PAYLOAD_BYTES`."""
    return json.dumps(body, separators=(",", ":")).encode()


def send_json(sock: socket.socket, op: int, body: dict[str, Any], fd: int | None = None) -> None:
    send(sock, op, pack_json(body), fd)


def receive(sock: socket.socket) -> tuple[int, bytes, list[int]]:
    """Reads one message: its op, payload and the descriptors on its head."""
    head = bytearray()
    fds: list[int] = []
    while len(head) < _HEAD.size:
        data, got, _flags, _addr = socket.recv_fds(sock, _HEAD.size - len(head), 4)
        fds.extend(got)
        if not data:
            raise ConnectionError("the other side of the commit socket closed")
        head += data
    op, length = _HEAD.unpack(head)
    if length > MAX_PAYLOAD_BYTES:
        raise ConnectionError(f"a {length}-byte payload is over the {MAX_PAYLOAD_BYTES}-byte limit")
    payload = bytearray(length)
    view, got_bytes = memoryview(payload), 0
    while got_bytes < length:
        n = sock.recv_into(view[got_bytes:])
        if n == 0:
            raise ConnectionError("the other side of the commit socket closed mid-message")
        got_bytes += n
    return op, bytes(payload), fds


def send_reply(sock: socket.socket, reply: Reply) -> None:
    send(sock, 0, _REPLY.pack(reply.status, reply.wall_s, reply.cpu_s) + reply.message.encode())


def receive_reply(sock: socket.socket) -> Reply:
    _op, payload, fds = receive(sock)
    for fd in fds:  # a reply carries none; never leak one
        _close_quietly(fd)
    if len(payload) < _REPLY.size:
        raise ConnectionError(f"a {len(payload)}-byte reply is shorter than its {_REPLY.size}-byte head")
    status, wall_s, cpu_s = _REPLY.unpack_from(payload)
    return Reply(status, wall_s, cpu_s, payload[_REPLY.size:].decode(errors="replace"))


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def pack_stored_keys(sent: list[bytes], stored: list[bytes]) -> str:
    """A put's OK message: which of the keys it was ``sent`` (its chains'
    keys in order) it stored (``PutResult.stored_keys``), as positions in
    ``sent``: a tenth of the hex keys' bytes, and the parent, whose GIL the
    model shares, decodes them in a third of the time (256 keys: 19 us,
    against 57 us for the keys in hex)."""
    first: dict[bytes, int] = {}
    for i, key in enumerate(sent):
        first.setdefault(key, i)
    return json.dumps({"stored": [first[key] for key in stored]}, separators=(",", ":"))


def stored_keys(sent: list[bytes], reply: Reply) -> list[bytes]:
    """The keys a put's OK reply names (:func:`pack_stored_keys`)."""
    return [sent[i] for i in json.loads(reply.message)["stored"]]


def pack_error(exc: BaseException) -> str:
    """``exc`` as a failure reply's message (:meth:`~ucm_db.errors.UcmDbError.to_dict`);
    an error outside the hierarchy (an OSError, a bug) travels as a
    TierError naming its own class."""
    if not isinstance(exc, errors.UcmDbError):
        exc = errors.TierError(f"the commit process failed: {type(exc).__name__}: {exc}", hint="")
    return json.dumps(exc.to_dict())


def unpack_error(message: str) -> errors.UcmDbError:
    """The error :func:`pack_error` packed (a TierError with the raw text
    for a message it did not write)."""
    try:
        return errors.error_from_dict(json.loads(message))
    except ValueError:
        return errors.TierError(f"the commit process failed: {message}", hint="")
