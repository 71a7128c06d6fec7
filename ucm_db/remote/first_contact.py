"""First contact with a remote: the epoch its manifest of a namespace
carries, read at most once per namespace at a time.

A store reads that manifest before anything of the namespace is read
through from the remote (:mod:`ucm_db.store.epoch_gate`). On an object
store the first request also sets up the session (credentials, TLS), so it
can outlast a lookup's deadline (0.2 s by default) with nothing wrong. Such
a read is left running, not taken for a failure: the lookup goes on with
what is local, and a later one takes the read's answer.

Invariants:
    * At most one manifest read per namespace runs at a time, on the link's
      pool (on the caller's thread where the link reads inline: a local
      disk, :mod:`ucm_db.remote.inline_reads`); none is started while the
      link's breaker is open.
    * The call that starts a read waits for it at most its own ``wait_s``;
      a call that finds one running does not wait. A read still running
      then raises :class:`~ucm_db.errors.RemotePendingError`.
    * A read still running is not a failure: it opens no breaker. A read
      that fails opens the breaker, as any remote error does, and its error
      goes to the call that takes its answer; one that answers closes it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from collections.abc import Callable
from typing import Any

from ucm_db.errors import RemotePendingError, TierError
from ucm_db.remote.link import RemoteLink
from ucm_db.remote.manifests import ManifestError, manifest_epoch


class ManifestReads:
    """The manifest reads of one remote link (module invariants)."""

    def __init__(self, link: RemoteLink, remote_name: str) -> None:
        self._link = link
        self._remote_name = remote_name
        self._lock = threading.Lock()
        self._running: dict[bytes, Future[Any]] = {}

    def after_fork(self) -> None:
        """In a forked child: the parent's reads ran on threads not here."""
        self._lock = threading.Lock()
        self._running = {}

    def epoch(self, namespace_id: bytes, wait_s: float) -> int | None:
        """The epoch the manifest carries (None: no manifest, or none of it).

        Raises:
            RemotePendingError: the read is still running (it goes on).
            ManifestError: the manifest's epoch cannot be established.
            TierError: the breaker is open, or the read failed.
        """
        with self._lock:
            future = self._running.get(namespace_id)
            starts = future is None
            if future is None:
                if not self._link.breaker.allow():
                    raise TierError(f"could not read the namespace manifest on remote {self._remote_name}: its breaker "
                                    "is open (a request failed just now)", hint="check remote/remote_options; it is retried")
                if self._link.inline.use():
                    future = Future()
                    _run_into(future, lambda: self._link.inline.run(lambda: _read(self._link, namespace_id)))
                else:
                    future = self._link.submit(lambda: _read(self._link, namespace_id))
                self._running[namespace_id] = future
        if not wait([future], timeout=wait_s if starts else 0.0).done:
            raise RemotePendingError(
                f"the namespace manifest on remote {self._remote_name} is still being read (first contact)",
                hint="nothing to do: the read goes on and a later call takes its answer; raise remote_deadline_s "
                     "if every start meets this")
        with self._lock:
            answered = self._running.get(namespace_id) is future
            if answered:
                del self._running[namespace_id]
        failure = future.exception()
        if failure is not None:
            if answered:
                self._link.breaker.failure()
            raise TierError(f"could not read the namespace manifest on remote {self._remote_name}: "
                            f"{type(failure).__name__}: {failure}", hint="check remote/remote_options; it is retried") from failure
        if answered:
            self._link.breaker.success()
        result = future.result()
        if isinstance(result, ManifestError):
            raise result
        return result  # type: ignore[no-any-return]


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
