"""What can be wrong with a store's path and LMDB files, each with its own fix.

Every failure to create, open or use an LMDB store becomes one
:class:`~ucm_db.errors.TierError` whose hint names *that* failure's fix: a
path that is a file, a read-only file system, no permission, a full disk,
a file that is not LMDB, a damaged file, the same store opened twice in one
process, too few reader slots. The generic "local, writable disk with free
space" hint is left for errors that really are about the disk.

Invariants:
    * Nothing here writes to an existing store: the checks read metadata
      (``stat``, the meta pages through :mod:`ucm_db.tiers.lmdb_meta`) or
      create missing directories, nothing else.
    * :func:`diagnose` never crashes the caller: page walks run in a child
      process (:func:`ucm_db.tiers.lmdb_recovery.walk_in_child`).
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from ucm_db.errors import TierError
from ucm_db.storelock import ensure_store_dir, os_error
from ucm_db.tiers.lmdb_meta import check_file
from ucm_db.tiers.lmdb_recovery import CHECK_TIMEOUT_S, walk_in_child

ENV_DIR = "lmdb"
DATA_FILE = "data.mdb"


def ensure_env_dir(env_dir: Path) -> None:
    """Creates the LMDB directory of a store if needed (see :func:`ensure_store_dir`)."""
    if env_dir.exists() and not env_dir.is_dir():
        raise TierError(f"{env_dir} is a file, but ucm-db keeps its LMDB files in a directory of that name",
                        hint=f"move {env_dir} away (the store then starts empty), or choose another store path")
    try:
        env_dir.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise os_error("create the LMDB directory", env_dir, exc) from exc


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


def lmdb_error(action: str, env_dir: Path, exc: BaseException) -> TierError:
    """The TierError for an LMDB failure, with the hint for its cause."""
    message = f"{action} {env_dir} failed: {exc}"
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.CursorFullError, lmdb.PanicError)):
        return TierError(message, hint=damaged_hint(env_dir.parent))
    if isinstance(exc, (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.IncompatibleError)):
        return TierError(message, hint=f"{env_dir / DATA_FILE} is not a data file of this LMDB version: "
                         f"move {env_dir} aside (the store then starts empty), or use the ucm-db that wrote it")
    if isinstance(exc, lmdb.ReadersFullError):
        return TierError(message, hint="raise max_readers, or open fewer stores and threads on this path at once")
    if "already open in this process" in str(exc):
        return TierError(message, hint="open each store once per process and share that Store object between threads")
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
