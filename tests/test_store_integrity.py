"""The store keeps its promises under misuse of the public API (issue 14,
items 1-5, 10 and the store-side cases of 13).

Each test reproduces a case that was wrong on format-3 main: a put that
reported blocks its own eviction removed, a chain suffix accepted as a root,
token ids that wrapped into other ids' keys, a second empty store opened
beside an existing one, namespace arguments that were ignored, an unbounded
sync interval, and raw tracebacks for malformed arguments.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import ucm_db
from ucm_db import BlockKeys, ConfigError, MissingAncestorError, Namespace, StoreFullError, TierError
from ucm_db.format import damaged_format_records

NS = Namespace(model="integrity-test", kv_dtype="bfloat16", block_size=4)
OTHER_NS = Namespace(model="integrity-test-other", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 64 << 10


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


def chain(n: int, seed: int = 0, ns: Namespace = NS) -> BlockKeys:
    return ns.block_keys([seed * 100_000 + t for t in range(4 * n)])


def open_store(path, **options):
    options.setdefault("capacity_bytes", 1 << 20)
    options.setdefault("codec", "none")
    return ucm_db.open(path, **options)


# -- item 1: a put never reports blocks its own eviction removed ----------------
def test_extending_a_chain_in_a_full_store_keeps_its_ancestors(tmp_path):
    with open_store(tmp_path / "s") as store:
        keys = chain(14)
        assert store.put(NS, keys[:8], [payload(i) for i in range(8)]).stored == 8
        # Another, more recent chain fills the rest of the capacity.
        other = chain(7, seed=1)
        store.put(NS, other, [payload(i) for i in range(7)])
        # The 8-block chain is now least recently used; extending it must
        # evict the other chain, never the ancestors of the new blocks.
        result = store.put(NS, keys[8:11], [payload(i) for i in range(8, 11)])
        assert result.stored == 3
        assert store.lookup(NS, keys) == 11
        assert all(b is not None for b in store.get(NS, keys[:11]))
        assert store._tier.check() == []


def test_a_batch_that_cannot_fit_beside_its_ancestors_stores_nothing(tmp_path):
    with open_store(tmp_path / "s") as store:
        keys = chain(24)
        store.put(NS, keys[:8], [payload(i) for i in range(8)])
        before = store.stats()
        with pytest.raises(StoreFullError, match="nothing was stored"):
            store.put(NS, keys[8:20], [payload(i) for i in range(8, 20)])
        assert store.lookup(NS, keys) == 8
        after = store.stats()
        assert (after.blocks, after.stored_bytes, after.evictions) == (before.blocks, before.stored_bytes, before.evictions)
        assert store._tier.check() == []


# -- item 2: the prefix invariant can't be broken through the API ---------------
def test_a_slice_of_block_keys_knows_its_parent(tmp_path):
    keys = chain(64)
    assert keys[20:64].parent == keys[19]
    assert keys[:10].parent is None
    with open_store(tmp_path / "s", capacity_bytes=64 << 20) as store:
        with pytest.raises(MissingAncestorError):
            store.put(NS, keys[20:64], [b"x" * 16] * 44)
        assert store.lookup(NS, keys) == 0
        store.put(NS, keys[:20], [b"x" * 16] * 20)
        store.put(NS, keys[20:64], [b"x" * 16] * 44)
        assert store.lookup(NS, keys) == 64


def test_a_plain_key_list_needs_parent(tmp_path):
    keys = list(chain(8))
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match="parent="):
            store.put(NS, keys[4:], [b"x"] * 4)
        store.put(NS, keys[:4], [b"x"] * 4, parent=None)
        store.put(NS, keys[4:], [b"x"] * 4, parent=keys[3])
        assert store.lookup(NS, keys) == 8


def test_parent_contradicting_the_keys_is_refused(tmp_path):
    keys = chain(8)
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match="disagrees"):
            store.put(NS, keys[4:], [b"x"] * 4, parent=keys[0])
        assert store.lookup(NS, keys) == 0


def test_block_keys_survive_pickling():
    import pickle

    keys = chain(6)[2:]
    copy = pickle.loads(pickle.dumps(keys))
    assert isinstance(copy, BlockKeys) and list(copy) == list(keys) and copy.parent == keys.parent


# -- item 3: token ids never wrap ------------------------------------------------
@pytest.mark.parametrize("bad", [2**32 + 5, -1, 2**40])
def test_out_of_range_numpy_token_ids_are_refused_like_list_ones(bad):
    tokens = [5, 6, 7, bad]
    with pytest.raises(ConfigError, match="token ids"):
        NS.block_keys(tokens)
    for dtype in ("int64", "uint64") if bad >= 0 else ("int64", "int32"):
        if dtype == "int32" and not -(2**31) <= bad < 2**31:
            continue
        with pytest.raises(ConfigError, match="token ids"):
            NS.block_keys(np.array(tokens, dtype=dtype))


def test_in_range_numpy_token_ids_give_the_list_keys():
    tokens = [0, 1, 2**32 - 1, 7] * 3
    expected = NS.block_keys(tokens)
    for dtype in ("int64", "uint64", "uint32"):
        assert list(NS.block_keys(np.array(tokens, dtype=dtype))) == list(expected)


# -- item 4: another engine is an error, not a second store ----------------------
@pytest.mark.parametrize("engine", ["rocksdb", "memory"])
def test_opening_an_lmdb_store_with_another_engine_is_refused(tmp_path, engine):
    path = tmp_path / "s"
    keys = chain(4)
    with open_store(path) as store:
        store.put(NS, keys, [b"x"] * 4)
    with pytest.raises(ConfigError, match="lmdb store"):
        open_store(path, engine=engine)
    assert not (path / "rocksdb").exists()
    with open_store(path) as store:
        assert store.lookup(NS, keys) == 4


# -- item 5: namespaces are checked on every read and delete ---------------------
def test_lookup_get_and_delete_respect_the_namespace(tmp_path):
    keys = chain(16)
    with open_store(tmp_path / "s") as store:
        store.put(NS, keys, [b"k%d" % i for i in range(16)])
        assert store.lookup(OTHER_NS, keys) == 0
        assert store.get(OTHER_NS, keys[:3]) == [None] * 3
        assert store.get_into(OTHER_NS, keys[:1], [bytearray(2)]) == [False]
        assert store.delete(OTHER_NS, keys) == 0
        assert store.lookup(NS, keys) == 16
        assert store.get(NS, keys[:1]) == [bytearray(b"k0")]
        assert store.delete(NS, keys[8:]) == 8
        assert store.lookup(NS, keys) == 8


# -- item 10: the sync interval is bounded; a dead maintenance thread is loud -----
@pytest.mark.parametrize("value", [1e12, float("inf"), float("nan"), 0, -1])
def test_sync_interval_is_bounded(tmp_path, value):
    with pytest.raises(ConfigError, match="sync_interval_s"):
        open_store(tmp_path / "s", sync_interval_s=value)


def test_a_dead_maintenance_thread_refuses_puts(tmp_path, caplog):
    """The thread's death is forced (a fault we cannot produce otherwise):
    its engine sync raises a BaseException the round does not catch."""
    keys = chain(4)
    with open_store(tmp_path / "s", durability="group", sync_interval_s=0.05) as store:
        store.put(NS, keys[:2], [b"x"] * 2)
        real_sync = store._engine.sync_round
        died = threading.Event()

        def dying_sync() -> None:
            died.set()
            raise SystemExit("sync thread killed for the test")

        store._engine.sync_round = dying_sync  # type: ignore[method-assign]
        assert died.wait(10)
        # The thread records its death after the sync raised: wait for that.
        deadline = time.monotonic() + 10
        while store.stats().maintenance_errors < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        store._engine.sync_round = real_sync  # type: ignore[method-assign]
        assert store.stats().maintenance_errors >= 1
        with pytest.raises(TierError, match="maintenance thread"):
            store.put(NS, keys[2:], [b"y"] * 2)
        assert store.lookup(NS, keys) == 2
    assert "maintenance thread died" in caplog.text


def test_a_reopen_after_the_maintenance_thread_died_takes_puts_again(tmp_path):
    """docs/configuration.md: puts are refused "until the store is reopened".
    The death is forced as above; the close then stops the (dead) thread,
    flushes and syncs with the real sync, and returns without raising."""
    keys = chain(4)
    store = open_store(tmp_path / "s", durability="group", sync_interval_s=0.05)
    store.put(NS, keys[:2], [payload(0), payload(1)])
    real_sync = store._engine.sync_round

    def dying_sync() -> None:
        raise SystemExit("sync thread killed for the test")

    store._engine.sync_round = dying_sync  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while store.stats().maintenance_errors < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    store._engine.sync_round = real_sync  # type: ignore[method-assign]
    with pytest.raises(TierError, match="maintenance thread"):
        store.put(NS, keys[2:], [payload(2), payload(3)])
    store.close()  # does not raise: the dead thread's stop is a join of a finished thread

    with open_store(tmp_path / "s", durability="group", sync_interval_s=0.05) as reopened:
        reopened.put(NS, keys[2:], [payload(2), payload(3)])
        assert reopened.lookup(NS, keys) == 4
        assert reopened.get(NS, keys) == [bytearray(payload(i)) for i in range(4)]
        assert reopened.stats().maintenance_errors == 0


def test_a_failing_sync_round_is_logged_and_counted(tmp_path, caplog):
    """A sync that raises OSError (forced, as a disk error can't be made on
    demand here) is logged and counted; the thread lives on."""
    with open_store(tmp_path / "s", durability="group", sync_interval_s=0.05) as store:
        real_sync = store._engine.sync_round
        calls = []

        def failing_sync() -> None:
            calls.append(1)
            raise OSError(5, "Input/output error")

        store._engine.sync_round = failing_sync  # type: ignore[method-assign]
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        store._engine.sync_round = real_sync  # type: ignore[method-assign]
        assert store.stats().maintenance_errors >= 2
        store.put(NS, chain(1), [b"x"])  # the thread is alive: puts go on
    assert "background sync/flush failed" in caplog.text


# -- item 13 (store side): clear errors for malformed arguments ------------------
@pytest.mark.parametrize(
    "bad_payload, match",
    [
        ("text", "bytes-like"),
        (None, "bytes-like"),
        ({"a": 1}, "bytes-like"),
        (np.zeros((4, 4), dtype=np.float16)[:, ::2], "C-contiguous"),
        (np.array([object(), object()], dtype=object), "dtype=object"),
    ],
)
def test_malformed_payloads_are_refused_and_nothing_is_stored(tmp_path, bad_payload, match):
    keys = chain(2)
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match=match):
            store.put(NS, keys, [b"ok", bad_payload])
        with pytest.raises(ConfigError, match=match):
            store.put(NS, keys[:1], [[b"layer0", bad_payload]])
        assert store.lookup(NS, keys) == 0


def test_bytearray_keys_work_like_bytes(tmp_path):
    keys = chain(3)
    as_bytearrays = [bytearray(k) for k in keys]
    with open_store(tmp_path / "s") as store:
        store.put(NS, as_bytearrays, [b"a", b"b", b"c"], parent=None)
        assert store.get(NS, as_bytearrays) == [bytearray(b"a"), bytearray(b"b"), bytearray(b"c")]
        assert store.get(NS, [memoryview(k) for k in keys])[0] == bytearray(b"a")


@pytest.mark.parametrize("bad_parent", ["ab" * 16, 12, b"short"])
def test_a_malformed_parent_is_refused(tmp_path, bad_parent):
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match="parent must be"):
            store.put(NS, list(chain(1)), [b"x"], parent=bad_parent)


def test_get_of_a_generator_reads_it(tmp_path):
    keys = chain(3)
    with open_store(tmp_path / "s") as store:
        store.put(NS, keys, [b"a", b"b", b"c"])
        assert store.get(NS, (k for k in keys)) == [bytearray(b"a"), bytearray(b"b"), bytearray(b"c")]
        assert store.lookup(NS, iter(keys)) == 3
        with pytest.raises(ConfigError, match="sequence of block keys"):
            store.get(NS, keys[0])


def test_get_into_a_too_small_buffer_is_a_clear_miss_or_error(tmp_path):
    keys = chain(1)
    with open_store(tmp_path / "s") as store:
        store.put(NS, keys, [b"0123456789"])
        with pytest.raises(ConfigError, match="buffer"):
            store.get_into(NS, keys, [bytearray(4)])
        with pytest.raises(ConfigError, match="writable"):
            store.get_into(NS, keys, [b"0" * 10])
        for view in (memoryview(b"0" * 10), memoryview(bytearray(20))[::2]):  # a slab view: read-only, strided
            with pytest.raises(ConfigError, match="writable"):
                store.get_into(NS, keys, [[memoryview(bytearray(5)), view]])
        buffer = bytearray(10)
        assert store.get_into(NS, keys, [buffer]) == [True] and buffer == b"0123456789"


def test_a_yaml_config_with_a_non_string_key_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("capacity_bytes: 1000000\n12: 3\n")
    with pytest.raises(ConfigError, match="not strings"):
        ucm_db.load_config_file(path)


# -- item 9: metadata records are checksummed; damage is reported and repaired ----
def _flip_record(store, name: bytes, bit: int = 40) -> None:
    """Flips one bit of ``info/<name>`` in the real LMDB file, as a bad
    sector or a stray write would."""
    def run(txn):
        value = bytearray(txn.get("info", name))
        value[bit // 8] ^= 1 << (bit % 8)
        txn.put("info", name, bytes(value))
    store._tier.engine.write(run)


def test_a_flipped_bit_in_the_totals_does_not_wedge_puts(tmp_path):
    keys = chain(12)
    with open_store(tmp_path / "s") as store:
        store.put(NS, keys[:4], [payload(i) for i in range(4)])
        _flip_record(store, b"totals", bit=8 * 16 + 46)  # stored_bytes += 2**46
        assert [name for name, _ in store._tier.damaged_records()] == ["totals"]
        assert store.stats().stored_bytes < 1 << 20  # recounted from the metadata, not the flipped 2**46
        result = store.put(NS, keys[4:8], [payload(i) for i in range(4, 8)])  # no StoreFullError for 2**46 bytes
        assert result.stored == 4
        assert store._tier.damaged_records() == []  # the put's recount rewrote it
        assert store._tier.check() == []
        stats = store.stats()
        assert stats.blocks == 8 and stats.stored_bytes < 1 << 20


def test_damaged_namespace_counters_are_recounted_and_repaired(tmp_path):
    keys = chain(4)
    with open_store(tmp_path / "s") as store:
        store.put(NS, keys, [payload(i) for i in range(4)])
        ns_id = NS.digest[:16]
        _flip_record(store, b"nscount:" + ns_id, bit=3)
        assert store._tier.damaged_records() and store._tier.check()
        assert store.stats().namespaces[ns_id.hex()].blocks == 4
        store._tier.recompute_totals()
        assert store._tier.damaged_records() == [] and store._tier.check() == []


def test_a_garbage_namespace_description_reads_as_damaged(tmp_path):
    with open_store(tmp_path / "s") as store:
        store.put(NS, chain(1), [b"x"])
        store._tier.engine.write(lambda txn: txn.put("info", b"nsdesc:" + NS.digest[:16], b"{not json"))
        description = store.stats().namespaces[NS.digest[:16].hex()].description
        assert "damaged" in description
        assert any(name.startswith("nsdesc:") for name, _ in store._tier.damaged_records())


@pytest.mark.parametrize("record, garbage", [(b"settings", b"\xff{"), (b"settings", b"[1, 2]"), (b"format_version", b"3\x00x")])
def test_a_garbage_settings_or_version_record_is_a_clear_error(tmp_path, record, garbage):
    """Every damaged info record is the one DamagedRecordError (a TierError)."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put(NS, chain(1), [b"x"])
        store._tier.engine.write(lambda txn: txn.put("info", record, garbage))
        assert any(name == record.decode() for name, _ in store._tier.engine.read(damaged_format_records))
    with pytest.raises(ucm_db.DamagedRecordError, match="damaged") as info:
        open_store(path)
    assert isinstance(info.value, TierError) and info.value.hint


