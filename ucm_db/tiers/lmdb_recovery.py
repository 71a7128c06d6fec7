"""Power-loss recovery for LMDB stores written with ``durability="group"``.

Group durability commits with LMDB's NOSYNC and fsyncs in the background.
A process crash loses nothing (the page cache keeps every commit), but an OS
crash or power loss between a commit and the next sync can leave a meta page
that points at pages never written: a damaged file, which LMDB cannot detect
and which may crash a reader (SIGBUS, SIGSEGV) instead of raising.

This module makes that case detectable and harmless:

* :class:`UnsyncedMarker`: before its first unsynced commit, a process
  creates ``unsynced/<boot id>.<pid>`` in the environment directory and
  fsyncs it. It removes the marker at close, or after a sync once a whole
  sync interval passed without a commit: a writing process keeps its marker,
  so the fsyncs are paid when writing starts, not once per interval. A
  marker therefore exists on disk whenever unsynced commits may exist.
* :func:`recover_after_os_crash`: at open, under an exclusive ``flock``, a
  marker of another boot means the machine went down with unsynced commits.
  The environment is then read end to end in a child process (every table,
  every value's first and last byte); if the child fails or dies, the
  environment directory is moved to ``<store>/damaged/lmdb-<time>`` and the
  store starts empty (it is a cache). Markers of this boot whose process is
  gone are left by process crashes, which lose nothing: they are removed.

Invariants:
    * A marker is durable (file and directory fsynced) before the commit it
      covers starts, and removed only after a sync that began after the last
      commit it covers (or at close, after the final sync).
    * A store is never moved aside unless a marker of another boot exists
      and the child check failed; a check is never run in this process.
    * Without a boot id (not Linux) markers are not written and nothing is
      checked: group durability then keeps its documented power-loss risk.

``UCM_DB_BOOT_ID`` overrides the boot id. It exists for the tests, which
cannot power a machine off: they write under one boot id and reopen under
another, which is what a reboot looks like to this module.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
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


class UnsyncedMarker:
    """This process's marker of unsynced commits in one environment.

    Call :meth:`before_commit` before every unsynced write transaction,
    :meth:`synced` with the generation read by :meth:`generation` before each
    sync started, and :meth:`closed` when the environment closes. Thread-safe;
    create a new one in a forked child.
    """

    def __init__(self, env_dir: Path) -> None:
        self._dir = env_dir / MARKER_DIR
        self._boot = boot_id()
        self._lock = threading.Lock()
        self._generation = 0            # commits announced so far
        self._generation_at_last_sync = -1
        self._present = False

    @property
    def path(self) -> Path:
        return self._dir / f"{self._boot}.{os.getpid()}"

    def generation(self) -> int:
        """Commits announced so far; read it before starting a sync."""
        with self._lock:
            return self._generation

    def before_commit(self) -> None:
        """Makes sure a durable marker exists before an unsynced commit."""
        if self._boot is None:
            return
        with self._lock:
            self._generation += 1
            if self._present:
                return
            self._dir.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, f"{time.time():.3f}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync(self._dir)
            self._present = True

    def synced(self, generation_before_sync: int) -> None:
        """After a sync: removes the marker if no commit was announced since
        the previous sync began (a commit-free interval, all of it synced)."""
        with self._lock:
            idle = generation_before_sync == self._generation_at_last_sync == self._generation
            self._generation_at_last_sync = generation_before_sync
            if idle:
                self._remove()

    def closed(self) -> None:
        """When the environment closes: removes the marker if the last sync
        began after the last commit (``Store.close`` syncs first); else it
        stays, and the next open syncs the file and removes it."""
        with self._lock:
            if self._generation == self._generation_at_last_sync:
                self._remove()

    def _remove(self) -> None:
        if not self._present:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._present = False  # a lost unlink only costs a check after a crash


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover_after_os_crash` found and did (returned only when
    it read the environment in a child)."""

    foreign_markers: int  # markers of another boot: unsynced commits before an OS crash
    damaged: bool         # the child's end-to-end read failed; the environment was moved aside
    moved_to: Path | None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_after_os_crash(env_dir: Path) -> RecoveryReport | None:
    """Checks ``env_dir`` if an OS crash may have damaged it (see module doc).

    Returns None when there was nothing to look at (no markers, or no boot id).
    """
    current = boot_id()
    markers_dir = env_dir / MARKER_DIR
    if current is None or not markers_dir.is_dir():
        return None
    lock_path = env_dir.parent / f".{env_dir.name}.recovery.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        foreign: list[Path] = []
        dead: list[Path] = []
        for marker in markers_dir.iterdir():
            boot, _, pid = marker.name.rpartition(".")
            if boot != current:
                foreign.append(marker)
            elif pid.isdigit() and not _pid_alive(int(pid)):
                dead.append(marker)
        if dead:
            # A process crash: the page cache kept its commits, but they are
            # not on disk yet. Sync the file before forgetting the marker.
            _fsync(env_dir / "data.mdb")
            for marker in dead:
                marker.unlink(missing_ok=True)
        if not foreign:
            return None
        failure = _check_in_child(env_dir)
        if failure is None:
            for marker in foreign:
                marker.unlink(missing_ok=True)
            logger.info("ucm-db: %s had unsynced commits before an OS crash; it reads back whole", env_dir)
            return RecoveryReport(len(foreign), damaged=False, moved_to=None)
        moved_to = env_dir.parent / DAMAGED_DIR / f"{env_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        moved_to.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(env_dir, moved_to)
        logger.warning(
            "ucm-db: %s was damaged by an OS crash or power loss during group-durability writes (%s); "
            "moved it to %s and started an empty store. Delete that directory once you no longer need it; "
            "use durability='sync' where a power loss must not cost the cache.", env_dir, failure, moved_to,
        )
        return RecoveryReport(len(foreign), damaged=True, moved_to=moved_to)
    finally:
        os.close(fd)


_CHECK_SCRIPT = r"""
import sys
import lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, subdir=True, max_dbs=64)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        db = env.open_db(name, txn=txn, create=False)
        for _key, value in txn.cursor(db=db):
            if len(value):
                value[0], value[len(value) - 1]
"""


def _check_in_child(env_dir: Path) -> str | None:
    """Reads every table of the environment in a child; None if it read
    back whole, else what went wrong (an error, a signal, a timeout)."""
    if not (env_dir / "data.mdb").exists():
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHECK_SCRIPT, str(env_dir)],
            capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        return f"the check did not finish in {CHECK_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"the check was killed by signal {-done.returncode}"
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"the check exited with status {done.returncode}"

