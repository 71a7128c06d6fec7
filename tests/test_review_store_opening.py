"""Review of how a store is opened and created (``ucm_db.store.opening``,
``ucm_db.engines.lmdb``'s open path), 2026-12-06: creating an LMDB store on a
real full disk, and a store whose creation stopped half-way.

Each full-disk test mounts a small tmpfs (root only: skipped otherwise),
fills it with a filler file to leave a chosen number of bytes
(``fill_leaving``), and creates a store there in a fresh interpreter, so a
signal kills only that child. Before the fixes, the space left picked the
write that failed, deterministically on a tmpfs (4 KiB pages): with no page
left, LMDB's first touch of its new, mapped lock file (``lock.mdb``): SIGBUS;
with two pages, the data file's two meta pages (one written, the other not:
a store every later open refused as damaged); with four, the commit that
creates the tables (a half-made store, which read-only opens called an
older ucm-db's and sent to ``ucm-db migrate``, which then failed). Now an
open that would create LMDB's files checks the disk's free space first
(``engines/lmdb/checks.py`` ``check_room_to_create``) and writes nothing
where it lacks it, and a half-made store is named never initialised, with
the fix that works (one writable open).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.harness import mounted_tmpfs
from tests.reliability.test_faults import fill_leaving

REPO = Path(__file__).resolve().parents[1]
PAGE_BYTES = 4096

#: One step in a fresh interpreter; prints one JSON line: what happened.
_CHILD = textwrap.dedent("""
    import json, sys
    import ucm_db
    from tests.reliability.harness import NS, chain_tokens, payload_for
    role, path = sys.argv[1], sys.argv[2]
    keys = NS.block_keys(chain_tokens("review-open", 3))
    try:
        if role == "create":
            ucm_db.open(path, durability="sync", capacity_bytes=1 << 20, map_size_bytes=8 << 20).close()
        elif role == "use":
            with ucm_db.open(path) as store:
                store.put(NS, keys, [payload_for(k, 1024) for k in keys])
                assert store.get(NS, keys)[2] == payload_for(keys[2], 1024)
        elif role == "read":
            with ucm_db.open(path, read_only=True) as store:
                store.lookup(NS, keys)
        elif role == "migrate":
            from ucm_db.migrations import migrate
            migrate(path)
        print(json.dumps({"done": role}))
    except ucm_db.UcmDbError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": exc.message,
                          "hint": exc.hint or ""}))
""")


def _step(role: str, store: Path) -> dict[str, Any]:
    """``role`` run on ``store`` in a fresh interpreter: its JSON line, or
    how it died (``{"died": returncode}``) where it printed none."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, role, str(store)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"died": proc.returncode, "stderr": proc.stderr[-600:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_creating_an_lmdb_store_on_a_full_disk_is_a_tier_error_not_a_sigbus(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "mnt", 16) as mount:
        fill_leaving(mount, 0)
        created = _step("create", mount / "store")
    # A vLLM server (or any caller) must get a TierError naming the full disk, not die of a signal.
    assert "died" not in created, f"the creating process was killed: {created}"
    assert created.get("error") == "TierError" and "space" in (created["message"] + created["hint"]), created


def test_an_lmdb_store_whose_creation_ran_out_of_space_opens_once_space_is_freed(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "mnt", 16) as mount:
        store = mount / "store"
        filler = fill_leaving(mount, 2 * PAGE_BYTES)
        created = _step("create", store)
        assert created.get("error") == "TierError", created  # refused: the disk is full (that part is right)
        filler.unlink()
        used = _step("use", store)
    # Nothing was ever acknowledged in this store: once space is back, the open creates it, as after
    # every other creation refused for space, instead of calling it damaged for good.
    assert used == {"done": "use"}, used


def test_a_half_made_lmdb_store_is_not_sent_to_migrate(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "mnt", 16) as mount:
        store = mount / "store"
        filler = fill_leaving(mount, 4 * PAGE_BYTES)
        created = _step("create", store)
        assert created.get("error") == "TierError", created  # the commit creating the tables: no space
        filler.unlink()
        read = _step("read", store)  # e.g. a kv_consumer, or `ucm-db inspect`, after space came back
        migrated = _step("migrate", store)  # what that refusal's hint says to run
    assert read.get("error") is not None, read  # never initialised: refused, rightly
    # The refusal names a fix that works: if it says migrate, migrate must take the store.
    assert "migrate" not in read["hint"] or migrated == {"done": "migrate"}, (read, migrated)


def _read_only_refusal(store: Path) -> Any:
    import ucm_db
    with pytest.raises(ucm_db.UcmDbError) as refused:
        ucm_db.open(store, read_only=True)
    return refused.value


def test_a_half_made_store_is_named_never_initialised_and_one_writable_open_completes_it(tmp_path: Path) -> None:
    """What a creator killed between LMDB's open and its first commit (or
    RocksDB's open and its tables) leaves: the engine's files, none of the
    store's tables. Made here by the bare engines (real files). A read-only
    open names it never initialised with the fix that works (one writable
    open); before, it was "an older ucm-db wrote it" with a migrate hint
    that then failed ("records no format version")."""
    import lmdb
    import rocksdict

    import ucm_db
    from tests.reliability.harness import NS, chain_tokens, payload_for

    lmdb_store, rocks_store = tmp_path / "lmdb-store", tmp_path / "rocks-store"
    (lmdb_store / "lmdb").mkdir(parents=True)
    lmdb.open(str(lmdb_store / "lmdb"), subdir=True, max_dbs=16).close()
    (rocks_store / "rocksdb").mkdir(parents=True)
    rocksdict.Rdict(str(rocks_store / "rocksdb"), options=rocksdict.Options(raw_mode=True)).close()
    keys = NS.block_keys(chain_tokens("review-half-made", 2))
    for store, engine in ((lmdb_store, "lmdb"), (rocks_store, "rocksdb")):
        refusal = _read_only_refusal(store)
        assert type(refusal).__name__ == "TierError", (engine, refusal)
        assert "never initialised" in refusal.message and "migrate" not in refusal.hint, (engine, refusal)
        assert "without read_only" in refusal.hint, (engine, refusal)
        with ucm_db.open(store, engine=engine) as opened:  # the fix the hint names
            opened.put(NS, keys, [payload_for(k, 512) for k in keys])
        with ucm_db.open(store, read_only=True) as reader:
            assert reader.lookup(NS, keys) == 2, engine
