"""Opening an LMDB environment's tables, and the environment read-only.

Invariants:
    * A map another process grew between this process's open and now is
      adopted (``MDB_MAP_RESIZED``), never reported as a failure.
    * A read-only open uses LMDB's lock file where this process may open
      it, and none (``MDB_NOLOCK``) where the volume is read-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from ucm_db.errors import FormatVersionError, TierError
from ucm_db.engines.base import INFO, NEVER_INITIALISED_HINT, TABLES, never_initialised
from ucm_db.engines.lmdb.checks import lmdb_error, lock_file_writable
from ucm_db.engines.lmdb.txn import lmdb_open


def open_read_only(path: Path, max_readers: int) -> lmdb.Environment:
    """The environment at ``path`` opened ``MDB_RDONLY`` (module
    invariants): with LMDB's lock file if this process may open it, else
    without."""
    options: dict[str, Any] = dict(
        subdir=True, readonly=True, max_dbs=len(TABLES) + 4, max_readers=max_readers, readahead=True, create=False,
    )
    try:
        return lmdb_open(str(path), lock=True, **options)
    except (lmdb.ReadonlyError, lmdb.Error, OSError) as exc:
        if lock_file_writable(path):
            raise lmdb_error("Opening LMDB store (read-only)", path, exc) from exc
    try:
        return lmdb_open(str(path), lock=False, **options)
    except (lmdb.Error, OSError) as exc:
        raise lmdb_error("Opening LMDB store (read-only)", path, exc) from exc


def open_read_only_tables(path: Path, max_readers: int) -> tuple[lmdb.Environment, dict[str, Any]]:
    """:func:`open_read_only` and its tables; a refused store (a half-made
    or an older one) does not leave its environment open in the process
    (which refused every later open of it there: "already open")."""
    env = open_read_only(path, max_readers)
    try:
        return env, open_tables(env, path, create=False)
    except BaseException:
        env.close()
        raise


def open_tables(env: lmdb.Environment, path: Path, *, create: bool) -> dict[str, Any]:
    """Opens the named tables, adopting a map that another process grew
    between our open and now (found by the crash loop: a reopen failed
    with MDB_MAP_RESIZED while other processes were writing). Read-only,
    a missing table is an older ucm-db's store (format 2 had no heads)."""
    for _ in range(16):
        try:
            return {name: env.open_db(name.encode(), create=create) for name in TABLES}
        except lmdb.MapResizedError:
            env.set_mapsize(0)
        except lmdb.NotFoundError as exc:
            if not _has_table(env, INFO):  # every ucm-db store has its info table: a creating open stopped early
                raise TierError(never_initialised(path.parent), hint=NEVER_INITIALISED_HINT) from exc
            raise FormatVersionError(f"LMDB store at {path} lacks a table this ucm-db reads: an older ucm-db wrote it",
                                     hint=f"run `ucm-db migrate {path.parent}` (on a writable copy if read-only)") from exc
        except lmdb.Error as exc:
            raise lmdb_error("Opening the tables of LMDB store", path, exc) from exc
    raise TierError(f"LMDB map of {path} keeps being resized by another process")


def _has_table(env: lmdb.Environment, name: str) -> bool:
    try:
        env.open_db(name.encode(), create=False)
    except lmdb.NotFoundError:
        return False
    return True
