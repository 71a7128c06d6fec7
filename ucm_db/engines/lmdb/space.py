"""Page accounting of an LMDB environment: the used extent and the free
list; and whether the map can grow.

Invariants:
    * Everything here reads; nothing changes the environment.
    * A map growth is tried only where a mapping of the new size fits in
      this process's address space now (:func:`check_map_growth`): py-lmdb
      closes the environment for good when ``set_mapsize`` cannot map the
      new size, and every later read and write of the process failed, also
      once the limit was lifted (RLIMIT_AS in a child: ``put`` raised
      lmdb.MemoryError, then every ``get`` a TierError, "Attempt to operate
      on closed/deleted/dropped object"). That holds for adopting another
      process's growth too (``set_mapsize(0)`` on MDB_MAP_RESIZED: LMDB maps
      the current meta page's map size, at least the used extent):
      :func:`check_adopted_growth` checks that size first, so a failure is a
      TierError for that call only, and a later call adopts the growth once
      the limit allows it.
    * The caller reads the page size once per environment (LMDB fixes it at
      creation) and passes it in.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ucm_db.errors import TierError
from ucm_db.engines.lmdb.checks import DATA_FILE, lmdb_error
from ucm_db.engines.lmdb.meta import read_meta_pages
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


def check_map_growth(env_dir: Path, size_bytes: int, mapped_bytes: int, max_bytes: int) -> None:
    """Raises :class:`TierError` unless the map, ``mapped_bytes`` now, may
    grow to ``size_bytes``: at most ``max_bytes``, and within this process's
    address space (module invariants): a mapping of the growth, inaccessible
    (so no memory is committed), is made and dropped at once (LMDB unmaps
    the old map before it maps the new one: the growth is what must fit)."""
    if size_bytes > max_bytes:
        raise TierError(f"LMDB map of {env_dir} cannot grow past {mapped_bytes} bytes")
    try:
        mmap.mmap(-1, max(size_bytes - mapped_bytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0).close()
    except (OSError, OverflowError) as exc:
        raise TierError(f"the LMDB map of {env_dir} cannot grow to {size_bytes} bytes: {exc} (the address space "
                        "limit, RLIMIT_AS / ulimit -v, or the address space is used up)",
                        hint="raise the process's address space limit (ulimit -v), or set a smaller capacity_bytes; "
                             "writes resume once the map can grow") from exc


def adopted_map_bytes(env_dir: Path, env: lmdb.Environment) -> int:
    """The map size ``set_mapsize(0)`` will map: the current meta page's map
    size (another process's growth), at least the used extent, at least the
    data file (where the meta pages cannot be read: the file alone)."""
    data = env_dir / DATA_FILE
    try:
        pages, _problems = read_meta_pages(data)
        file_bytes = data.stat().st_size
    except OSError:
        pages, file_bytes = [], 0
    meta_bytes = max(pages, key=lambda meta: meta.txnid).map_size_bytes if pages else 0
    info = env.info()
    return max(meta_bytes, file_bytes, (int(info["last_pgno"]) + 1) * page_bytes(env))


def check_adopted_growth(env_dir: Path, env: lmdb.Environment) -> None:
    """Raises :class:`TierError` unless adopting another process's map
    growth (``set_mapsize(0)``) fits in this process's address space (module
    invariants). No size cap: the map another process made must be adopted
    to read the store at all."""
    mapped_bytes = int(env.info()["map_size"])
    size_bytes = adopted_map_bytes(env_dir, env)
    if size_bytes > mapped_bytes:
        check_map_growth(env_dir, size_bytes, mapped_bytes, size_bytes)
