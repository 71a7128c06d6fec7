"""Post-crash checks of LMDB stores: legacy markers, the child read, set-aside.

Group durability no longer risks the file (:mod:`ucm_db.engines.lmdb.groupsync`
reopens the last synced snapshot after an OS crash). Versions before it ran
group durability on a bare MDB_NOSYNC and announced unsynced commits with a
durable marker file, ``unsynced/<boot id>.<pid>``, in the environment
directory. A store such a version left behind when the machine went down
may be damaged, and this module still handles it:

* :func:`recover_after_os_crash`: at open, under :func:`recovery_lock`, a
  marker of another boot means unsynced commits before an OS crash. The
  environment is read end to end in a child process (every table, every
  value's first and last byte); if the child fails or dies, the environment
  directory is moved to ``<store>/damaged/lmdb-<time>`` and the store starts
  empty (it is a cache). Markers of this boot whose process is gone were
  left by process crashes, which lose nothing: they are removed after the
  data file is fsynced.

Invariants:
    * A store is never moved aside unless a marker of another boot exists
      and the child check failed; a check is never run in this process.
    * No current code writes markers; this is the last resort for old ones.

``UCM_DB_BOOT_ID`` overrides the boot id. It exists for the tests, which
cannot power a machine off: they write under one boot id and reopen under
another, which is what a reboot looks like to ucm-db.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER_DIR = "unsynced"
DAMAGED_DIR = "damaged"
BOOT_ID_ENV = "UCM_DB_BOOT_ID"
#: Longest the child may take to read a store after an OS crash.
CHECK_TIMEOUT_S = 3600.0
_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")

logger = logging.getLogger("ucm_db")


def boot_id() -> str | None:
    """This boot's id (Linux), ``UCM_DB_BOOT_ID`` if set, else None."""
    override = os.environ.get(BOOT_ID_ENV)
    if override:
        return override
    try:
        return _BOOT_ID_FILE.read_text().strip() or None
    except OSError:
        return None


def _fsync(path: Path) -> None:
    """fsync of a file or a directory (Linux opens both read-only); a
    missing path has nothing to sync."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover_after_os_crash` found and did (returned only when
    it read the environment in a child)."""

    foreign_markers: int  # markers of another boot: unsynced commits before an OS crash
    damaged: bool         # the child's end-to-end read failed; the environment was moved aside
    moved_to: Path | None


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs (or is stopped) in this PID
    namespace; a pid of 0 or less names none."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_aside(env_dir: Path) -> Path:
    """Moves a damaged environment directory to ``<store>/damaged/<name>-<time>-<pid>``
    (kept for inspection; the store then starts empty) and returns where.
    The caller makes sure no process has it open."""
    moved_to = env_dir.parent / DAMAGED_DIR / f"{env_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    moved_to.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.replace(env_dir, moved_to)
    _fsync(env_dir.parent)
    return moved_to


@contextmanager
def recovery_lock(env_dir: Path) -> Iterator[None]:
    """Exclusive ``flock`` that serialises post-crash checks of ``env_dir``
    between processes (a file beside it, so moving it aside is allowed)."""
    fd = os.open(env_dir.parent / f".{env_dir.name}.recovery.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def recover_after_os_crash(env_dir: Path) -> RecoveryReport | None:
    """Checks ``env_dir`` if an OS crash may have damaged it (see module doc).

    Returns None when there was nothing to look at (no markers, or no boot id).
    """
    current = boot_id()
    markers_dir = env_dir / MARKER_DIR
    if current is None or not markers_dir.is_dir():
        return None
    with recovery_lock(env_dir):
        foreign: list[Path] = []
        dead: list[Path] = []
        for marker in markers_dir.iterdir():
            boot, _, pid = marker.name.rpartition(".")
            if boot != current:
                foreign.append(marker)
            elif pid.isdigit() and not pid_alive(int(pid)):
                dead.append(marker)
        if dead:
            # A process crash: the page cache kept its commits, but they are
            # not on disk yet. Sync the file before forgetting the marker.
            _fsync(env_dir / "data.mdb")
            for marker in dead:
                marker.unlink(missing_ok=True)
        if not foreign:
            return None
        failure = walk_in_child(env_dir, lock=False)
        if failure is None:
            for marker in foreign:
                marker.unlink(missing_ok=True)
            logger.info("ucm-db: %s had unsynced commits before an OS crash; it reads back whole", env_dir)
            return RecoveryReport(len(foreign), damaged=False, moved_to=None)
        moved_to = set_aside(env_dir)
        logger.warning(
            "ucm-db: %s was damaged by an OS crash or power loss during group-durability writes (%s); "
            "moved it to %s and started an empty store. Delete that directory once you no longer need it; "
            "use durability='sync' where a power loss must not cost the cache.", env_dir, failure, moved_to,
        )
        return RecoveryReport(len(foreign), damaged=True, moved_to=moved_to)


_WALK_SCRIPT = r"""
import sys
import lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=sys.argv[2] == "lock", subdir=True, max_dbs=64)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        db = env.open_db(name, txn=txn, create=False)
        for _key, value in txn.cursor(db=db):
            if len(value):
                value[0], value[len(value) - 1]
"""
_SIGNAL_NAMES = {6: "SIGABRT, an LMDB assertion on a damaged page", 7: "SIGBUS, a page past the end of the file",
                 11: "SIGSEGV, a damaged page pointer"}


def walk_in_child(env_dir: Path, *, lock: bool = True, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Reads every table of the environment in a child process (every key,
    every value's first and last byte); None if it read back whole, else
    one sentence saying what went wrong (an LMDB error, the signal that
    killed the child, a timeout). A damaged file can crash the reader
    (LMDB asserts, or SIGBUS past a truncated end): only the child dies.

    ``lock=False`` reads without LMDB's lock file: only for a store no
    process has open (the open-time check after an OS crash)."""
    if not (env_dir / "data.mdb").exists():
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WALK_SCRIPT, str(env_dir), "lock" if lock else "nolock"],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired:
        return f"reading it did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        signum = -done.returncode
        return f"reading it killed the reading process with signal {signum} ({_SIGNAL_NAMES.get(signum, 'a crash')})"
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"reading it failed with exit status {done.returncode}"
