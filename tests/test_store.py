"""The public Store API on a real LMDB store."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db import ClosedError, ConfigError, MissingAncestorError, Namespace

NS = Namespace(model="tiny", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="other", kv_dtype="bfloat16", block_size=4)


def payloads(n: int, size: int = 4096, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes() for _ in range(n)]


@pytest.fixture(params=["zstd", "none"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ucm_db.Store:
    with ucm_db.open(tmp_path / "store", codec=request.param, capacity_bytes=64 << 20) as s:
        yield s


def test_put_get_lookup_round_trip(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(40)))
    data = payloads(len(keys))
    result = store.put(NS, keys, data)
    assert result.stored == 10
    assert store.lookup(NS, keys) == 10
    assert [bytes(x) for x in store.get(NS, keys)] == data
    more = NS.block_keys(list(range(48)))
    assert store.lookup(NS, more) == 10
    assert store.get(NS, more[10:]) == [None, None]


def test_chain_suffix_needs_its_parent(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(32)))
    data = payloads(8)
    with pytest.raises(MissingAncestorError, match="not stored"):
        store.put(NS, keys[4:], data[4:], parent=keys[3])
    assert store.lookup(NS, keys) == 0
    store.put(NS, keys[:4], data[:4])
    assert store.put(NS, keys[4:], data[4:], parent=keys[3]).stored == 4
    assert store.lookup(NS, keys) == 8


def test_reput_of_shared_prefix_stores_only_new_blocks(store: ucm_db.Store) -> None:
    tokens = list(range(64))
    keys = NS.block_keys(tokens)
    store.put(NS, keys[:10], payloads(10))
    result = store.put(NS, keys, payloads(16))
    assert (result.stored, result.already_present) == (6, 10)


def test_frames_are_concatenated_on_get(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(4)))
    frames = payloads(3, size=512)
    store.put(NS, keys, [frames])
    assert bytes(store.get(NS, keys)[0]) == b"".join(frames)


def test_numpy_payload_is_one_buffer_not_frames(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(8)))
    arrays = [np.arange(5000, dtype=np.uint16) + i for i in range(2)]
    store.put(NS, keys, arrays)
    assert [bytes(x) for x in store.get(NS, keys)] == [a.tobytes() for a in arrays]


def test_get_into_reports_corrupt_block_in_a_batch(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(16)))
    store.put(NS, keys, payloads(4))
    store._tier.engine.write(lambda txn: txn.put("blocks", keys[2], b"garbage"))
    buffers = [bytearray(4096) for _ in keys]
    # Block 3 was verified in the same read; the quarantine then takes it too.
    assert store.get_into(NS, keys, buffers) == [True, True, False, True]
    assert store.stats().quarantined == 1
    assert store.lookup(NS, keys) == 2


def test_get_into_caller_buffers(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(12)))
    data = payloads(3)
    store.put(NS, keys, data)
    buffers = [np.zeros(4096, dtype=np.uint8) for _ in range(4)]
    more = keys + NS.block_keys(list(range(16)))[3:]
    assert store.get_into(NS, more, buffers) == [True, True, True, False]
    assert [b.tobytes() for b in buffers[:3]] == data


def test_delete_takes_descendants(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(40)))
    store.put(NS, keys, payloads(10))
    assert store.delete(NS, [keys[6]]) == 4
    assert store.lookup(NS, keys) == 6


def test_stats_count_blocks_bytes_namespaces_hits(store: ucm_db.Store) -> None:
    a, b = NS.block_keys(list(range(20))), OTHER.block_keys(list(range(8)))
    store.put(NS, a, payloads(5))
    store.put(OTHER, b, payloads(2))
    store.get(NS, a + NS.block_keys(list(range(24)))[5:])
    stats = store.stats()
    assert stats.blocks == 7
    assert stats.raw_bytes == 7 * 4096
    assert (stats.hits, stats.misses) == (5, 1)
    by_model = {ns.description["model"]: ns.blocks for ns in stats.namespaces.values()}
    assert by_model == {"tiny": 5, "other": 2}
    ratio = stats.to_dict()["compression_ratio"]
    assert ratio > 1.1 if store.config.codec == "zstd" else 0.95 < ratio <= 1.0
    store.flush()
    assert store.stats().hits == 5  # flushed counters are not double counted


def test_corrupt_block_reads_as_none_and_is_quarantined(store: ucm_db.Store) -> None:
    keys = NS.block_keys(list(range(16)))
    store.put(NS, keys, payloads(4))

    def damage(txn: object) -> None:
        blob = bytearray(txn.get("blocks", keys[1]))  # type: ignore[attr-defined]
        blob[-1] ^= 0x40
        txn.put("blocks", keys[1], bytes(blob))  # type: ignore[attr-defined]

    store._tier.engine.write(damage)
    got = store.get(NS, keys)
    assert got[0] is not None and got[1] is None
    assert store.lookup(NS, keys) == 1  # quarantined with its descendants
    assert store.stats().quarantined == 1
    assert store._tier.check() == []


def test_reopen_uses_creation_settings_and_rejects_conflicts(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=32 << 20, durability="sync"):
        pass
    with ucm_db.open(path) as again:
        assert (again.config.codec, again.config.capacity_bytes, again.config.durability) == ("none", 32 << 20, "sync")
    with pytest.raises(ConfigError, match="conflicts") as info:
        ucm_db.open(path, codec="zstd")
    assert "omit codec" in info.value.hint


def test_a_conflicting_durability_is_refused_before_an_engine_of_its_kind_writes(tmp_path: Path) -> None:
    """A ``sync`` store opened with ``durability="group"`` is refused; the
    refused open wrote a group engine's sync record first, so every later
    sync commit kept a record whose failure to move could roll acknowledged
    puts back after an OS crash."""
    path = tmp_path / "s"
    ucm_db.open(path, durability="sync").close()
    with pytest.raises(ConfigError, match="durability='group' conflicts"):
        ucm_db.open(path, durability="group")
    assert not list((path / "lmdb").glob("synced-snapshot*"))
    with ucm_db.open(path, durability="sync") as store:  # naming the recorded one still opens it
        assert store.config.durability == "sync"
        store.put(NS, NS.block_keys(list(range(4))), payloads(1))
    assert not list((path / "lmdb").glob("synced-snapshot*"))
    group = tmp_path / "g"
    ucm_db.open(group, durability="group").close()
    with ucm_db.open(group, durability="group") as store:  # the recorded group: a group engine after the first
        assert store._tier.engine._sync is False
        store.put(NS, NS.block_keys(list(range(4))), payloads(1))


def test_unknown_and_invalid_options_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        ucm_db.open(tmp_path / "s", capcity_bytes=1)
    assert "capacity_bytes" in info.value.hint
    with pytest.raises(ConfigError, match="durability must be one of"):
        ucm_db.open(tmp_path / "s", durability="maybe")
    assert not (tmp_path / "s").exists()  # nothing created on bad input


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_files_are_private(tmp_path: Path, engine: str) -> None:
    """README: "ucm-db creates it 0700" (the store directory), whatever the engine."""
    with ucm_db.open(tmp_path / "s", codec="none", engine=engine) as s:
        s.put(NS, NS.block_keys(list(range(4))), payloads(1))
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "s" / engine).stat().st_mode & 0o777 == 0o700
    if engine == "lmdb":
        assert (tmp_path / "s" / "lmdb" / "data.mdb").stat().st_mode & 0o777 == 0o600


def test_closed_store_raises(tmp_path: Path) -> None:
    s = ucm_db.open(tmp_path / "s")
    s.close()
    with pytest.raises(ClosedError):
        s.lookup(NS, [])


def test_eviction_keeps_store_under_capacity(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 20) as s:
        for i in range(20):
            keys = NS.block_keys(list(range(i * 1000, i * 1000 + 16)))
            s.put(NS, keys, payloads(4, size=32 * 1024, seed=i))
        stats = s.stats()
        assert stats.stored_bytes <= 1 << 20
        assert stats.evictions > 0
        assert s._tier.check() == []
        assert s.lookup(NS, keys) == 4  # the newest chain survives


def test_threads_share_one_store(store: ucm_db.Store) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(20):
                keys = NS.block_keys([t, i] * 8)
                data = payloads(len(keys), seed=t * 100 + i)
                store.put(NS, keys, data)
                assert [bytes(x) for x in store.get(NS, keys)] == data
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert store._tier.check() == []


def test_memory_engine_behaves_like_lmdb(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "m", engine="memory") as s:
        keys = NS.block_keys(list(range(8)))
        s.put(NS, keys, payloads(2))
        assert s.lookup(NS, keys) == 2


@pytest.mark.multiprocess
def test_store_reopens_itself_after_fork(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none") as s:
        keys = NS.block_keys(list(range(8)))
        s.put(NS, keys, payloads(2))
        pid = os.fork()
        if pid == 0:  # child: use the inherited Store object
            try:
                ok = s.lookup(NS, keys) == 2
                s.put(NS, NS.block_keys(list(range(100, 108))), payloads(2))
                os._exit(0 if ok else 3)
            except BaseException:  # noqa: BLE001
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert s.lookup(NS, NS.block_keys(list(range(100, 108)))) == 2


def test_group_commits_start_the_sync_after_sync_bytes(tmp_path: Path) -> None:
    """With a long interval, only the byte trigger can sync this soon; a
    store under the threshold keeps its bytes unsynced until the interval."""
    with ucm_db.open(tmp_path / "s", codec="none", durability="group", sync_interval_s=3600, sync_bytes=1 << 20) as store:
        keys = NS.block_keys(list(range(16)))
        store.put(NS, keys[:1], [bytes(64 << 10)])
        assert store._activity.unsynced_bytes > 0  # under the threshold: no wake-up
        store.put(NS, keys[1:], [bytes(1 << 20)] * 3)
        deadline = time.monotonic() + 10
        while store._activity.unsynced_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._activity.unsynced_bytes == 0
        assert store.get(NS, keys) == [bytearray(64 << 10)] + [bytearray(1 << 20)] * 3


def test_encoded_body_of_an_uncompressed_put_is_the_callers_buffer(tmp_path: Path) -> None:
    """Codec none hands the payload to the engine as is: the stored body is
    the payload's bytes and the head is kept apart."""
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        keys = NS.block_keys(list(range(4)))
        payload = np.arange(512, dtype=np.uint16).tobytes()
        store.put(NS, keys, [payload])
        body = store._tier.engine.read(lambda txn: bytes(txn.get("blocks", keys[0])))
        head = store._tier.engine.read(lambda txn: bytes(txn.get("heads", keys[0])))
        assert body == payload and head[:4] == b"UCMB"
