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


class UploaderElection:
    """The election lock of one store directory, as this process sees it.

    Args:
        store_dir: the directory holding :data:`LOCK_NAME`.
    """

    def __init__(self, store_dir: Path) -> None:
        self.path = store_dir / LOCK_NAME
        self._fd: int | None = None
        self._fd_lock = threading.Lock()  # the pool's last call may release it on its own thread
        #: Why the last :meth:`take` failed other than by another holder (None: it did not).
        self.problem: str | None = None
        _ELECTIONS.add(self)

    @property
    def held(self) -> bool:
        """Whether this process holds the election."""
        return self._fd is not None

    def take(self) -> bool:
        """Takes the election if nobody holds it; whether this process holds it."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            self.problem = f"cannot open {self.path}: {exc}"
            return False
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
        with self._fd_lock:
            self._fd = fd
        return True

    def release(self) -> None:
        """Lets the election go (closes this process's descriptor)."""
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def forget_after_fork(self) -> None:
        """In a forked child: drops the inherited descriptor (closing this
        copy leaves the parent's lock alone)."""
        self._fd_lock = threading.Lock()  # a parent's thread may have held it at the fork
        self.release()

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


def _forget_all_after_fork() -> None:
    for election in list(_ELECTIONS):
        election.forget_after_fork()


os.register_at_fork(after_in_child=_forget_all_after_fork)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by another user
    return True
