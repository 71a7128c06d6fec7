"""Reads of one remote object within a deadline and a byte budget.

A lookup that fetches large objects must neither overrun its deadline nor
hold more memory than the store allows (``remote_deadline_s``,
``remote_lookup_max_bytes``). :func:`read_object` reads an object in
chunks (:data:`CHUNK_BYTES` from a directory; growing to
:data:`MAX_REMOTE_CHUNK_BYTES` from an object store) appended to one
buffer, checking its :class:`ReadLimits` before every request.

Invariants:
    * A read that passes its deadline, is refused budget, or whose call was
      abandoned stops before its next request and raises
      :class:`ReadAbandoned` (a miss for that call, not a failure of the
      remote); its buffer is dropped.
    * An object stating more than the root's ``max_object_bytes`` raises
      :class:`ObjectTooLargeError` after its first request: it is refused,
      never read further (counted as ``too_large``, not as ``corrupt``). So
      does one whose codec header declares a block of more raw bytes than
      that (:func:`check_raw_bytes`): a small object can declare a huge
      block (one zstd frame of zeros), and the block's raw size is what a
      read of it decodes once promoted. An encrypted object's header is
      read once it is opened (``RemoteTier.fetch`` checks it there).
    * Budget: every object of a call takes its whole stated size from the
      call's :class:`ByteBudget` before its bytes are kept, in the order of
      the call's keys (``index``): an object waits for the ones before it to
      take theirs or give up, so the budget goes to a chain's leading run.
      Once one is refused, every later one is refused (it could not extend
      the run). Only first reads (at most ``FIRST_READ_BYTES`` each, one per
      request in flight) are made before the budget is taken.
    * No copy of a whole object is made: the chunks land in its one buffer.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

from ucm_db import codec
from ucm_db.errors import CorruptBlockError
from ucm_db.remote.envelope import ENVELOPE_BYTES, is_sealed, stated_object_bytes


class ObjectSource(Protocol):
    """What a read needs of :class:`ucm_db.remote.tier.RemoteRoot` (a
    protocol, so this module, below the remote tier, never imports it)."""

    max_object_bytes: int

    @property
    def is_local(self) -> bool: ...

    def read_range(self, path: str, start: int, end: int) -> bytes | None: ...

#: Bytes read per request after the first from a local or NFS directory
#: (the deadline is checked between).
CHUNK_BYTES = 4 << 20
#: On an object store each request costs a round trip: chunks start at
#: :data:`CHUNK_BYTES` and double up to this (a 200 MiB object takes 6
#: requests, not 48). Only how soon an abandoned pooled read stops depends
#: on it: the pool's wait keeps the lookup's deadline.
MAX_REMOTE_CHUNK_BYTES = 64 << 20


class ObjectTooLargeError(CorruptBlockError):
    """A remote object states more bytes than this store reads, or declares
    a block of more raw bytes than that (``remote_max_object_bytes``):
    refused before it is promoted."""


def check_raw_bytes(raw_len: int, max_object_bytes: int) -> None:
    """Raises :class:`ObjectTooLargeError` for an object whose block is
    ``raw_len`` raw bytes, more than ``max_object_bytes``
    (``remote_max_object_bytes``) allows: with the object's own size, what
    bounds what it costs a reader (docs/configuration.md)."""
    if raw_len > max_object_bytes:
        raise ObjectTooLargeError(
            f"remote object declares a block of {raw_len} raw bytes, more than remote_max_object_bytes ({max_object_bytes})"
        )


class ReadAbandoned(Exception):
    """A read stopped at its deadline or budget (a miss for this call only)."""


class ByteBudget:
    """Bytes of fetched objects one call (a lookup, a stream) may hold.

    Takes are granted in index order (see the module invariants). With
    ``wait_for_room`` (a stream whose consumer gives objects back as it
    goes), a take that does not fit waits for room until its deadline;
    without it (a lookup, which holds all it fetched until it returns), it
    is refused at once. Thread-safe.
    """

    def __init__(self, limit_bytes: int, *, wait_for_room: bool = False) -> None:
        self.limit_bytes = limit_bytes
        self.wait_for_room = wait_for_room
        self.held_bytes = 0
        self.peak_bytes = 0
        self._taken: dict[int, int] = {}
        self._settled: set[int] = set()
        self._next = 0  # every index below it has settled
        self._refused_from: float = math.inf
        self._closed = False
        self._waiting = 0
        self._cond = threading.Condition(threading.Lock())

    def take(self, index: int, n_bytes: int, deadline: float) -> bool:
        """Takes ``n_bytes`` for the object at ``index`` once every earlier
        index has settled; False (refused) past ``deadline``, when it does
        not fit, after an earlier refusal, or once closed. Settles ``index``."""
        with self._cond:
            if self._next != index or self.held_bytes + n_bytes > self.limit_bytes:
                self._waiting += 1
                try:
                    while not self._closed and index < self._refused_from and (
                        self._next < index or (self.wait_for_room and self.held_bytes + n_bytes > self.limit_bytes)
                    ):
                        left_s = deadline - time.monotonic()
                        if left_s <= 0:
                            break
                        self._cond.wait(min(left_s, 1.0))
                finally:
                    self._waiting -= 1
            granted = (not self._closed and self._next >= index and index < self._refused_from
                       and self.held_bytes + n_bytes <= self.limit_bytes)
            if granted:
                self.held_bytes += n_bytes
                if self.held_bytes > self.peak_bytes:
                    self.peak_bytes = self.held_bytes
                self._taken[index] = n_bytes
            elif index < self._refused_from:
                self._refused_from = index
            self._settle(index)
            return granted

    def settle(self, index: int) -> None:
        """Marks ``index`` done without taking (a miss, an error)."""
        with self._cond:
            self._settle(index)

    def _settle(self, index: int) -> None:
        if index != self._next:
            self._settled.add(index)
        else:
            self._next += 1
            while self._settled and self._next in self._settled:
                self._settled.discard(self._next)
                self._next += 1
        if self._waiting:
            self._cond.notify_all()

    def give_back(self, index: int) -> None:
        """Returns what ``index`` took (nothing if it took nothing)."""
        with self._cond:
            self.held_bytes -= self._taken.pop(index, 0)
            if self._waiting:
                self._cond.notify_all()

    def refused(self, index: int) -> bool:
        """True when ``index`` would be refused whatever it asks."""
        return self._closed or index >= self._refused_from

    def close(self) -> None:
        """Refuses every take from now on and wakes the waiting ones (the
        call is over: its remaining reads are abandoned)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ReadLimits:
    """What bounds one object read: a monotonic deadline, and the call's
    budget with this object's index in it (None: unbounded memory).
    Read-only by convention (a plain slotted class: one is made per fetch)."""

    __slots__ = ("deadline", "budget", "index")

    def __init__(self, deadline: float = math.inf, budget: ByteBudget | None = None, index: int = 0) -> None:
        self.deadline = deadline
        self.budget = budget
        self.index = index

    def check(self) -> None:
        """Raises :class:`ReadAbandoned` when the read must stop."""
        if time.monotonic() >= self.deadline:
            raise ReadAbandoned("deadline passed")
        if self.budget is not None and self.budget.refused(self.index):
            raise ReadAbandoned("call abandoned or over its byte budget")


