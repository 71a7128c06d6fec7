"""Page accounting of an LMDB environment: the used extent and the free list.

Invariants:
    * Everything here reads; nothing changes the environment.
    * The caller reads the page size once per environment (LMDB fixes it at
      creation) and passes it in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ucm_db.engines.lmdb.checks import lmdb_error
from ucm_db.engines.lmdb.txn import LmdbTxn

T = TypeVar("T")

#: LMDB's two meta pages, at the start of every data file.
META_PAGES = 2


def extent_pages(env: lmdb.Environment) -> int:
    """Pages up to the newest snapshot's last page."""
    return int(env.info()["last_pgno"]) + 1


def page_bytes(env: lmdb.Environment) -> int:
    return int(env.stat()["psize"])


def table_stats(txn: LmdbTxn, dbs: dict[str, Any], env: lmdb.Environment) -> tuple[list[Any], int]:
    """Page counts of every table and of the main database, and the extent,
    from one snapshot (run inside a read transaction)."""
    return [txn.stat(table) for table in dbs] + [env.stat()], extent_pages(env)


def free_page_bytes(measured: tuple[list[Any], int], page_size: int) -> int:
    """Bytes of the pages below the used extent that no table holds, from
    :func:`table_stats`' figures."""
    stats, extent = measured
    in_tables = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)
    return max(0, extent - META_PAGES - in_tables) * page_size


def used_extent_bytes(env: lmdb.Environment, page_size: int) -> int:
    return extent_pages(env) * page_size


def read_retried(read: Callable[[], T], adopt_resize: Callable[[], None], env_dir: Path) -> T:
    """``read`` of the environment's figures, the map size adopted and read
    again where another process grew the map meanwhile (``mdb_env_info:
    Invalid argument``); a TierError, never a raw lmdb error, if it persists."""
    for attempt in range(4):
        try:
            return read()
        except lmdb.Error as exc:
            if attempt == 3:
                raise lmdb_error("Reading the figures of", env_dir, exc) from exc
            adopt_resize()
    raise AssertionError("unreachable")
