"""The uploader election of a store directory: who drains its upload queue.

One process per store directory uploads (:mod:`ucm_db.remote.uploader`):
the one holding an exclusive ``flock`` on ``uploader.lock`` in it. The
kernel lets the lock go when its process ends, and another process's
uploader takes it at its next poll.

The holder writes its pid into the file when elected, so that a process
whose ``flush`` times out because another one uploads can say which
(:meth:`UploaderElection.describe_holder`): it used to blame the remote.

Invariants:
    * A failure to open or lock the file (other than another holder) is no
      holder: :meth:`UploaderElection.take` answers False and records it
      (:attr:`UploaderElection.problem`), the uploader tries again at its
      next poll, and a flush that times out names it (the uploader's thread
      used to die on it, and flush blamed a process that did not exist).
    * The lock is taken without blocking; a process holds it through one
      descriptor, closed only by :meth:`UploaderElection.release` (the
      uploader's, once its last remote call ended) or by the process's end.
    * A forked child drops its copy of the descriptor at the fork, without
      touching the parent's lock (:meth:`UploaderElection.forget_after_fork`,
      run for every election of the process by an at-fork hook). A ``flock``
      lasts while any descriptor of its open file lives: the child used to
      drop its copy only when it used the store again, so a forked child
      that never did (a worker process, a helper) kept the election after
      the elected process died, and no process of the store directory
      uploaded again while it lived (audit: tests/remote/test_audit_uploads_election.py).
    * The hook sees every descriptor: a take holds :data:`_GATE` from its
      open of the file until the descriptor is recorded (or closed), and a
      release while it closes one, and a fork waits for it (a fork while
      another thread was between the ``flock`` and the record, in
      ``ftruncate``/``pwrite``, which let the GIL go, left the child a
      locked descriptor nobody knew: tests/remote/test_review_uploads_fork.py).
      The wait is bounded (:data:`FORK_WAIT_S`: a take stuck on its file
      system must not hang every fork of the process); past it the child
      closes the descriptor the take holds (:data:`_taking`) as well.
    * The pid recorded is advisory: written after the lock is taken, read
      without it; a holder that does not write one (an older ucm-db, a tool
      holding the lock) reads as "not recorded".
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import weakref
from pathlib import Path

from ucm_db.errors import TierError, UploaderElsewhereError

#: The election's lock file, in the store directory.
LOCK_NAME = "uploader.lock"
#: Longest pid record read back.
_RECORD_BYTES = 64
#: How long a fork waits for a take or release of another thread (module invariants).
FORK_WAIT_S = 2.0

#: Held by a take from its open until its descriptor is recorded, by a
#: release while it closes one, and by a fork (module invariants).
_GATE = threading.Lock()
#: The descriptor a take holds under :data:`_GATE` before it is recorded (None: none).
_taking: int | None = None
#: Per thread: whether its fork holds :data:`_GATE` (its wait did not time out).
_forking = threading.local()


class UploaderElection:
    """The election lock of one store directory, as this process sees it.

    Args:
        store_dir: the directory holding :data:`LOCK_NAME`.
    """

    def __init__(self, store_dir: Path) -> None:
        self.path = store_dir / LOCK_NAME
        self._fd: int | None = None  # set and cleared under _GATE (the pool's last call may release it)
        #: Why the last :meth:`take` failed other than by another holder (None: it did not).
        self.problem: str | None = None
        _ELECTIONS.add(self)

    @property
    def held(self) -> bool:
        """Whether this process holds the election."""
        return self._fd is not None

    def take(self) -> bool:
        """Takes the election if nobody holds it; whether this process holds it."""
        global _taking
        if self._fd is not None:
            return True
        with _GATE:  # until the descriptor is recorded or closed (module invariants)
            try:
                fd = _taking = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                self.problem = f"cannot open {self.path}: {exc}"
                return False
            try:
                return self._lock(fd)
            finally:
                _taking = None

    def _lock(self, fd: int) -> bool:
        """Locks the just opened ``fd`` and records it (closes it when another holds the lock)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self.problem = None if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else f"cannot lock {self.path}: {exc}"
            return False
        self.problem = None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is advisory (module invariants): the election stands without it
        self._fd = fd
        return True

    def release(self) -> None:
        """Lets the election go (closes this process's descriptor)."""
        with _GATE:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    def forget_after_fork(self) -> None:
        """In a forked child: drops the inherited descriptor (closing this
        copy leaves the parent's lock alone)."""
        fd, self._fd = self._fd, None
        _close_quietly(fd)

    def flush_timeout(self, waiting: str, last_error: str | None) -> TierError:
        """The error of a ``flush`` that timed out ``waiting`` (what is
        left): the remote is blamed only when this process is the uploader."""
        if not self.held and self.problem is not None:
            return TierError(f"{waiting}: this process cannot take the store directory's uploader election: {self.problem}",
                             hint="free what stops it (file descriptors, the file's permissions, what stands in its "
                                  "place); it is tried again every half second")
        if not self.held:
            return UploaderElsewhereError(f"{waiting}: this process is not the uploader: {self.describe_holder()}"
                                          + (f" (this process's last error: {last_error})" if last_error else ""))
        return TierError(waiting + (f" (last error: {last_error})" if last_error else ""),
                         hint="check the remote; the blocks stay queued and upload when it is back")

    def holder_pid(self) -> int | None:
        """The pid the holder recorded, None if none is (or it is unreadable)."""
        try:
            with open(self.path, "rb") as file:
                text = file.read(_RECORD_BYTES)
            return int(text.split()[0]) if text.strip() else None
        except (OSError, ValueError, IndexError):
            return None

    def describe_holder(self) -> str:
        """Who holds the election, in words, for an error (this process not)."""
        pid = self.holder_pid()
        if pid is None:
            return f"another process holds this store directory's uploader election ({self.path}; its pid is not recorded)"
        if pid == os.getpid():
            return (f"another store of this directory in this process (pid {pid}) holds its uploader election "
                    f"({self.path}); a store closed while its remote calls still ran keeps it until they end")
        if not _alive(pid):
            return (f"another process holds this store directory's uploader election ({self.path}; the pid in it, {pid}, "
                    f"is of a process that has ended: the holder did not record its own)")
        return f"process {pid} holds this store directory's uploader election ({self.path}), so only it uploads"


#: Every election of this process, for the at-fork hook (module invariants).
_ELECTIONS: weakref.WeakSet[UploaderElection] = weakref.WeakSet()


def _before_fork() -> None:
    _forking.gated = _GATE.acquire(timeout=FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_forking, "gated", False):
        _forking.gated = False
        _GATE.release()


def _after_fork_in_child() -> None:
    global _GATE, _taking
    stray = None if getattr(_forking, "gated", False) else _taking  # a take stuck past FORK_WAIT_S holds it
    _GATE, _taking, _forking.gated = threading.Lock(), None, False  # the parent's threads are gone
    descriptors = {election._fd for election in list(_ELECTIONS)} | {stray}
    for election in list(_ELECTIONS):
        election._fd = None
    for fd in descriptors:
        _close_quietly(fd)


def _close_quietly(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by another user
    return True
