"""Commits in a child process: a store's puts whose Python never holds the
caller's GIL.

A caller that runs a model on one thread and commits saves on another (a
vLLM worker and its background writer) shares one GIL between them: each
small op of the model gives it up and must win it back, and the writer's
Python between LMDB calls holds it. ``ucm-db bench gil``: a decode step
beside a thread putting 16 KiB units takes 1.6-1.8x its time alone; beside
the same puts in a child process 1.05x. :class:`CommitProcess` starts that
child (``python -m ucm_db.committer.child``), which opens the same store and
commits what the caller hands it from shared memory.

The caller stages payloads in :class:`SharedBuffer` s (memfd mappings both
processes see; the child maps each once, when it is made), then names the
units of each chain by buffer, offset and stride in
:meth:`CommitProcess.put_segments`. No payload byte crosses the socket.

Invariants:
    * A put or delete returns only once the child has committed it (or
      raises what ``Store.put_segments``/``Store.delete`` would have:
      :class:`~ucm_db.errors.MissingAncestorError`,
      :class:`~ucm_db.errors.StoreFullError`, another
      :class:`~ucm_db.errors.UcmDbError`), so the caller may reuse the
      buffer after it, and a commit is visible to every handle of the store
      when it returns. A put returns the keys it stored (:class:`Committed`:
      ``PutResult.stored_keys``, so a caller can undo exactly its own put).
    * A put's units lie whole inside their buffers (:func:`check_units`,
      checked here and again in the child before any view is taken): one
      outside is a :class:`~ucm_db.errors.ConfigError` and nothing is stored.
    * One request in flight at a time (a lock): the child answers in order.
      Writing a message takes a second lock of its own.
    * :meth:`share` (a model thread taking a staging buffer) never blocks
      on the child: it writes the MAP only if the write lock is free and
      the socket takes it at once, else the next request writes it before
      itself (a stopped or slow child blocked the model's thread once ~140
      MAPs filled the socket).
    * Nothing waits on the child for ever: a reply or write not done in
      :data:`REPLY_TIMEOUT_S` gives the child up (killed and reaped before
      the request raises: it never reads a buffer reused after), and
      :meth:`close` writes CLOSE only if the socket takes it at once.
    * The child gone (killed, crashed, its socket closed): every later
      request raises :class:`~ucm_db.errors.CommitProcessError` at once; a
      request it had not answered may or may not have committed (as any
      put cut by a crash), never partly.
    * A request's error says whether the child may have committed it:
      ``CommitProcessError.request_sent`` is True only once the request's
      message was written whole into the socket. False (the child found
      gone before or while it was written, or the request refused below)
      means the child did not commit it: the child acts only on a whole
      message (a short read ends it), and a write that failed gave the
      child up (killed and reaped) before the error was raised. A caller
      that commits such a request itself owns exactly what its own put stored.
    * A request over :data:`ucm_db.committer.wire.MAX_PAYLOAD_BYTES` (its
      JSON: ~67 bytes a key, more with event fields; ~1M keys) is refused
      before anything is written: CommitProcessError with ``request_sent``
      False, and the child untouched and :attr:`~CommitProcess.alive` for
      later requests (sent, the child would read it as a broken stream and
      exit). A put is one transaction: it is never split across requests.
    * The child dies with the caller: it exits when the socket's other end
      closes, which the kernel does when the caller exits or is killed, or
      when it finds itself re-parented (a process the caller forked holds
      the socket open: :data:`ucm_db.committer.child.PARENT_CHECK_S`).
    * A buffer the caller drops is unmapped in the child before the next
      request (:meth:`SharedBuffer` finalizer, flushed under the lock): never
      while a request may read it, since the caller drops a buffer only after
      the put that reads it returned.
    * :meth:`locate` never names a dropped buffer, so no request names an id
      it (or the same request) has just told the child to forget. The
      kernel maps a new buffer into a dropped one's hole at once: the
      finalizer takes the dropped buffer out of :meth:`locate`'s sight as it
      queues its FORGET (not when the next request flushes it), and since
      ``mmap`` unmaps before it runs its finalizers (with the GIL released),
      :meth:`locate` takes the newest buffer that holds the bytes: an older
      one overlapping it was unmapped before the newer could be mapped there.
      Nor does it name one whose mapping is gone (a weak reference, dead
      before the unmap): plain memory mapped in that window is no buffer's.
"""

