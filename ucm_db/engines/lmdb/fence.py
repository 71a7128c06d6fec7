"""The LMDB versions this package's page-level code was proven on, checked at open.

:mod:`~ucm_db.engines.lmdb.meta`, :mod:`~ucm_db.engines.lmdb.pages` and
:mod:`~ucm_db.engines.lmdb.groupsync` read and rewrite LMDB's own meta and
data pages by hand (the rollback after an OS crash writes a recorded meta
page over both of the file's). That code is correct for one on-disk layout,
and its crash tests (the power-cut simulator, tests/reliability) ran on one
library: py-lmdb 3.0.x bundling LMDB 0.9.36, whose data files carry the
magic ``0xBEEFC0DE`` and data version 1. pyproject.toml bounds ``lmdb`` to
those releases.

Invariants:
    * :func:`check_proven` runs first at every engine open, before the
      OS-crash check, the rollback or LMDB's own open: a store is never
      rolled back, rewritten or mapped by an unproven library, nor is a data
      file whose meta page names an unproven data version.
    * The library check has an escape hatch (:data:`UNPROVEN_LIBRARY_ENV`
      ``=1``, for a py-lmdb built against a system LMDB of the same data
      format); the on-disk format check has none: no code here knows how to
      roll back a page layout it was not written for.
    * Reading the meta pages' magic and version costs two ``pread`` calls
      and maps nothing. A file too short or without LMDB's magic is left to
      :func:`~ucm_db.engines.lmdb.checks.check_data_file`, which names damage.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import lmdb

from ucm_db.errors import FormatVersionError, TierError
from ucm_db.engines.lmdb.meta import MAGIC, PAGE_HEADER_BYTES

#: (major, minor, patch) of the LMDB libraries the page-level code was proven on.
PROVEN_LIBRARY_VERSIONS: frozenset[tuple[int, int, int]] = frozenset({(0, 9, 36)})
#: LMDB on-disk data versions (``MDB_DATA_VERSION`` in a meta page) proven.
PROVEN_DATA_VERSIONS: frozenset[int] = frozenset({1})
#: The dependency bound in pyproject.toml that installs a proven library.
LMDB_REQUIREMENT = "lmdb>=3.0,<3.1"
#: ``=1`` opens stores with an unproven LMDB library (never an unproven data file).
UNPROVEN_LIBRARY_ENV = "UCM_DB_ALLOW_UNPROVEN_LMDB"

logger = logging.getLogger("ucm_db")
_HEAD = struct.Struct("<II")  # magic, data version: the start of MDB_meta
_warned = False


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def proven_library_text() -> str:
    return ", ".join(_dotted(v) for v in sorted(PROVEN_LIBRARY_VERSIONS))


def check_library(env_dir: Path) -> None:
    """Raises :class:`TierError` unless ``lmdb.version()`` is a proven LMDB
    (or :data:`UNPROVEN_LIBRARY_ENV` is ``1``, which logs a warning once)."""
    global _warned
    found = tuple(lmdb.version()[:3])
    if found in PROVEN_LIBRARY_VERSIONS:
        return
    text = (f"py-lmdb {getattr(lmdb, '__version__', '?')} runs LMDB {_dotted(found)}; ucm-db's LMDB page code "
            f"(OS-crash rollback, file checks) was proven on LMDB {proven_library_text()} only")
    if os.environ.get(UNPROVEN_LIBRARY_ENV) == "1":
        if not _warned:
            _warned = True
            logger.warning("ucm-db: %s; opening anyway (%s=1)", text, UNPROVEN_LIBRARY_ENV)
        return
    raise TierError(
        f"LMDB store {env_dir} not opened: {text}",
        hint=f"install the proven library: pip install '{LMDB_REQUIREMENT}' (or set {UNPROVEN_LIBRARY_ENV}=1 "
        "to run an unproven one at your own risk)",
    )


def data_versions(data_path: Path) -> list[int]:
    """The data versions named by the meta pages of ``data_path`` that carry
    LMDB's magic (empty for a missing, empty, short or foreign file)."""
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        versions = []
        first = os.pread(fd, PAGE_HEADER_BYTES + _HEAD.size, 0)
        if len(first) < PAGE_HEADER_BYTES + _HEAD.size:
            return []
        magic, version = _HEAD.unpack_from(first, PAGE_HEADER_BYTES)
        if magic != MAGIC:
            return []
        versions.append(version)
        # Meta page 1 starts one page in; the page size is in page 0's free
        # db record, which an unknown version may have moved: try the sizes
        # LMDB allows and keep every hit with the magic.
        for page_bytes in (4096, 8192, 16384, 32768, 65536, 512, 1024, 2048):
            second = os.pread(fd, PAGE_HEADER_BYTES + _HEAD.size, page_bytes)
            if len(second) == PAGE_HEADER_BYTES + _HEAD.size and struct.unpack_from("<Q", second)[0] == 1:
                magic, version = _HEAD.unpack_from(second, PAGE_HEADER_BYTES)
                if magic == MAGIC:
                    versions.append(version)
                    break
        return versions
    finally:
        os.close(fd)


def check_data_format(env_dir: Path) -> None:
    """Raises :class:`FormatVersionError` if a meta page of the data file
    carries LMDB's magic and a data version not in :data:`PROVEN_DATA_VERSIONS`."""
    data = env_dir / "data.mdb"
    try:
        unknown = sorted({v for v in data_versions(data) if v not in PROVEN_DATA_VERSIONS})
    except OSError:
        return  # unreadable: check_data_file names why
    if unknown:
        raise FormatVersionError(
            f"LMDB store {env_dir} not opened: {data} is LMDB data version {', '.join(map(str, unknown))}; "
            f"ucm-db's LMDB page code was proven on data version {', '.join(map(str, sorted(PROVEN_DATA_VERSIONS)))} "
            f"(LMDB {proven_library_text()}) and neither rolls back nor rewrites another",
            hint=f"open this store with the LMDB that wrote it, or move {env_dir} aside (the store is a cache and "
            "starts empty); nothing was changed",
        )


def check_proven(env_dir: Path) -> None:
    """The fence (module invariants): the library, then the data file."""
    check_library(env_dir)
    check_data_format(env_dir)
