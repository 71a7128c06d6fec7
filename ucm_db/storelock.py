"""The store directory's advisory lock: who may rewrite the store's files.

Every process that opens a store holds a *shared* ``flock`` on
``PATH/ucm-db.lock`` for as long as the store is open. Maintenance that
replaces files under the store (``ucm-db compact``'s file rewrite, ``ucm-db
migrate``) takes it *exclusively*, so it runs only while no other process
has the store open, and a process opening the store meanwhile waits for it.

Invariants:
    * The shared lock is taken before the engine is opened and dropped only
      by closing the descriptor (never ``LOCK_UN``): a forked child shares
      the parent's lock, and unlocking in one would unlock both.
    * Taking the exclusive lock never waits: a caller that cannot have it
      learns which processes hold the store (:func:`holders`) and decides.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from ucm_db.errors import LockedError, TierError

LOCK_FILE = "ucm-db.lock"
#: Longest a process opening a store waits for maintenance to finish.
SHARED_WAIT_S = 600.0
_POLL_S = 0.02


class StoreLock:
    """One open descriptor on the lock file, holding a shared or exclusive lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path) / LOCK_FILE
        self._fd: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(f"cannot open the store's lock file {self.path}: {exc}") from exc
        self.mode = ""

    def _try(self, flags: int) -> bool:
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, flags | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def acquire_shared(self, timeout_s: float = SHARED_WAIT_S) -> None:
        """Takes the shared lock, waiting up to ``timeout_s`` for maintenance."""
        deadline = time.monotonic() + timeout_s
        while not self._try(fcntl.LOCK_SH):
            if time.monotonic() >= deadline:
                self.release()
                raise LockedError(
                    f"store at {self.path.parent} is held exclusively by {describe(holders(self.path.parent))} "
                    f"(maintenance such as ucm-db compact or migrate) for more than {timeout_s:.0f} s",
                    hint="wait for the maintenance command to finish, or stop it",
                )
            time.sleep(_POLL_S)
        self.mode = "shared"

    def try_exclusive(self) -> bool:
        """Takes the exclusive lock if no other process holds the store."""
        if self._try(fcntl.LOCK_EX):
            self.mode = "exclusive"
            return True
        return False

    def release(self) -> None:
        """Closes the descriptor (the lock goes once no fork shares it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.mode = ""

    def __del__(self) -> None:  # a store whose constructor failed
        self.release()

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_shared(path: str | os.PathLike[str], timeout_s: float = SHARED_WAIT_S) -> StoreLock:
    """Opens the lock file of the store at ``path`` and holds it shared."""
    lock = StoreLock(path)
    lock.acquire_shared(timeout_s)
    return lock


def holders(path: str | os.PathLike[str]) -> list[int]:
    """Pids holding or waiting for the lock of the store at ``path``
    (Linux ``/proc/locks``; empty where that is unavailable)."""
    try:
        inode = os.stat(Path(path) / LOCK_FILE).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids: set[int] = set()
    for line in lines:
        parts = line.split()
        if len(parts) > 1 and parts[1] == "->":
            parts = parts[:1] + parts[2:]
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        if parts[5].rsplit(":", 1)[-1] == str(inode):
            pids.add(int(parts[4]))
    return sorted(pids)


def describe(pids: list[int]) -> str:
    """``"pid 12 (python3), pid 15 (vllm)"`` for messages."""
    if not pids:
        return "another process"
    names = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = "?"
        names.append(f"pid {pid} ({comm})")
    return ", ".join(names)
