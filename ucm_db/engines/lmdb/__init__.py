"""The LMDB engine and the code that reads and writes LMDB's own pages.

Everything here that touches LMDB's on-disk layout by hand (meta pages,
page walks, the rollback after an OS crash) lives in this package, and is
fenced to the LMDB versions it was proven on (:mod:`.fence`):

    engine      LmdbEngine: the default local tier's engine
    fence       the proven LMDB library and data versions, checked at open
    meta        the two meta pages, read and written with pread/pwrite
    pages       page walks over the free-page and main trees with pread
    checks      a data file's checks at open and ``diagnose`` (ucm-db verify)
    groupsync   group durability: pinned synced snapshots, the rollback
    records     the sync records: one file per process, the old shared one read
    readers     LMDB's reader table, read to name a process pinning old snapshots
    tables      opening the tables, and an environment read-only
    recovery    older versions' unsynced-commit markers, child-process walks
    prefault    mapping the page-cached pages after open
    copy        a table-by-table copy for compaction
    malloc      glibc tuning for LMDB's dirty pages
    commit_ids  the last commit's id, read from a map of the meta pages

Invariant: modules outside this package import only the names below.
"""

from __future__ import annotations

from ucm_db.engines.lmdb.commit_ids import CommitIds, commit_ids_of
from ucm_db.engines.lmdb.copy import copy_leaving, stuck_keys
from ucm_db.engines.lmdb.engine import LmdbEngine
from ucm_db.engines.lmdb.fence import LMDB_REQUIREMENT, PROVEN_DATA_VERSIONS, PROVEN_LIBRARY_VERSIONS
from ucm_db.engines.lmdb.groupsync import clear_rolled_back, drop_record as drop_sync_record, rolled_back
from ucm_db.engines.lmdb.recovery import boot_id

__all__ = ["LMDB_REQUIREMENT", "PROVEN_DATA_VERSIONS", "PROVEN_LIBRARY_VERSIONS", "CommitIds", "LmdbEngine", "boot_id", "clear_rolled_back",
           "commit_ids_of", "copy_leaving", "drop_sync_record", "rolled_back", "stuck_keys"]
