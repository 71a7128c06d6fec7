"""The commit process: opens the store as its parent would and commits the
puts and deletes its parent sends (``python -m ucm_db.committer.child FD``).

It imports the core alone (no torch, no vLLM): it starts in a fraction of a
second and its Python never holds the parent's GIL, which is the point
(:mod:`ucm_db.committer`).

Invariants:
    * One request at a time, in the order sent; each put or delete is the
      store's own ``put_segments``/``delete`` on this process's handle, so
      every store invariant (a block visible only once committed, checksums
      bound to keys, the prefix invariant, eviction) holds as for any other
      process sharing the store.
    * Payloads are read from the shared buffers in place and copied by the
      store inside ``put``; every unit is checked to lie whole inside its
      buffer before a view is taken (:func:`ucm_db.committer.check_units`:
      a ConfigError, nothing stored); no view of a buffer outlives its request, so a
      :data:`~ucm_db.committer.wire.FORGET` can unmap it at once.
    * A failed request is answered (its status and text) and the loop goes
      on; only the socket's end (the parent closed it, or died),
      :data:`~ucm_db.committer.wire.CLOSE`, or the parent's death seen
      while idle (checked every :data:`PARENT_CHECK_S`: a process forked
      from the parent holds the socket open after it died) ends the
      process, after closing the store.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import sys
import time
from typing import Any

import ucm_db
from ucm_db import cpu_placement
from ucm_db.codec import Framed
from ucm_db.committer import check_units, wire
from ucm_db.errors import MissingAncestorError, StoreFullError, UcmDbError
from ucm_db.events import BlockEventFields
from ucm_db.keys import BlockKeys, Namespace

#: How often an idle child checks that its parent still lives.
PARENT_CHECK_S = 2.0


def serve(sock: socket.socket, parent_pid: int) -> None:
    """Answers the parent until it closes the socket, says :data:`~wire.CLOSE`
    or is gone (this process's parent no longer ``parent_pid``)."""
    store = _open(sock)
    if store is None:
        return
    buffers: dict[int, mmap.mmap] = {}
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    with store:
        while True:
            while not poller.poll(PARENT_CHECK_S * 1000):
                if os.getppid() != parent_pid:  # re-parented: the caller died, a process it forked keeps the socket open
                    return
            try:
                op, payload, fds = wire.receive(sock)
            except (ConnectionError, OSError):
                return
            if op == wire.CLOSE:
                return
            if op == wire.MAP:
                body = json.loads(payload)
                buffers[int(body["id"])] = mmap.mmap(fds[0], int(body["nbytes"]))
                os.close(fds[0])
            elif op == wire.FORGET:
                for buffer_id in json.loads(payload)["ids"]:
                    memory = buffers.pop(int(buffer_id), None)
                    if memory is not None:
                        try:
                            memory.close()
                        except BufferError:
                            pass  # a view still alive: unmapped when it goes
            elif op in (wire.PUT, wire.DELETE):
                wire.send_reply(sock, _answer(store, buffers, op, payload))


def _open(sock: socket.socket) -> ucm_db.Store | None:
    """The store the first message names, its open answered; None if it failed."""
    op, payload, _fds = wire.receive(sock)
    body = json.loads(payload)
    cpu_placement.set_background_cpus(body.get("cpus") or ())
    cpu_placement.place_current_thread()  # this thread, and the store's threads it starts, on the caller's background CPUs
    try:
        store = ucm_db.open(body["path"], **body["options"])
    except (UcmDbError, OSError, TypeError, ValueError) as exc:
        wire.send_reply(sock, wire.Reply(wire.FAILED, 0.0, 0.0, f"{type(exc).__name__}: {exc}"))
        return None
    wire.send_reply(sock, wire.Reply(wire.OK, 0.0, 0.0, wire.IDENTITY))  # the parent refuses a child not its own version
    return store


def _answer(store: ucm_db.Store, buffers: dict[int, mmap.mmap], op: int, payload: bytes) -> wire.Reply:
    started_s, started_cpu_s = time.perf_counter(), time.thread_time()
    try:
        body = json.loads(payload)  # here: a request that is not this version's JSON is answered, not the child's end
        namespace = Namespace.from_dict(body["ns"])
        if op == wire.PUT:
            stored = _put(store, buffers, namespace, body).stored_keys
            sent = [bytes.fromhex(key) for chain in body["chains"] for key in chain["keys"]]
            return _reply(wire.OK, started_s, started_cpu_s, wire.pack_stored_keys(sent, stored))
        store.delete(namespace, [bytes.fromhex(key) for key in body["keys"]])
    except MissingAncestorError as exc:
        return _reply(wire.MISSING_ANCESTOR, started_s, started_cpu_s, wire.pack_error(exc))
    except StoreFullError as exc:
        return _reply(wire.STORE_FULL, started_s, started_cpu_s, wire.pack_error(exc))
    except Exception as exc:  # a store's error, or a malformed request (the parent's bug): answer it, keep serving
        return _reply(wire.FAILED, started_s, started_cpu_s, wire.pack_error(exc))
    return _reply(wire.OK, started_s, started_cpu_s)


def _reply(status: int, started_s: float, started_cpu_s: float, message: str = "") -> wire.Reply:
    return wire.Reply(status, time.perf_counter() - started_s, time.thread_time() - started_cpu_s, message)


def _put(store: ucm_db.Store, buffers: dict[int, mmap.mmap], namespace: Namespace, body: dict[str, Any]) -> ucm_db.PutResult:
    frame_bytes = tuple(int(n) for n in body["frame_bytes"]) if body.get("frame_bytes") is not None else None
    segments: list[tuple[BlockKeys, list[Any]]] = []
    views: list[memoryview] = []
    try:
        for at, chain in enumerate(body["chains"]):
            memory = memoryview(buffers[int(chain["buf"])])
            views.append(memory)
            keys = BlockKeys([bytes.fromhex(k) for k in chain["keys"]],
                             parent=bytes.fromhex(chain["parent"]) if chain["parent"] is not None else None)
            offset, stride, unit_bytes = chain["offset"], chain["stride"], chain["unit_bytes"]
            # Again here, before any slice (a request is the parent's word only).
            check_units(at, len(keys), int(chain["buf"]), memory.nbytes, offset, stride, unit_bytes)
            units = [memory[offset + i * stride:offset + i * stride + unit_bytes] for i in range(len(keys))]
            views.extend(units)
            payloads = [Framed(unit, frame_bytes) for unit in units] if frame_bytes else list(units)
            segments.append((keys, payloads))
        events = body.get("events")
        event_fields = {bytes.fromhex(k): BlockEventFields.unpack(bytes.fromhex(v)) for k, v in events.items()} if events else None
        prov = body.get("prov")
        provisional = {bytes.fromhex(k): bytes.fromhex(v) for k, v in prov.items()} if prov else None
        return store.put_segments(namespace, segments, codec_name=body.get("codec"), event_fields=event_fields, provisional=provisional)
    finally:
        segments.clear()
        for view in reversed(views):
            try:
                view.release()
            except BufferError:
                pass  # still exported somewhere: dropped with its last reference instead


def main(argv: list[str] | None = None) -> int:
    parent_pid = os.getppid()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m ucm_db.committer.child FD (started by ucm_db.committer.CommitProcess)", file=sys.stderr)
        return 2
    with socket.socket(fileno=int(args[0])) as sock:
        serve(sock, parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
