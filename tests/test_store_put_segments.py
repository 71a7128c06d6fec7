"""Several chain segments in one transaction (``Store.put_segments``) and a
per-put codec (``codec_name=``): what a producer's in-step commit uses
(issue 11's publication wait)."""

from __future__ import annotations

import pytest

import ucm_db
from ucm_db import BlockKeys, ConfigError, MissingAncestorError, Namespace, StoreFullError

NS = Namespace(model="segments-test", kv_dtype="bfloat16", block_size=4)
BLOCK_BYTES = 16 << 10


def payload(seed: int, i: int) -> bytes:
    # Half compressible (a constant byte plane), half not: zstd shrinks it.
    body = bytes((seed * 31 + i * 7 + j * 13) % 256 for j in range(256)) * (BLOCK_BYTES // 512)
    return bytes(x for pair in zip(body, b"\x3f" * len(body)) for x in pair)


def chain(n: int, seed: int) -> BlockKeys:
    return NS.block_keys([seed * 100_000 + t for t in range(4 * n)])


def open_store(path, **options):
    options.setdefault("capacity_bytes", 64 << 20)
    options.setdefault("codec", "zstd")
    return ucm_db.open(path, **options)


def test_segments_land_together_and_read_back(tmp_path):
    a, b = chain(5, 1), chain(3, 2)
    with open_store(tmp_path) as store:
        result = store.put_segments(NS, [(a, [payload(1, i) for i in range(5)]), (b, [payload(2, i) for i in range(3)])])
        assert result.stored == 8
        assert store.lookup(NS, a) == 5 and store.lookup(NS, b) == 3
        assert store.get(NS, list(b)) == [payload(2, i) for i in range(3)]


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_stored_keys_name_only_the_blocks_this_put_wrote(tmp_path, codec_name):
    """First writer wins: blocks another put stored first are left as they
    are and not named, so a caller undoing its put deletes only its own."""
    keys = chain(5, 4)
    with open_store(tmp_path) as store:
        assert store.put(NS, keys[:2], [payload(4, i) for i in range(2)], codec_name=codec_name).stored_keys == list(keys[:2])
        result = store.put_segments(NS, [(keys, [payload(5, i) for i in range(5)])], codec_name=codec_name)
        assert (result.stored, result.already_present, result.stored_keys) == (3, 2, list(keys[2:]))
        assert store.put(NS, keys, [payload(5, i) for i in range(5)], codec_name=codec_name).stored_keys == []
        assert store.delete(NS, result.stored_keys[:1]) == 3
        assert store.get(NS, list(keys[:2])) == [payload(4, i) for i in range(2)]


def test_a_segment_may_continue_an_earlier_one_of_the_same_call(tmp_path):
    keys = chain(6, 3)
    with open_store(tmp_path) as store:
        store.put_segments(NS, [(keys[:2], [payload(3, i) for i in range(2)]), (keys[2:], [payload(3, i) for i in range(2, 6)])])
        assert store.lookup(NS, keys) == 6


def test_one_orphan_segment_stores_nothing_of_the_call(tmp_path):
    good, orphan = chain(3, 4), chain(4, 5)[2:]
    with open_store(tmp_path) as store:
        with pytest.raises(MissingAncestorError):
            store.put_segments(NS, [(good, [payload(4, i) for i in range(3)]), (orphan, [payload(5, i) for i in range(2)])])
        assert store.lookup(NS, good) == 0 and store.stats().blocks == 0


def test_segments_too_big_for_the_store_store_nothing(tmp_path):
    with open_store(tmp_path, capacity_bytes=1 << 20, codec="none") as store:
        big = [(chain(40, s), [payload(s, i) for i in range(40)]) for s in (6, 7)]
        with pytest.raises(StoreFullError):
            store.put_segments(NS, big)
        assert store.stats().blocks == 0


def test_plain_key_lists_are_refused_with_the_fix(tmp_path):
    with open_store(tmp_path) as store:
        with pytest.raises(ConfigError, match="BlockKeys"):
            store.put_segments(NS, [(list(chain(2, 8)), [payload(8, 0), payload(8, 1)])])
        with pytest.raises(ConfigError, match="2 keys and 1 payloads"):
            store.put_segments(NS, [(chain(2, 8), [payload(8, 0)])])


def test_a_per_put_codec_overrides_the_stores_and_reads_back(tmp_path):
    raw, packed = chain(4, 9), chain(4, 10)
    with open_store(tmp_path) as store:
        store.put(NS, raw, [payload(9, i) for i in range(4)], codec_name="none")
        stats = store.stats()
        assert stats.stored_bytes >= stats.raw_bytes  # stored as is
        store.put(NS, packed, [payload(10, i) for i in range(4)])  # the store's zstd
        after = store.stats()
        assert after.stored_bytes - stats.stored_bytes < after.raw_bytes - stats.raw_bytes
        assert store.get(NS, list(raw)) == [payload(9, i) for i in range(4)]
        assert store.get(NS, list(packed)) == [payload(10, i) for i in range(4)]
    with open_store(tmp_path) as reopened:  # the store's codec stays zstd
        assert reopened.config.codec == "zstd"
        assert reopened.get(NS, list(raw)) == [payload(9, i) for i in range(4)]


def test_an_unknown_per_put_codec_is_refused_and_stores_nothing(tmp_path):
    with open_store(tmp_path) as store:
        with pytest.raises(ConfigError, match="unknown codec 'lz4'"):
            store.put(NS, chain(2, 11), [payload(11, 0), payload(11, 1)], codec_name="lz4")
        assert store.stats().blocks == 0


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_get_into_fills_a_scatter_list_in_order(tmp_path, codec_name):
    """A list of buffers per key is filled one after another with the
    block's raw bytes (frames of any size, pieces of any size)."""
    import numpy as np

    ns = ucm_db.Namespace(model="scatter", kv_dtype="bfloat16", block_size=4)
    keys = ns.block_keys(list(range(12)))
    rng = np.random.default_rng(5)
    payloads = [[rng.integers(0, 3, 4096, dtype=np.uint8).tobytes() for _ in range(8)] for _ in keys]  # 8 frames of 4 KiB
    with ucm_db.open(tmp_path / "s", codec=codec_name, capacity_bytes=16 << 20) as store:
        store.put(ns, keys, payloads)
        slabs = [[bytearray(4096) for _ in range(8)] for _ in keys]
        assert store.get_into(ns, keys, slabs) == [True] * 3
        assert [[bytes(s) for s in block] for block in slabs] == payloads
        uneven = [(bytearray(10000), bytearray(22768)) for _ in keys]  # pieces that cut across frames
        assert store.get_into(ns, keys, uneven) == [True] * 3
        assert [bytes(a) + bytes(b) for a, b in uneven] == [b"".join(p) for p in payloads]
        with pytest.raises(ucm_db.ConfigError, match="smaller than the block"):
            store.get_into(ns, keys[:1], [[bytearray(4096)] * 7])
        with pytest.raises(ucm_db.ConfigError, match="writable"):
            store.get_into(ns, keys[:1], [[bytearray(4096)] * 7 + [b"x" * 4096]])


def test_eviction_never_takes_a_segment_of_the_call_that_was_stored_already(tmp_path):
    """A segment of the call stored earlier, now the oldest block in a full
    store, is the LRU victim the call's own eviction would pick: it is
    protected like the new blocks and their ancestors, so after the call
    every segment is stored, as promised."""
    import time

    earlier, new = chain(2, 1), chain(2, 2)
    block_bytes = 128 << 10
    block = [bytes([i]) * block_bytes for i in range(16)]
    with open_store(tmp_path, codec="none", capacity_bytes=8 * block_bytes + 4000) as store:
        store.put(NS, earlier, block[:2])
        time.sleep(0.01)
        fillers = [chain(1, 10 + j) for j in range(6)]
        for j, keys in enumerate(fillers):
            store.put(NS, keys, [block[4 + j]])
            time.sleep(0.01)
        result = store.put_segments(NS, [(earlier, block[:2]), (new, block[2:4])])
        assert result.stored == 2 and result.already_present == 2 and result.evicted == 2
        assert store.lookup(NS, earlier) == 2 and store.lookup(NS, new) == 2
        assert sum(store.lookup(NS, keys) for keys in fillers) == 4  # the two oldest others went instead
