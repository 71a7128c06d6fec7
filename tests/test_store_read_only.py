"""``ucm_db.open(path, read_only=True)``: a store served from a read-only
volume (a real read-only bind mount) writes nothing and refuses writes
with the fix; the options that cannot work read-only are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from readonly_mount import read_only_view, tree

import ucm_db
from ucm_db.storelock import LOCK_FILE, StoreLock

NS = ucm_db.Namespace(model="m", kv_dtype="bfloat16", block_size=16, tp_rank=0, tp_size=1)
TOKENS = list(range(5 * 16 + 3))


def _populate(path: Path) -> tuple[list[bytes], list[bytes]]:
    keys = NS.block_keys(TOKENS)
    payloads = [bytes([i]) * 4096 for i in range(len(keys))]
    with ucm_db.open(path, capacity_bytes=1 << 24, codec="zstd") as store:
        store.put(NS, keys, payloads)
    return list(keys), payloads


def test_a_store_on_a_read_only_volume_is_served_read_only_and_left_untouched(tmp_path: Path) -> None:
    keys, payloads = _populate(tmp_path / "src" / "store")
    before = tree(tmp_path / "src")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        with pytest.raises(ucm_db.TierError) as refused:  # what a writable open meets there, and the way out
            ucm_db.open(ro / "store")
        assert "read-only" in str(refused.value) and "read_only=True" in refused.value.hint
        with ucm_db.open(ro / "store", read_only=True) as store:
            assert store.config.read_only and store.config.codec == "zstd"  # persisted settings adopted
            assert store.lookup(NS, keys) == len(keys)
            assert [bytes(b) for b in store.get(NS, keys)] == payloads  # type: ignore[arg-type]
            buffers = [bytearray(4096) for _ in keys]
            assert store.get_into(NS, keys, buffers) == [True] * len(keys) and buffers == payloads
            stats = store.stats()
            assert stats.blocks == len(keys) and stats.hits == 2 * len(keys)  # counted in memory
            with pytest.raises(ucm_db.TierError, match="open read-only") as put:
                store.put(NS, keys, payloads)
            assert "read_only" in put.value.hint
            with pytest.raises(ucm_db.TierError, match="open read-only"):
                store.delete(NS, keys[:1])
            store.flush()  # nothing to make durable, and no error
    assert tree(tmp_path / "src") == before


def test_without_lock_files_a_read_only_open_creates_none(tmp_path: Path) -> None:
    keys, _ = _populate(tmp_path / "src" / "store")
    (tmp_path / "src" / "store" / LOCK_FILE).unlink()
    (tmp_path / "src" / "store" / "lmdb" / "lock.mdb").unlink()  # LMDB then runs without its lock file
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        with ucm_db.open(ro / "store", read_only=True) as store:
            assert store.lookup(NS, keys) == len(keys)
    assert not (tmp_path / "src" / "store" / LOCK_FILE).exists()
    assert not (tmp_path / "src" / "store" / "lmdb" / "lock.mdb").exists()


def test_a_read_only_holder_still_keeps_compaction_out(tmp_path: Path) -> None:
    _populate(tmp_path / "src" / "store")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        with ucm_db.open(ro / "store", read_only=True):
            with StoreLock(tmp_path / "src" / "store") as maintenance:  # compact/migrate on the writable side
                assert not maintenance.try_exclusive()
        with StoreLock(tmp_path / "src" / "store") as maintenance:
            assert maintenance.try_exclusive()


def test_a_corrupt_block_reads_as_a_miss_without_a_quarantine_write(tmp_path: Path) -> None:
    keys, payloads = _populate(tmp_path / "src" / "store")
    with ucm_db.open(tmp_path / "src" / "store") as store:  # damage one stored body in place
        def flip(txn: object) -> None:
            body = bytearray(txn.get("blocks", keys[2]))  # type: ignore[attr-defined]
            body[-1] ^= 0xFF
            txn.put("blocks", keys[2], bytes(body))  # type: ignore[attr-defined]
        store._tier.engine.write(flip)
    before = tree(tmp_path / "src")
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        with ucm_db.open(ro / "store", read_only=True) as store:
            got = store.get(NS, keys)
            assert got[2] is None and [bytes(b) for b in got[:2]] == payloads[:2]  # type: ignore[arg-type]
    assert tree(tmp_path / "src") == before


def test_a_read_only_open_never_creates_a_store(tmp_path: Path) -> None:
    with pytest.raises(ucm_db.TierError, match="no ucm-db store") as info:
        ucm_db.open(tmp_path / "nothing", read_only=True)
    assert "never creates" in info.value.hint
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize(("options", "words"), [
    ({"read_only": "yes"}, "true or false"),
    ({"read_only": True, "engine": "memory"}, "memory engine"),
    ({"read_only": True, "remote": "file:///tmp/r"}, "remote"),
])
def test_options_that_cannot_work_read_only_are_refused(tmp_path: Path, options: dict[str, object], words: str) -> None:
    with pytest.raises(ucm_db.ConfigError, match=words):
        ucm_db.open(tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()