def test_a_settings_record_altered_into_other_valid_settings_is_refused(tmp_path):
    """A flipped digit in capacity_bytes is still valid JSON; adopted, it
    would evict most of the store. Its checksum catches it: the store does
    not open, the index check names the record, nothing is evicted."""
    import json

    path = tmp_path / "s"
    with open_store(path, capacity_bytes=8 << 30) as store:
        store.put(NS, chain(2), [b"x", b"y"])

        def alter(txn):
            settings = json.loads(bytes(txn.get("info", b"settings")))
            settings["capacity_bytes"] = 8 << 20
            txn.put("info", b"settings", json.dumps(settings, sort_keys=True).encode())

        store._tier.engine.write(alter)
        assert ("settings", "checksum mismatch") in store._tier.engine.read(damaged_format_records)
    with pytest.raises(TierError, match="settings record .* is damaged"):
        open_store(path)


def test_records_of_format3_code_are_sealed_on_open(tmp_path):
    """A store whose records have no checksums (as format-3 code wrote
    them) gets them at open, after which a flip is caught."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put(NS, chain(2), [b"x", b"y"])
        store._tier.engine.write(lambda txn: [txn.delete("info", k) for k, _ in list(txn.scan("info", b"sum:"))])
    with open_store(path) as store:
        assert store._tier.engine.read(lambda txn: len(list(txn.scan("info", b"sum:")))) >= 4
        assert store._tier.engine.read(lambda txn: txn.get("info", b"sum:settings")) is not None
        _flip_record(store, b"totals", bit=1)
        assert store._tier.damaged_records()


# -- items 13/14: the store path and close -------------------------------------
def test_a_store_path_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "store"
    path.write_bytes(b"not a store")
    with pytest.raises(TierError, match="is a file") as info:
        ucm_db.open(path)
    assert "choose another store path" in info.value.hint
    assert path.read_bytes() == b"not a store"


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only file system: a tmpfs mounted ``ro`` (needs root, as
    the power-cut tests do)."""
    import subprocess

    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a read-only tmpfs for this test (needs root): {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_new_store_on_a_read_only_file_system_is_a_clear_error(read_only_dir):
    with pytest.raises(TierError) as info:
        ucm_db.open(read_only_dir / "store")
    message = f"{info.value} {info.value.hint}"
    assert "read-only" in message.lower(), message
    assert "Errno" not in str(info.value).split(":")[0]


def test_a_failed_close_still_releases_the_store(tmp_path, monkeypatch):
    # A failing fsync (EIO on a dying disk) cannot be produced on demand;
    # the engine's sync is replaced by one that fails, which is the fault.
    path = tmp_path / "s"
    store = open_store(path)
    keys = chain(2)
    store.put(NS, keys, [payload(0), payload(1)])

    def failing_sync() -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store._engine, "sync", failing_sync)
    with pytest.raises(OSError, match="Input/output"):
        store.close()
    monkeypatch.undo()
    with pytest.raises(ucm_db.ClosedError):
        store.lookup(NS, keys)
    # Released: the same process opens the store again, and compaction (which
    # needs the store's lock exclusively) is not blocked by the closed handle.
    with open_store(path) as again:
        assert again.lookup(NS, keys) == 2
    from ucm_db.storelock import holders

    assert os.getpid() not in holders(path)


