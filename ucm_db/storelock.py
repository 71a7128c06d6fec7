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
    * Creating the store directory (:func:`ensure_store_dir`) and opening
      the lock file turn every OSError into a TierError whose hint names
      that failure's fix (:func:`os_error`).
    * Names are made durable, not left to the file system's journal: each
      directory :func:`ensure_store_dir` creates is fsynced into its parent
      before it returns, and a writable open fsyncs the store directory and
      its engine's (:func:`sync_store_names`) before anything is acknowledged,
      so a power cut on a file system that keeps names only once their
      directory is synced (POSIX's promise) cannot take a store whose blocks
      were acknowledged durable.
    * A store is created by one process at a time: the process that finds
      no engine directory takes :func:`hold_creation` (an exclusive
      ``flock`` on ``PATH/.ucm-db.creating``, a file of ucm-db's own) and
      looks again before it creates one, so two processes creating a store
      at once with different engines cannot leave both engines' directories
      in it (each then ran its own store). Never on the store directory
      itself, which ``flock DIR cmd`` wrappers lock (a service started so
      would wait for its own wrapper), nor on ``ucm-db.lock`` (see
      :class:`CreationLock`). The file exists only while a creator holds it
      (or after a crash mid-creation, until the next creator takes and
      removes it): it is removed under the lock as the lock ends, and a
      waiter that then gets the removed file's lock locks the new one
      instead. Where the file cannot be made (no write access: the engine's
      creation then says so) or locked (no ``flock``) creation goes on
      unserialised.
    * A read-only holder (``read_only=True``, a store on a read-only
      volume) creates nothing: it locks an existing lock file through a
      read-only descriptor (``flock`` needs no write access), and where
      there is no lock file it holds nothing (no process of this version
      ever opened the store writable, so nobody can be compacting it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from ucm_db.errors import LockedError, TierError

LOCK_FILE = "ucm-db.lock"
#: Held by the process creating a new store, only while it does (module invariants).
CREATION_FILE = ".ucm-db.creating"
#: Longest a process opening a store waits for maintenance to finish.
SHARED_WAIT_S = 600.0
_POLL_S = 0.02


class StoreLock:
    """One open descriptor on the lock file, holding a shared or exclusive lock."""

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False) -> None:
        self.path = Path(path) / LOCK_FILE
        self._fd: int | None = None
        self._absent = False  # read-only and no lock file: nothing to hold
        try:
            if read_only:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            else:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError as exc:
            if not read_only:
                raise os_error("open the store's lock file", self.path, exc) from exc
            self._absent = True
        except OSError as exc:
            raise os_error("open the store's lock file", self.path, exc) from exc
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
        if self._absent:
            self.mode = "none"
            return
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
        if self._absent:
            return False
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


class CreationLock:
    """An exclusive ``flock`` on ``PATH/.ucm-db.creating`` while a new
    store's engine is chosen and created (module invariants);
    :meth:`release` removes the file and ends the lock (idempotent).

    A file of its own, not ``ucm-db.lock``: a creator holds that one shared
    from before the engine opens until it closes (its invariants), so an
    exclusive lock on it would wait for every process with the store open,
    and two creators, each holding it shared, would wait for each other
    (``flock`` cannot turn a shared lock exclusive without dropping it).
    """

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path / CREATION_FILE
        self._fd: int | None = None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
                    return  # unserialised: creating the engine reports the access it lacks
                raise os_error("open the store's creation lock file", self.path, exc) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise LockedError(
                        f"{describe(holders(path, CREATION_FILE))} has been creating the store at {path} for more "
                        f"than {timeout_s:g} s (it holds {self.path})",
                        hint="wait for that process or stop it (an exited one holds nothing), or choose another store path",
                    ) from None
                time.sleep(_POLL_S)
                continue
            except OSError:
                self._fd = fd  # no flock here: unserialised, the file removed at release
                return
            if _same_file(fd, self.path):
                self._fd = fd
                return
            os.close(fd)  # the holder removed it as it let go: lock the file there now

    def release(self) -> None:
        """Removes the file and ends the lock (in that order: see the module
        invariants); again: nothing."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass  # left for the next creator, who takes and removes it
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether descriptor ``fd`` is the file at ``path`` (not one removed)."""
    try:
        held, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def hold_creation(path: str | os.PathLike[str], timeout_s: float = SHARED_WAIT_S) -> CreationLock:
    """Serialises the processes creating the store at ``path`` (module invariants)."""
    return CreationLock(Path(path), timeout_s)


def os_error(what: str, path: Path, exc: OSError) -> TierError:
    """A TierError for an OSError while creating or opening ``path``."""
    code = exc.errno
    if code == errno.EROFS:
        return TierError(f"cannot {what} {path}: the file system is read-only",
                         hint="put the store on a writable local disk or remount that file system read-write; "
                         "to only read an existing store there, open it with read_only=True")
    if code in (errno.EACCES, errno.EPERM):
        return TierError(f"cannot {what} {path}: permission denied",
                         hint=f"give this user ({os.getuid()}) write access to {path.parent}, or choose a store path it owns")
    if code == errno.ENOSPC:
        return TierError(f"cannot {what} {path}: no space left on the device",
                         hint="free space on that disk, or lower capacity_bytes / choose a store path on a larger disk")
    if code in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        return TierError(f"cannot {what} {path}: {blocker} is a file, not a directory",
                         hint=f"move {blocker} away or choose another store path (a store is a directory)")
    return TierError(f"cannot {what} {path}: {exc}")


def ensure_store_dir(path: str | os.PathLike[str]) -> Path:
    """Creates the store directory (0700, with parents) if needed; every
    failure is a TierError with the fix (the path is a file, read-only
    file system, permission, full disk). Returns the path."""
    store = Path(path)
    if store.exists() and not store.is_dir():
        raise TierError(f"the store path {store} is a file, not a directory",
                        hint=f"move {store} away or choose another store path (a store is a directory)")
    created = [d for d in (store, *store.parents) if not d.exists()]
    try:
        store.mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in reversed(created):
            fsync_dir(directory.parent)
    except OSError as exc:
        raise os_error("create the store directory", store, exc) from exc
    return store


def sync_store_names(path: str | os.PathLike[str], engine_dir_name: str | None) -> None:
    """Makes the names in the store directory and in its engine's directory
    (``engine_dir_name``, None if there is none) durable: a writable open
    runs it once the engine created its files (module invariants)."""
    store = Path(path)
    try:
        if engine_dir_name is not None:
            fsync_dir(store / engine_dir_name)
        fsync_dir(store)
    except OSError as exc:
        raise os_error("make the names of the store durable in", store, exc) from exc


def fsync_dir(path: Path) -> None:
    """fsyncs directory ``path`` (its entries: a new, renamed or removed
    name in it is durable once this returns). Where that cannot be asked,
    nothing more is on offer and it is no error: a directory this user may
    write but not read (a drop directory, mode 0733: it cannot be opened),
    or a file system that cannot sync one (EINVAL, ENOTSUP: some network
    and FUSE file systems; EROFS, EBADF). A failed sync (EIO) raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS, errno.EBADF):
            raise
    finally:
        os.close(fd)


def hold_shared(path: str | os.PathLike[str], timeout_s: float = SHARED_WAIT_S, *, read_only: bool = False) -> StoreLock:
    """Opens the lock file of the store at ``path`` and holds it shared
    (``read_only``: creating nothing, see the module invariants)."""
    lock = StoreLock(path, read_only=read_only)
    lock.acquire_shared(timeout_s)
    return lock


def holders(path: str | os.PathLike[str], lock_file: str = LOCK_FILE) -> list[int]:
    """Pids holding or waiting for the lock file ``lock_file`` of the store
    at ``path`` (Linux ``/proc/locks``; empty where that is unavailable).

    ``/proc/locks`` names the process that *took* a lock, which may have
    exited since while a process it forked holds the lock on (a shared
    descriptor), and its pid may now be another program's. A listed pid
    without the lock file open is replaced by the processes that have it
    open (a scan of ``/proc/*/fd``, only then)."""
    try:
        stat = os.stat(Path(path) / lock_file)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    listed = _listed(lines, stat.st_ino)
    file_id = (stat.st_dev, stat.st_ino)
    verified = [pid for pid in listed if _has_open(pid, file_id, lock_file) is not False]
    if len(verified) < len(listed):
        verified = sorted(set(verified) | set(_openers(file_id, lock_file)))
    return verified


def _has_open(pid: int, file_id: tuple[int, int], name: str) -> bool | None:
    """Whether process ``pid`` has the file ``file_id`` (st_dev, st_ino),
    named ``name``, open; None where its descriptors cannot be read
    (another user's)."""
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                try:
                    if not os.readlink(fd.path).endswith(name):
                        continue  # the link's text first: stat lock files only, never one on a hung NFS mount
                    found = os.stat(fd.path)
                except OSError:
                    continue
                if (found.st_dev, found.st_ino) == file_id:
                    return True
    except PermissionError:
        return None
    except OSError:
        return False  # exited
    return False


def _openers(file_id: tuple[int, int], name: str) -> list[int]:
    """Every process with the file ``file_id`` (named ``name``) open (readable ones only)."""
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    return [pid for pid in pids if _has_open(pid, file_id, name)]


def _listed(lines: list[str], inode: int) -> list[int]:
    """Pids of the FLOCK lines of ``/proc/locks`` on inode ``inode``."""
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