def read_object(root: ObjectSource, path: str, key: bytes, first_read_bytes: int, limits: ReadLimits) -> bytearray | bytes | None:
    """The whole object at ``path`` (see the module invariants); None if
    absent or not a regular file. When ``limits.budget`` is set, the
    object's stated size stays taken from it (the caller gives it back).

    Raises:
        ObjectTooLargeError: states more than ``root.max_object_bytes``,
            or (unencrypted) declares a block of more raw bytes than that.
        CorruptBlockError: bad envelope or codec header, or an object
            shorter or longer than it states.
        ReadAbandoned: deadline, budget or abandoned call.
    """
    budget = limits.budget
    settled = False
    try:
        limits.check()
        first = root.read_range(path, 0, first_read_bytes)
        if first is None:
            return None
        stated = stated_object_bytes(first, key)
        if stated > root.max_object_bytes:
            raise ObjectTooLargeError(f"remote object states {stated} bytes, more than the {root.max_object_bytes} this store reads")
        if not is_sealed(first):  # stated_object_bytes read its codec header
            check_raw_bytes(codec.raw_len_of_head(memoryview(first)[ENVELOPE_BYTES:]), root.max_object_bytes)
        whole = len(first) < first_read_bytes
        if whole and len(first) != stated:
            raise CorruptBlockError(f"remote object of {len(first)} bytes states {stated}")
        if not whole and stated < first_read_bytes:
            raise CorruptBlockError(f"remote object is longer than the {stated} bytes it states")
        if budget is not None:
            settled = True
            if not budget.take(limits.index, stated, limits.deadline):
                raise ReadAbandoned("over the call's byte budget")
        try:
            data = first if whole else _read_rest(root, path, first, stated, limits)
        except BaseException:
            if budget is not None:
                budget.give_back(limits.index)
            raise
        if data is None and budget is not None:
            budget.give_back(limits.index)
        return data
    finally:
        if budget is not None and not settled:
            budget.settle(limits.index)


