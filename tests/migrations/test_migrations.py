"""Format migrations: checked-in fixture stores of older formats migrate to
the current one with every block intact; failures leave the store as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ucm_db
from ucm_db import codec, migrations
from ucm_db.errors import FormatVersionError, LockedError, MigrationError
from ucm_db.migrations import Migration
from ucm_db.format import write_format_version
from ucm_db.store import CREATED_KEY, STORE_FORMAT_VERSION

from fixture_stores import NAMESPACES, expected_blocks

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "stores"


def fixture_copy(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def assert_fixture_contents(store: ucm_db.Store) -> None:
    expected = expected_blocks()
    assert store.stats().blocks == len(expected)
    for key, (ns_name, payload) in expected.items():
        assert store.get(NAMESPACES[ns_name], [key]) == [bytearray(payload)]
    assert store._tier.check() == []


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
@pytest.mark.parametrize("old_format", [1, 2])
def test_old_fixture_is_refused_then_migrated(tmp_path: Path, engine: str, old_format: int) -> None:
    path = fixture_copy(tmp_path, f"format{old_format}-{engine}")
    with pytest.raises(FormatVersionError) as info:
        ucm_db.open(path)
    assert f"ucm-db migrate {path}" in info.value.hint

    assert [m.version for m in migrations.pending(path)] == list(range(old_format + 1, STORE_FORMAT_VERSION + 1))
    assert migrations.applied(path) == []
    done = migrations.migrate(path)
    assert [m.version for m in done] == list(range(old_format + 1, STORE_FORMAT_VERSION + 1))
    assert migrations.pending(path) == []
    assert [(a.version, a.name) for a in migrations.applied(path)] == [(m.version, m.name) for m in done]
    assert migrations.migrate(path) == []  # idempotent

    with ucm_db.open(path) as store:
        assert store.config.engine == engine
        assert_fixture_contents(store)
        created = json.loads(store._tier.info_get(CREATED_KEY) or b"{}")
        assert created["format_version"] == old_format
        assert (created["ucm_db_version"] is None) == (old_format == 1)


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_migrated_blocks_keep_their_joined_values_and_new_puts_split(tmp_path: Path, engine: str) -> None:
    """Format 3 moves heads into their own table without rewriting payloads;
    blocks put afterwards store the body alone; both kinds read back, and a
    damaged joined block is still caught."""
    path = fixture_copy(tmp_path, f"format2-{engine}")
    migrations.migrate(path)
    expected = expected_blocks()
    old_key = next(iter(expected))
    with ucm_db.open(path) as store:
        engine_ = store._tier.engine
        head = bytes(engine_.read(lambda txn: txn.get("heads", old_key)))
        stored = bytes(engine_.read(lambda txn: txn.get("blocks", old_key)))
        assert stored.startswith(head) and len(head) >= codec.HEADER_BYTES
        assert_fixture_contents(store)
        ns = NAMESPACES["llama"]
        keys = ns.block_keys(list(range(3 * ns.block_size)), {"cache_salt": "new"})
        payloads = [bytes([i]) * 512 for i in range(3)]
        store.put(ns, keys, payloads)
        new_head = bytes(engine_.read(lambda txn: txn.get("heads", keys[0])))
        new_stored = bytes(engine_.read(lambda txn: txn.get("blocks", keys[0])))
        assert not new_stored.startswith(new_head) and len(new_head) + len(new_stored) == store._tier.metas(keys[:1])[0].stored_bytes
        assert store.get(ns, keys) == [bytearray(p) for p in payloads]
        # Flip one payload byte of an old (joined) block: a miss, quarantined.
        damaged = bytearray(stored)
        damaged[-1] ^= 1
        engine_.write(lambda txn: txn.put("blocks", old_key, bytes(damaged)))
        ns_name, _payload = expected[old_key]
        assert store.get(NAMESPACES[ns_name], [old_key]) == [None]
        assert store.stats().quarantined >= 1 and store._tier.check() == []


def test_new_store_records_its_creator_and_needs_no_migration(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 20) as store:
        created = json.loads(store._tier.info_get(CREATED_KEY) or b"{}")
    assert created["ucm_db_version"] == ucm_db.__version__
    assert created["format_version"] == STORE_FORMAT_VERSION
    assert migrations.pending(tmp_path / "s") == []


def test_failing_migration_leaves_store_untouched(tmp_path: Path) -> None:
    path = tmp_path / "s"
    ucm_db.open(path, capacity_bytes=1 << 20).close()
    target = STORE_FORMAT_VERSION + 1

    def upgrade(txn: object) -> None:
        txn.put("info", b"half-done", b"x")  # type: ignore[attr-defined]
        raise RuntimeError("disk on fire")

    migrations.register(Migration(target, "test_failing", "fails half-way", upgrade))
    try:
        with pytest.raises(MigrationError, match="disk on fire"):
            migrations.migrate(path, target)
        assert [m.version for m in migrations.pending(path, target)] == [target]
    finally:
        migrations.unregister(target)
    with ucm_db.open(path) as store:  # still the current format
        assert store._tier.info_get(b"half-done") is None
    assert migrations.applied(path) == []


def test_migration_refuses_while_store_is_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 20):
        with pytest.raises(LockedError, match="pid"):
            migrations.migrate(path)


def test_newer_store_is_refused_by_migrate_and_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 20) as store:
        # as newer code writes it: checksummed (a bare changed record would be damage)
        store._tier.engine.write(lambda txn: write_format_version(txn, STORE_FORMAT_VERSION + 5))
    with pytest.raises(FormatVersionError, match="newer"):
        ucm_db.open(path)
    with pytest.raises(MigrationError, match="newer"):
        migrations.migrate(path)


def test_registry_is_contiguous_up_to_the_current_format() -> None:
    versions = [m.version for m in migrations.registered()]
    assert versions == list(range(2, STORE_FORMAT_VERSION + 1))
