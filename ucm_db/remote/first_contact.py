"""First contact with a remote: the epoch its manifest of a namespace
carries, read at most once per namespace at a time.

A store reads that manifest before anything of the namespace is read
through from the remote (:mod:`ucm_db.store.epoch_gate`). On an object
store the first request also sets up the session (credentials, TLS), so it
can outlast a lookup's deadline (0.2 s by default) with nothing wrong. Such
a read is left running, not taken for a failure: the lookup goes on with
what is local, and a later call takes the read's answer.

Invariants:
    * At most one manifest read per namespace runs at a time, on the link's
      pool (on the caller's thread where the link reads inline: a local
      disk, :mod:`ucm_db.remote.inline_reads`; never under this object's
      lock); none is started while the link's breaker is open.
    * A call waits for the read until it is ``wait_s`` old, ``wait_s``
      being the call's own: a lookup that comes after a lookup deadline has
      passed does not wait at all, a bulk step (``get``, ``warm``) or a
      background lookup still waits out its longer deadline. A read still
      running then raises :class:`~ucm_db.errors.RemotePendingError`.
    * A read running longer than :data:`PENDING_LIMIT_S` is given up: the
      call that finds it so raises :class:`~ucm_db.errors.TierError` (the
      store then warns and retries later) and the breaker opens.
    * The breaker hears of a read when it ends, not when a call takes its
      answer: an error opens it, an answer closes it; a read still running
      opens no breaker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from ucm_db.errors import RemotePendingError, TierError
from ucm_db.remote.link import FETCH_DEADLINE_S, RemoteLink
from ucm_db.remote.manifests import ManifestError, manifest_epoch

#: A manifest read running this long is given up (a request hung on a dead
#: connection): as long as a bulk fetch may take.
PENDING_LIMIT_S = FETCH_DEADLINE_S


@dataclass(frozen=True, slots=True)
class _Read:
    future: Future[Any]
    started_s: float  # time.monotonic() when it was started


class ManifestReads:
    """The manifest reads of one remote link (module invariants)."""

    def __init__(self, link: RemoteLink, remote_name: str) -> None:
        self._link = link
        self._remote_name = remote_name
        self._lock = threading.Lock()
        self._running: dict[bytes, _Read] = {}

    def after_fork(self) -> None:
        """In a forked child: the parent's reads ran on threads not here."""
        self._lock = threading.Lock()
        self._running = {}

    def epoch(self, namespace_id: bytes, wait_s: float) -> int | None:
        """The epoch the manifest carries (None: no manifest, or none of it).

        Raises:
            RemotePendingError: the read is still running (it goes on).
            ManifestError: the manifest's epoch cannot be established.
            TierError: the breaker is open, the read failed, or it ran past
                :data:`PENDING_LIMIT_S`.
        """
        read, inline = self._read_for(namespace_id)
        if inline:
            _run_into(read.future, lambda: self._link.inline.run(lambda: _read(self._link, namespace_id)))
        now = time.monotonic()
        if not wait([read.future], timeout=max(0.0, read.started_s + wait_s - now)).done:
            if now - read.started_s < PENDING_LIMIT_S:
                raise RemotePendingError(
                    f"the namespace manifest on remote {self._remote_name} is still being read (first contact)",
                    hint="nothing to do: the read goes on and a later call takes its answer")
            self._forget(namespace_id, read)
            self._link.breaker.failure()
            raise TierError(f"the namespace manifest on remote {self._remote_name} did not answer in "
                            f"{PENDING_LIMIT_S:g} s", hint="check remote/remote_options; it is retried")
        self._forget(namespace_id, read)
        failure = read.future.exception()
        if failure is not None:
            raise TierError(f"could not read the namespace manifest on remote {self._remote_name}: "
                            f"{type(failure).__name__}: {failure}", hint="check remote/remote_options; it is retried") from failure
        result = read.future.result()
        if isinstance(result, ManifestError):
            raise result
        return result  # type: ignore[no-any-return]

    def _read_for(self, namespace_id: bytes) -> tuple[_Read, bool]:
        """The namespace's read under way, or a new one (and whether the
        caller runs it, inline)."""
        with self._lock:
            read = self._running.get(namespace_id)
            if read is not None:
                return read, False
            if not self._link.breaker.allow():
                raise TierError(f"could not read the namespace manifest on remote {self._remote_name}: its breaker "
                                "is open (a request failed just now)", hint="check remote/remote_options; it is retried")
            inline = self._link.inline.use()
            future: Future[Any] = Future() if inline else self._link.submit(lambda: _read(self._link, namespace_id))
            future.add_done_callback(self._account)
            read = self._running[namespace_id] = _Read(future, time.monotonic())
            return read, inline

    def _forget(self, namespace_id: bytes, read: _Read) -> None:
        with self._lock:
            if self._running.get(namespace_id) is read:
                del self._running[namespace_id]

    def _account(self, future: Future[Any]) -> None:
        """The breaker hears of a read as it ends (module invariants)."""
        if future.cancelled():
            return
        if future.exception() is not None:
            self._link.breaker.failure()
        else:
            self._link.breaker.success()


def _read(link: RemoteLink, namespace_id: bytes) -> int | None | ManifestError:
    try:
        return manifest_epoch(link.root, namespace_id)
    except ManifestError as exc:  # an answer, not a failure of the link
        return exc


def _run_into(future: Future[Any], call: Callable[[], Any]) -> None:
    """``call()``'s result or error into ``future`` (an inline read)."""
    try:
        future.set_result(call())
    except Exception as exc:  # noqa: BLE001 - handed to the call that takes the answer
        future.set_exception(exc)