def object_is_whole(root: ObjectSource, path: str, key: bytes, first: bytes, asked_bytes: int) -> bool:
    """Whether the object at ``path`` is exactly as long as it states.

    ``first`` is what a read of its first ``asked_bytes`` (at least
    :data:`~ucm_db.remote.envelope.PROBE_BYTES`) returned: a shorter answer
    is the whole object; otherwise one more request asks for the byte
    before its stated end and the one past it (one byte back: the object
    is whole and no longer). False where the envelope or the length it
    states is bad, or the object went meanwhile; other errors raise."""
    try:
        stated = stated_object_bytes(first, key)
    except CorruptBlockError:
        return False
    if len(first) < asked_bytes:
        return len(first) == stated
    if stated < asked_bytes:
        return False  # longer than it states
    tail = root.read_range(path, stated - 1, stated + 1)
    return tail is not None and len(tail) == 1


def _read_rest(root: ObjectSource, path: str, first: bytes, stated: int, limits: ReadLimits) -> bytearray | None:
    """Reads ``[len(first), stated]`` in chunks after ``first``, appended to
    one buffer as they come (a buffer allocated whole up front is touched
    whole before the first chunk: 2 s for 200 MiB on a loaded machine, all
    of it past any deadline check). One byte past the stated end is asked
    for (an object longer than stated is corrupt). A chunk starts one byte
    early: a range that starts at an object's end is an error on S3."""
    out = bytearray(first)
    at = len(first)
    if at == stated:  # the first read ended exactly at the stated end: the byte past it is asked for alone
        tail = root.read_range(path, stated - 1, stated + 1)
        if tail is None:
            return None  # removed meanwhile
        if len(tail) != 1:
            raise CorruptBlockError(f"remote object is longer than the {stated} bytes it states")
        return out
    chunk_bytes = CHUNK_BYTES
    while at < stated:
        limits.check()
        end = min(stated, at + chunk_bytes)
        if not root.is_local:
            chunk_bytes = min(2 * chunk_bytes, MAX_REMOTE_CHUNK_BYTES)
        chunk = root.read_range(path, at - 1, end + 1 if end == stated else end)
        if chunk is None:
            return None  # removed meanwhile
        if len(chunk) != end - at + 1:
            raise CorruptBlockError(f"remote object's length does not match the {stated} bytes it states")
        out += memoryview(chunk)[1:]
        del chunk
        at = end
    return out