from __future__ import annotations

import collections
import itertools
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ucm_db import cpu_placement
from ucm_db.committer import wire
from ucm_db.committer.values import Committed, SharedBuffer, SharedChain
from ucm_db.committer.wire import check_units
from ucm_db.errors import CommitProcessError, ConfigError
from ucm_db.events import BlockEventFields, pack_event_fields
from ucm_db.keys import Namespace

__all__ = ["CommitProcess", "Committed", "SharedBuffer", "SharedChain", "check_units"]

#: Longest the child may take to open the store (a page walk at open: 1-2 s a million records).
OPEN_TIMEOUT_S = 120.0
#: Longest :meth:`CommitProcess.close` waits for the child to finish and exit before killing it.
CLOSE_TIMEOUT_S = 60.0
#: Longest a request waits for its reply (or to be written) before the child
#: counts as gone: far past any commit (a round is at most a few MiB; a
#: whole prompt's job, GiBs, commits at disk speed), short of a hang.
REPLY_TIMEOUT_S = 300.0
_ids = itertools.count(1)


def _forget(buffers: dict[int, tuple[int, int]], forgotten: collections.deque[int], buffer_id: int,
            mappings: dict[int, weakref.ref[mmap.mmap]]) -> None:
    """A dropped buffer's finalizer: out of :meth:`CommitProcess.locate`'s
    sight at once, unmapped in the child at the next request. Runs on
    whichever thread drops the buffer, maybe inside a lock of the
    process's: a dict pop and a deque append, no lock taken."""
    buffers.pop(buffer_id, None)
    mappings.pop(buffer_id, None)
    forgotten.append(buffer_id)


