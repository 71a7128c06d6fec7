"""What can be wrong with a store's path and LMDB files, each with its own fix.

Every failure to create, open or use an LMDB store becomes one
:class:`~ucm_db.errors.TierError` whose hint names *that* failure's fix: a
path that is a file, a read-only file system, no permission, a full disk,
a file that is not LMDB, a damaged file, the same store opened twice in one
process, too few reader slots. The generic "local, writable disk with free
space" hint is left for errors that really are about the disk.

Invariants:
    * Nothing here writes to an existing store: the checks read metadata
      (``stat``, the meta pages through :mod:`ucm_db.engines.lmdb.meta`) or
      create missing directories, nothing else.
    * :func:`diagnose` never crashes the caller: page walks run in a child
      process (:func:`ucm_db.engines.lmdb.recovery.walk_in_child`).
    * :func:`check_pages_at_open` runs before a store's environment is
      mapped: a branch or leaf page that would crash this process (an LMDB
      assertion, a wild pointer: SIGABRT/SIGSEGV) is a
      :class:`~ucm_db.errors.DamagedPageError` naming it, found by a child process.
      Damage that appears after the open, under a running process that
      maps the file, is out of its reach (RELIABILITY.md). An open whose
      file is in the state its ledger vouches for, in this boot, skips the
      walk (:mod:`ucm_db.engines.lmdb.custody`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import lmdb

from ucm_db.engines.base import free_bytes
from ucm_db.errors import DamagedPageError, TierError
from ucm_db.storelock import ensure_store_dir, os_error
from ucm_db.engines.lmdb.meta import check_file
from ucm_db.engines.lmdb.pages import NO_PAGE, DamagedTree, first_reachable_page_past_end
from ucm_db.engines.lmdb.groupsync import RollbackReport, roll_back_after_os_crash
from ucm_db.engines.lmdb.recovery import (
    _SIGNAL_NAMES, CHECK_TIMEOUT_S, RecoveryReport, recover_after_os_crash, recovery_lock, set_aside, walk_in_child,
)

logger = logging.getLogger("ucm_db")

ENV_DIR = "lmdb"
DATA_FILE = "data.mdb"


def recover_at_open(env_dir: Path, *, pinned: bool) -> tuple[RecoveryReport | None, RollbackReport | None]:
    """What a writable open does first after an OS crash: the check of an
    older version's markers and, for a store that keeps a sync record
    (``pinned``), the rollback to the last synced snapshot, set aside if
    even that does not fit the file. Returns both reports (None: nothing to
    do); a file this user cannot read or write is a TierError with the fix."""
    try:
        recovery = recover_after_os_crash(env_dir)
        rollback = None
        if pinned:
            with recovery_lock(env_dir):
                rollback = roll_back_after_os_crash(env_dir)
                if rollback is not None:
                    set_aside_if_still_damaged(env_dir)
    except OSError as exc:
        raise TierError(
            f"cannot check LMDB store {env_dir} after an OS crash: {exc}",
            hint=f"give this user (uid {os.getuid()}) read and write access to {env_dir.parent} and everything "
            "under it, e.g. run as the store's owner" if isinstance(exc, PermissionError) else
            f"make {env_dir.parent} writable by this user, or delete the store (it is a cache)",
        ) from exc
    return recovery, rollback


def set_aside_if_still_damaged(env_dir: Path) -> None:
    """The last resort after a rollback: a synced snapshot that still does
    not fit in the file means the disk lost synced writes (it lied about
    fsync). The store is a cache: move it aside and start empty."""
    check = check_file(env_dir / "data.mdb")
    if check.ok:
        return
    moved_to = set_aside(env_dir)
    ensure_env_dir(env_dir)
    logger.warning(
        "ucm-db: %s lost synced writes in an OS crash (%s): the disk or its cache does not honour fsync. "
        "Moved it to %s and started an empty store.", env_dir, check.problem, moved_to,
    )


def ensure_env_dir(env_dir: Path) -> None:
    """Creates the LMDB directory of a store if needed (see :func:`ensure_store_dir`)."""
    if env_dir.exists() and not env_dir.is_dir():
        raise TierError(f"{env_dir} is a file, but ucm-db keeps its LMDB files in a directory of that name",
                        hint=f"move {env_dir} away (the store then starts empty), or choose another store path")
    try:
        env_dir.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise os_error("create the LMDB directory", env_dir, exc) from exc


#: Free bytes an open needs on the disk to create LMDB's files, beside the lock file's reader slots: the data file's
#: meta pages and the commits that create the tables and the store's records (a few pages), with room to spare.
CREATE_FREE_BYTES = 1 << 20
#: Bytes of one reader slot in LMDB's lock file (a cache line).
READER_SLOT_BYTES = 64
LOCK_FILE = "lock.mdb"


def check_room_to_create(env_dir: Path, max_readers: int) -> None:
    """Raises a TierError naming the full disk when an open would create
    LMDB's files with less than :data:`CREATE_FREE_BYTES` plus the
    lock file's reader slots free. LMDB sizes a new lock file with
    ``ftruncate`` (a sparse file) and writes it through its mapping: with no
    page left the kernel kills the process with SIGBUS; with a few pages,
    the data file's meta pages were cut short (a store every later open
    refused as damaged) or its tables never committed. A disk filled by
    someone else after this check can still do that."""
    lock_bytes = READER_SLOT_BYTES * (max_readers + 2)
    lock, data = env_dir / LOCK_FILE, env_dir / DATA_FILE
    if data.exists() and lock.exists():  # nothing to create (a lock file LMDB would grow, for more readers, is
        return                            # not checked: its size is LMDB's layout, not ours to guess)
    free, needed_bytes = free_bytes(env_dir), CREATE_FREE_BYTES + lock_bytes
    if free is not None and free < needed_bytes:  # unknown: the open itself names what is wrong there
        raise TierError(f"cannot create the LMDB store's files in {env_dir}: no space left on the device "
                        f"({free} bytes free, {needed_bytes} needed)",
                        hint="free space on that disk (nothing was written), or choose a store path on another disk")


def damaged_hint(store: Path) -> str:
    return (f"run `ucm-db verify {store}` to see the damage, then move {store / ENV_DIR} aside or delete it "
            "(the store is a cache and starts empty)")


def check_data_file(env_dir: Path) -> None:
    """Raises a TierError naming the damage if the data file is not an
    intact LMDB file (checked without mapping it: no SIGBUS)."""
    data = env_dir / DATA_FILE
    check = check_file(data)
    if check.ok:
        return
    if data.is_file() and not os.access(data, os.R_OK):  # not damage: never suggest moving the store aside
        raise TierError(f"LMDB store {env_dir} cannot be opened: permission denied on {data}",
                        hint=f"give this user (uid {os.getuid()}) read access to {env_dir.parent} and everything under it "
                        "(write access too, to open it writable), e.g. run as the store's owner")
    if data.exists() and not data.is_file():
        raise TierError(f"{data} is not a regular file",
                        hint=f"move {data} away: LMDB keeps the store's data in a file of that name")
    if check.current is None:
        raise TierError(f"LMDB store {env_dir} cannot be opened: {check.problem}",
                        hint=f"point ucm-db at a store directory, or move {env_dir} aside (the store then starts empty)")
    raise TierError(f"LMDB store {env_dir} cannot be opened: {check.problem}", hint=damaged_hint(env_dir.parent))


def lock_file_writable(env_dir: Path) -> bool:
    """True if this process could open (or create) LMDB's lock file for
    writing: a read-only open that failed then failed for another reason."""
    lock = env_dir / "lock.mdb"
    return os.access(lock, os.W_OK) if lock.exists() else os.access(env_dir, os.W_OK)


def lmdb_error(action: str, env_dir: Path, exc: BaseException) -> TierError:
    """The TierError for an LMDB failure, with the hint for its cause."""
    message = f"{action} {env_dir} failed: {exc}"
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.CursorFullError, lmdb.PanicError)):
        return DamagedPageError(message, hint=damaged_hint(env_dir.parent))
    if isinstance(exc, (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.IncompatibleError)):
        return DamagedPageError(message, hint=f"{env_dir / DATA_FILE} is not a data file of this LMDB version: "
                         f"move {env_dir} aside (the store then starts empty), or use the ucm-db that wrote it")
    if isinstance(exc, lmdb.ReadersFullError):
        return TierError(message, hint="raise max_readers, or open fewer stores and threads on this path at once")
    if "already open in this process" in str(exc):
        return TierError(message, hint="open each store once per process and share that Store object between threads")
    if isinstance(exc, lmdb.MemoryError) or "Cannot allocate memory" in str(exc):
        # ENOMEM from mmap: the map does not fit the address space left to this process; no disk is involved.
        return TierError(message, hint="LMDB maps the whole store (2 x capacity_bytes + 256 MiB, or map_size_bytes) "
                         "into the process's address space and it did not fit: lower capacity_bytes or map_size_bytes, "
                         "or lift the address-space limit (`ulimit -v`); free disk space does not help")
    if isinstance(exc, OSError) and exc.errno is not None:
        return os_error("use", env_dir, exc)
    if isinstance(exc, lmdb.Error) and "No space left" in str(exc):
        return TierError(message, hint="free space on that disk, or lower capacity_bytes")
    return TierError(message)


def diagnose(store_path: str | os.PathLike[str], timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """For ``ucm-db verify``/``inspect`` before they open a store: None if
    its LMDB files are intact (meta pages check out and a child process
    reads every table back), else one sentence naming the damage. Creates
    nothing; never crashes the caller. A store with no LMDB files is intact."""
    env_dir = Path(store_path) / ENV_DIR
    if not env_dir.exists():
        return None
    if not env_dir.is_dir():
        return f"{env_dir} is a file, not the LMDB directory"
    data = env_dir / DATA_FILE
    check = check_file(data)
    if not check.ok:
        return check.problem
    if not data.exists():
        return None
    # Without a lock file no process has the store open: read without one (and create none).
    return walk_in_child(env_dir, lock=(env_dir / "lock.mdb").exists(), timeout_s=timeout_s)


# -- the page check at open -------------------------------------------------------
#: Longest the open-time page check may take; past it the store opens unchecked (a warning says so).
OPEN_CHECK_TIMEOUT_S = 600.0
#: Walks every tree page of every table by its keys; a value's bytes are never
#: touched (LMDB dies on damaged branch/leaf pages, not on a value's bytes, and
#: touching every value would read the whole file).
_KEY_WALK_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
import lmdb
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.IncompatibleError, lmdb.BadValsizeError)
for attempt in range(16):  # another process may grow the map meanwhile (MDB_MAP_RESIZED)
    try:
        env = lmdb.open(sys.argv[1], readonly=True, lock=sys.argv[2] == "lock", subdir=True, max_dbs=64, mode=0o600)
        try:
            with env.begin(buffers=True) as txn:
                names = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
                for name in names:
                    db = env.open_db(name, txn=txn, create=False)
                    for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                        pass
        finally:
            env.close()
        sys.exit(0)
    except lmdb.MapResizedError:
        continue
    except DAMAGE as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(4)
sys.exit(4)
"""
#: The walk's exit status for an LMDB error that means damage (others are not the check's to judge).
_DAMAGE_STATUS = 3
_FREE_TREE_TRIES = 3
_LMDB_PATH = str(Path(lmdb.__file__).resolve().parent.parent)


