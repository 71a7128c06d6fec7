"""The temp file an export writes before renaming it over the archive, and
the removal of those that exports killed mid-write left behind.

A SIGKILLed (or OOM-killed, or powered-off) export cannot remove its temp
file, and an earlier ucm-db left such files beside the archive for ever.
This module makes each temp file say, for as long as it lives, whether its
export is alive: the writer holds an exclusive ``flock`` on it from the
moment it exists until after the rename, and the kernel drops that lock
when the process ends, however it ends. The next export to the directory
takes every such lock it can get, and a temp file whose lock it gets is
provably abandoned.

Invariants:
    * A temp file is named ``.<archive name>.ucm-db-export.<16 hex>.partial``
      (:data:`TEMP_NAME`), created ``O_CREAT | O_EXCL | O_NOFOLLOW`` and
      locked (``flock``, exclusive) before :func:`locked_temp` hands it
      out, and unlocked only after its caller renamed or removed it; a name that a cleaner removed between the create and the
      lock (its link count is then 0) is given up and another one made, so
      the returned file is linked and locked.
    * :func:`remove_abandoned_temps` removes only a regular file of that
      name whose exclusive ``flock`` it takes without waiting, and removes
      it while holding that lock, after checking that the name still
      names the locked file. A live export holds its lock until it has
      renamed the file, so its temp is never removed: not on pid reuse
      (no pid is involved), not from another pid namespace or container
      on the same kernel, not from another thread of the same process
      (``flock`` locks belong to the open file, not to the process). Where
      ``flock`` is unavailable (ENOLCK, EINVAL) nothing is proved and
      nothing removed; nor are the temp files this process is writing
      (:data:`_WRITING`), whatever the file system's locks.
    * The temp files of earlier ucm-db versions (``.<name>.<16
      hex>.partial``), written without a lock, are never removed: nothing
      proves them abandoned (an older export may be running).
    * Removal is best effort: a failure (permission, a file that vanished,
      another cleaner first) skips that file and never fails the export.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: An export's temp file name: the archive's name, a mark no other program
#: uses (nor ucm-db's earlier, unlocked ``.<name>.<16 hex>.partial``), a
#: random token.
TEMP_NAME = re.compile(r"\..+\.ucm-db-export\.[0-9a-f]{16}\.partial")
#: Tries at a fresh name where a cleaner took the last one (each try needs
#: a cleaner's open-lock-unlink to land inside a create-then-lock window).
CREATE_TRIES = 8
#: ``flock`` errors that mean the file system has no such locks.
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP})
#: The temp files this process is writing. A cleaner skips them without
#: taking their lock: on a file system that emulates ``flock`` with
#: process-wide POSIX locks (NFS), a second export in this process would
#: get the lock of the first one's file, and its close would drop it.
_WRITING: set[Path] = set()
_WRITING_LOCK = threading.Lock()


def temp_name(target: Path) -> Path:
    """A new temp name for ``target``, in its directory (:data:`TEMP_NAME`)."""
    return target.parent / f".{target.name}.ucm-db-export.{secrets.token_hex(8)}.partial"


@contextmanager
def locked_temp(target: Path, mode: int) -> Iterator[tuple[int, Path]]:
    """A new temp file for ``target``, as (descriptor, path): created, linked
    and held under an exclusive ``flock`` (module invariants) until the
    block exits, which closes the descriptor. The caller renames or
    removes the file inside the block, so it is never unlocked while named;
    it must not close the descriptor (``os.fdopen(fd, closefd=False)``).

    Raises:
        OSError: the file cannot be created (the caller names the fix).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(CREATE_TRIES):
        temp = temp_name(target)
        with _WRITING_LOCK:
            _WRITING.add(temp)
        try:
            fd = _created_and_locked(temp, flags, mode)
            if fd is None:
                continue
            try:
                yield fd, temp
            finally:
                os.close(fd)  # the lock ends here: the caller has renamed or removed the file
            return
        finally:
            with _WRITING_LOCK:
                _WRITING.discard(temp)
    raise OSError(errno.EAGAIN, f"no temp file in {target.parent} stayed linked over {CREATE_TRIES} tries")


def _created_and_locked(temp: Path, flags: int, mode: int) -> int | None:
    """The descriptor of the new file ``temp``, linked and locked; None where a
    cleaner took the name between the create and the lock."""
    fd = os.open(temp, flags, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # a cleaner holds it and removes the name: another one is made
        return None
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return fd  # no flock here: no cleaner can take a lock either, so none removes it
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    if os.fstat(fd).st_nlink > 0:
        return fd
    os.close(fd)  # removed by a cleaner before the lock was taken
    return None


def remove_abandoned_temps(directory: Path) -> list[str]:
    """Removes the temp files of dead exports in ``directory`` (module
    invariants); returns the names removed."""
    try:
        entries = [entry.name for entry in os.scandir(directory) if TEMP_NAME.fullmatch(entry.name)]
    except OSError:
        return []
    with _WRITING_LOCK:
        ours = set(_WRITING)
    return [name for name in sorted(entries) if directory / name not in ours and _remove_if_abandoned(directory / name)]


def _remove_if_abandoned(temp: Path) -> bool:
    try:
        if not stat.S_ISREG(os.lstat(temp).st_mode):
            return False  # never opened: a FIFO, device or symlink planted under such a name
        # O_NONBLOCK: a FIFO swapped in after the lstat cannot hang the open; O_NOFOLLOW: nor a symlink lead elsewhere.
        fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live export: BlockingIOError
        now = os.lstat(temp)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return False
        os.unlink(temp)  # under the lock: a writer that locks it later sees st_nlink == 0
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