class CommitProcess:
    """A child process committing to the store at ``path``, opened with
    ``options`` (what ``ucm_db.open`` takes; JSON values), on ``cpus``
    (default: :func:`ucm_db.cpu_placement.background_cpus`, if named).

    Raises:
        ConfigError: ``options`` hold a value JSON cannot carry.
        CommitProcessError: the child did not start or could not open the store.
    """

    def __init__(self, path: str | os.PathLike[str], options: Mapping[str, Any] | None = None, *,
                 cpus: Sequence[int] | None = None) -> None:
        try:
            opening = json.dumps({"path": str(Path(path)), "options": dict(options or {}),
                                  "cpus": sorted(cpus if cpus is not None else cpu_placement.background_cpus())})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the store's options cannot be sent to a commit process: {exc}",
                              hint="give options as JSON values (str, int, float, bool, lists, dicts)") from exc
        self._lock = threading.Lock()  # one request and its reply at a time
        self._send_lock = threading.Lock()  # one message written at a time; taken inside _lock, never around it
        self._forgotten: collections.deque[int] = collections.deque()
        self._unsent: collections.deque[tuple[int, int, int]] = collections.deque()  # MAPs share() could not write at once: (id, nbytes, fd)
        self._buffers: dict[int, tuple[int, int]] = {}  # id -> (address, nbytes), in share order, until dropped
        self._mappings: dict[int, weakref.ref[mmap.mmap]] = {}  # id -> its memory, while listed in _buffers
        self._gone: str | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-m", "ucm_db.committer.child", str(theirs.fileno())],  # -P: not a ucm_db in the cwd
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            ours.close()
            raise CommitProcessError(f"the commit process did not start: {exc}") from exc
        finally:
            theirs.close()
        self._open(opening.encode())

    def _open(self, opening: bytes) -> None:
        try:
            self._sock.settimeout(OPEN_TIMEOUT_S)
            wire.send(self._sock, wire.OPEN, opening)
            reply = wire.receive_reply(self._sock)
            self._sock.settimeout(REPLY_TIMEOUT_S)
        except (OSError, ConnectionError) as exc:
            self._abandon(f"the commit process did not answer its open: {exc}")
            self._sock.close()
            raise CommitProcessError(self._gone or "") from exc
        problem = None if reply.status == wire.OK else f"could not open the store: {reply.message}"
        if problem is None and reply.message != wire.IDENTITY:  # another version's child: its messages may mean other things
            problem = f"runs other ucm-db code ({reply.message or 'an older version'}) than this process ({wire.IDENTITY})"
        if problem is not None:
            self._abandon(f"the commit process {problem}")
            self._sock.close()
            raise CommitProcessError(self._gone or "")

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        """False once a request found the child gone, or after :meth:`close`."""
        return self._gone is None

    @property
    def gone_reason(self) -> str | None:
        """Why the child is of no more use (None while it is)."""
        return self._gone

    def share(self, nbytes: int) -> SharedBuffer:
        """A new buffer of ``nbytes``, mapped in the child before any request
        that names it; never waits on the child (module invariants).

        Raises:
            CommitProcessError: the child is gone, or no shared memory could
                be made (stage in plain memory: that round commits here).
        """
        self._check()
        try:
            fd = os.memfd_create("ucm-db-staging", os.MFD_CLOEXEC)
        except OSError as exc:
            raise CommitProcessError(f"no shared buffer of {nbytes} bytes: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            memory = mmap.mmap(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise CommitProcessError(f"no shared buffer of {nbytes} bytes: {exc}") from exc
        buffer = SharedBuffer(next(_ids), memory, nbytes)
        self._unsent.append((buffer.id, nbytes, fd))
        if self._send_lock.acquire(blocking=False):  # held by a write under way: the next request writes this MAP
            try:
                if self._gone is None:
                    self._send_maps(wait=False)
            finally:
                self._send_lock.release()
        if self._gone is not None:
            self._drop_unsent()
        self._mappings[buffer.id] = weakref.ref(memory)
        self._buffers[buffer.id] = (buffer.address, nbytes)
        weakref.finalize(memory, _forget, self._buffers, self._forgotten, buffer.id, self._mappings)
        return buffer

    def locate(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(buffer id, offset) of ``nbytes`` at ``address`` of the caller's
        memory, if they lie in one live shared buffer; else None. The
        newest match wins (module invariants: an older one is unmapped)."""
        for buffer_id, (start, size) in reversed(self._buffers.copy().items()):  # a copy: finalizers pop from it
            if start <= address and address + nbytes <= start + size:
                mapping = self._mappings.get(buffer_id)
                # Dead from its dealloc on, before its unmap; its finalizer runs only after (GIL released between).
                return (buffer_id, address - start) if mapping is not None and mapping() is not None else None
        return None

    def put_segments(self, namespace: Namespace, chains: Sequence[SharedChain], *, codec_name: str | None = None,
                     frame_bytes: Sequence[int] | None = None, event_fields: Mapping[bytes, BlockEventFields] | None = None,
                     provisional: Mapping[bytes, bytes] | None = None) -> Committed:
        """``Store.put_segments`` of ``chains``, in the child; ``frame_bytes``:
        each unit is a :class:`ucm_db.Framed` of frames of these lengths
        (None: plain bytes); ``provisional``: as for ``put_segments`` (the
        tags are this process's owner's: the child's puts die with it).

        Raises:
            ConfigError: a chain names a buffer not shared (or dropped), or
                units not all inside it (:func:`check_units`); nothing sent.
            CommitProcessError: the child is gone, or the request is over
                the messages' limit (module invariants: ``request_sent``).
        """
        buffers = self._buffers.copy()  # a copy: finalizers pop from it
        for at, chain in enumerate(chains):
            if chain.buffer_id not in buffers:
                raise ConfigError(f"chain {at} names buffer {chain.buffer_id!r}, not one shared with the commit process (or dropped)",
                                  hint="stage the units in a buffer from committer.share() and keep it until the put returns")
            check_units(at, len(chain.keys), chain.buffer_id, buffers[chain.buffer_id][1], chain.offset, chain.stride_bytes,
                        chain.unit_bytes)
        packed = pack_event_fields(event_fields)
        body = {
            "ns": namespace.to_dict(), "codec": codec_name, "frame_bytes": list(frame_bytes) if frame_bytes is not None else None,
            "events": {k.hex(): v.hex() for k, v in packed.items()} if packed else None,
            "prov": {bytes(k).hex(): bytes(v).hex() for k, v in provisional.items()} if provisional else None,
            "chains": [{"keys": [k.hex() for k in chain.keys], "parent": chain.keys.parent.hex() if chain.keys.parent is not None else None,
                        "buf": chain.buffer_id, "offset": chain.offset, "stride": chain.stride_bytes, "unit_bytes": chain.unit_bytes}
                       for chain in chains],
        }
        reply = self._call(wire.PUT, body)
        return Committed(reply.wall_s, reply.cpu_s, wire.stored_keys([key for chain in chains for key in chain.keys], reply))

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> tuple[float, float]:
        """``Store.delete`` of ``keys`` (with their descendants), in the child."""
        reply = self._call(wire.DELETE, {"ns": namespace.to_dict(), "keys": [bytes(k).hex() for k in keys]})
        return reply.wall_s, reply.cpu_s

    def _call(self, op: int, body: dict[str, Any]) -> wire.Reply:
        """One request and its reply; a CommitProcessError says whether the
        request was written whole (``request_sent``: module invariants)."""
        written = False
        try:
            self._check()  # found gone by another thread: nothing of this request written
            payload = wire.pack_json(body)  # before the locks, and refused over the limit with nothing written
            if len(payload) > wire.MAX_PAYLOAD_BYTES:
                raise CommitProcessError(
                    f"a {len(payload)}-byte request is over the {wire.MAX_PAYLOAD_BYTES}-byte limit of the commit process's "
                    "messages (not sent; the commit process serves on)",
                    hint="commit this one in this process (the connector does so by itself)")
            with self._lock:
                with self._send_lock:
                    self._check()
                    forgotten = self._take_forgotten()  # before the MAPs: a FORGET never precedes its buffer's MAP
                    self._send_maps(wait=True)
                    if forgotten:
                        self._guard(lambda: wire.send_json(self._sock, wire.FORGET, {"ids": forgotten}))
                    self._guard(lambda: wire.send(self._sock, op, payload))
                written = True  # whole in the child's socket: it may commit it from here on
                reply = self._guard(lambda: wire.receive_reply(self._sock))
        except CommitProcessError as exc:
            exc.request_sent = written
            raise
        if reply.status == wire.OK:
            return reply
        raise wire.unpack_error(reply.message)  # the class, message and hint Store.put_segments raised there

    def _guard(self, action: Any) -> Any:
        """Runs one read or write on the socket; the child gone: marks it
        so and raises CommitProcessError."""
        try:
            return action()
        except (OSError, ConnectionError) as exc:
            self._abandon(f"the commit process is gone: {exc}")
            raise CommitProcessError(self._gone or "") from exc

    def _check(self) -> None:
        if self._gone is not None:
            raise CommitProcessError(self._gone)

    def _take_forgotten(self) -> list[int]:
        """The buffers the caller dropped since the last request (their FORGET to write)."""
        ids = []
        while self._forgotten:
            ids.append(self._forgotten.popleft())
        return ids

    def _send_maps(self, *, wait: bool) -> None:
        """Writes the MAPs not yet written, in order (under the send lock);
        ``wait=False``: only while the socket takes one at once."""
        while self._unsent and (wait or wire.writable_now(self._sock)):
            buffer_id, nbytes, fd = self._unsent.popleft()
            try:
                self._guard(lambda: wire.send_json(self._sock, wire.MAP, {"id": buffer_id, "nbytes": nbytes}, fd))
            finally:
                os.close(fd)

    def _drop_unsent(self) -> None:
        while self._unsent:
            try:
                os.close(self._unsent.popleft()[2])
            except (IndexError, OSError):
                pass

    def close(self) -> None:
        """Asks the child to finish and exit (it closes the store); waits for it (idempotent)."""
        with self._lock, self._send_lock:
            if self._gone is None:
                try:
                    if wire.writable_now(self._sock):  # else its EOF says the same, once it reads (or the wait below ends it)
                        wire.send(self._sock, wire.CLOSE)
                except OSError:
                    pass
                self._gone = "the commit process was closed"
            self._drop_unsent()
            self._sock.close()
        try:
            self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _abandon(self, why: str) -> None:
        """The child is of no more use: remember why, close our end, end
        and reap it (at once: this may run on a model's thread)."""
        if self._gone is None:
            self._gone = why
        try:  # shut, not closed: another thread may be writing on it (close() frees the descriptor)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._process.poll() is None:
            self._process.kill()  # a commit it was running is cut as by a crash: all or nothing
        self._process.wait()
        self._drop_unsent()

    def __enter__(self) -> CommitProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