def test_a_block_whose_frames_do_not_decode_is_a_miss_and_quarantined(tmp_path):
    """Its checksum holds, so only a decode finds it: a read returns a miss
    and quarantines it (the quarantine's re-check decodes too), and
    ``verify --fix`` quarantines such a block as well."""
    from ucm_db import maintenance
    from undecodable import undecodable_head

    keys = chain(4)
    payloads = [bytes(range(256)) * (BLOCK_BYTES // 256) for _ in range(4)]

    def plant(store, key):
        def run(txn):
            head, stored = bytes(txn.get("heads", key)), bytes(txn.get("blocks", key))
            txn.put("heads", key, undecodable_head(head, stored))  # format 3: the blocks value is the body
        store._tier.engine.write(run)

    with open_store(tmp_path / "read", codec="zstd") as store:
        store.put(NS, keys, payloads)
        plant(store, keys[2])
        assert store.get(NS, keys) == payloads[:2] + [None, payloads[3]]  # each key read alone
        assert store.stats().quarantined == 1
        assert store.lookup(NS, keys) == 2  # quarantined with its descendant (prefix invariant)
        assert store.get(NS, keys) == payloads[:2] + [None, None]

    with open_store(tmp_path / "verify", codec="zstd") as store:
        store.put(NS, keys, payloads)
        plant(store, keys[1])
    report = maintenance.verify(tmp_path / "verify", fix=True)
    assert list(report.corrupt) == [keys[1]] and "frame mode" in report.corrupt[keys[1]]
    assert report.quarantined_blocks == 3  # the block and its two descendants
    with open_store(tmp_path / "verify", codec="zstd") as store:
        assert store.get(NS, keys) == payloads[:1] + [None] * 3