class _Unchecked(Exception):
    """The walk could not run or finish: the store opens unchecked (a warning says so)."""


def page_damage(env_dir: Path, *, lock: bool, timeout_s: float = OPEN_CHECK_TIMEOUT_S) -> str | None:
    """None if every branch and leaf page of the store's current snapshot
    reads back (or the walk could not run: see :func:`check_pages_at_open`),
    else one sentence naming the damage. Never crashes the
    caller and maps nothing here: the free-page tree is walked with
    ``pread`` (:mod:`ucm_db.engines.lmdb.pages`), every other tree by LMDB
    itself in a child process (keys only).

    The child first reads without LMDB's lock file, so an intact store's
    lock file is left to the real open; a reader without a lock slot may
    meet pages another process is rewriting, so damage found that way is
    confirmed by a second walk holding a slot (``lock=True``; ``False``
    where the lock file cannot be written: a read-only volume)."""
    try:
        return _page_damage(env_dir, lock=lock, timeout_s=timeout_s)
    except _Unchecked:
        return None


def _page_damage(env_dir: Path, *, lock: bool, timeout_s: float) -> str | None:
    """:func:`page_damage`, raising _Unchecked where the walk could not run."""
    data = env_dir / DATA_FILE
    if not data.is_file() or data.stat().st_size == 0:
        return None
    problem = _free_tree_damage(data)
    if problem is not None:
        return problem
    if _walk(env_dir, lock=False, timeout_s=timeout_s) is None:
        return None
    return _walk(env_dir, lock=lock, timeout_s=timeout_s)


def _walk(env_dir: Path, *, lock: bool, timeout_s: float) -> str | None:
    """One key walk in a child process (see :func:`page_damage`)."""
    try:
        done = subprocess.run(
            # -S: no site initialisation (half the start-up time); lmdb's own directory is passed instead.
            [sys.executable, "-S", "-c", _KEY_WALK_SCRIPT, str(env_dir), "lock" if lock else "nolock", _LMDB_PATH],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired:
        logger.warning("ucm-db: the page check of %s did not finish in %.0f s; opened it unchecked", env_dir, timeout_s)
        raise _Unchecked from None
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"reading its pages killed the checking process with signal {-done.returncode} ({_SIGNAL_NAMES.get(-done.returncode, 'a crash')})"
    lines = done.stderr.strip().splitlines()
    if done.returncode == _DAMAGE_STATUS:
        return lines[-1] if lines else "LMDB reported damage"
    # Not damage (no reader slot, no memory for the map, a lock...): the open itself reports it with its own fix.
    logger.warning("ucm-db: the page check of %s could not run (%s); opening it unchecked", env_dir,
                   lines[-1] if lines else f"exit status {done.returncode}")
    raise _Unchecked


def _free_tree_damage(data: Path) -> str | None:
    """A damaged page of the free-page tree (which only a writer reads), by
    ``pread``. The tree is read without a snapshot held, so a walk during
    which other processes committed twice (they may reuse its pages) is
    tried again, and after a few such tries taken as intact."""
    for _ in range(_FREE_TREE_TRIES):
        before = check_file(data)
        if not before.ok or before.current is None or before.current.free_root == NO_PAGE:
            return None  # a file the meta check refuses is refused there, with its own message
        meta = before.current
        try:
            first_reachable_page_past_end(data, page_bytes=meta.page_bytes, last_page=meta.last_page,
                                          roots=(meta.free_root,), file_bytes=before.file_bytes)
            return None
        except DamagedTree as exc:
            after = check_file(data).current
            if after is None or after.txnid <= meta.txnid + 1:
                return f"its free-page tree is damaged: {exc}"
        except OSError:
            return None
    return None


def check_pages_at_open(env_dir: Path, *, lock: bool) -> bool:
    """Refuses to open a store with a damaged branch or leaf page (see
    :func:`page_damage`): LMDB would crash this process on reaching it.
    Returns whether the store was checked whole (False: the walk could not
    run or finish, and the store opens unchecked)."""
    try:
        problem = _page_damage(env_dir, lock=lock, timeout_s=OPEN_CHECK_TIMEOUT_S)
    except _Unchecked:
        return False
    if problem is not None:
        raise DamagedPageError(f"LMDB store {env_dir} has damaged pages: {problem}", hint=damaged_hint(env_dir.parent))
    return True
