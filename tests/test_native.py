"""The compiled shuffle (ucm_db._native) and its numpy fallback mean the same thing.

* The extension is built in this environment (a missing compiler at install
  time otherwise goes unnoticed: the fallbacks are slower, not wrong).
* split/merge planes: native == fallback == codec's numpy shuffle, and a
  round trip is the identity, also into a slice of a bigger buffer.
* copy_into_slabs is copy_into over slab `index` of each view, on both paths;
  gather_slabs reads slabs back into rows, its inverse.
* Bad input raises the same exception class on both paths.
* The extension holds no hash: keys rest on hashlib alone
  (tests/test_key_chain.py pins them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import codec
from ucm_db.codec import decoding as codec_decode, encoding as codec_encode, native

_REBUILD_HINT = (
    "ucm_db._native is not built: install a C compiler and the Python headers "
    "(e.g. `apt-get install gcc python3-dev`), then reinstall: "
    "`.venv/bin/python -m pip install --no-build-isolation --no-deps -e '.[vllm,dev]'` "
    "(or `python3 dev.py setup` after deleting .venv/.ucm-db-installed)"
)

SPLIT: dict[str, Callable[[], Any]] = {"native": lambda: native.split_planes, "python": lambda: native.split_planes_py}
MERGE: dict[str, Callable[[], Any]] = {"native": lambda: native.merge_planes, "python": lambda: native.merge_planes_py}


def _impl(table: dict[str, Callable[[], Any]], kind: str) -> Any:
    if kind == "native" and not native.NATIVE_AVAILABLE:
        pytest.skip("extension not built (see test_extension_is_built)")
    return table[kind]()


def test_extension_is_built() -> None:
    assert native.NATIVE_AVAILABLE, _REBUILD_HINT
    import ucm_db._native as ext

    assert native.split_planes is ext.split_planes
    assert native.merge_planes is ext.merge_planes


def test_the_extension_carries_no_hash() -> None:
    # One BLAKE2b for every key: hashlib's (ucm_db.keys.chain), none in C.
    import ucm_db._native as ext

    assert not [name for name in dir(ext) if "blake" in name.lower() or "chain" in name.lower()]
    source = (Path(native.__file__).parent.parent / "_native.c").read_text().lower()
    assert "blake2b_compress" not in source and "b2b_" not in source


# --- byte planes -------------------------------------------------------------


def _elements(element_bytes: int) -> st.SearchStrategy[bytes]:
    return st.integers(0, 300).flatmap(lambda n: st.binary(min_size=n * element_bytes, max_size=n * element_bytes))


@settings(max_examples=100, deadline=None)
@given(element_bytes=st.sampled_from([2, 4]), data=st.data())
def test_planes_equal_codec_shuffle_and_round_trip(element_bytes: int, data: st.DataObject) -> None:
    src = data.draw(_elements(element_bytes))
    expected = [bytes(p) for p in codec_encode._shuffle(memoryview(src), element_bytes)]
    for kind in ("native", "python") if native.NATIVE_AVAILABLE else ("python",):
        planes = SPLIT[kind]()(src, element_bytes)
        assert [bytes(p) for p in planes] == expected
        out = bytearray(len(src))
        MERGE[kind]()(planes, out, element_bytes)
        assert out == src
        via_codec = bytearray(len(src))
        codec_decode._unshuffle(list(planes), memoryview(via_codec), element_bytes)
        assert via_codec == src


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_merge_writes_only_its_slice_of_a_bigger_buffer(kind: str, element_bytes: int) -> None:
    split, merge = _impl(SPLIT, kind), _impl(MERGE, kind)
    src = np.random.default_rng(element_bytes).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # 1 MiB: GIL released
    unaligned = memoryview(bytearray(1) + src)[1:]
    planes = split(unaligned, element_bytes)
    assert [bytes(p) for p in planes] == [bytes(p) for p in codec_encode._shuffle(memoryview(src), element_bytes)]
    backing = bytearray(b"\xaa" * (len(src) + 7))
    merge(planes, memoryview(backing)[3 : 3 + len(src)], element_bytes)
    assert backing[3 : 3 + len(src)] == src
    assert backing[:3] == b"\xaa" * 3 and backing[3 + len(src) :] == b"\xaa" * 4
    words = np.empty(len(src) // element_bytes, dtype=f"<u{element_bytes}")
    merge(planes, words, element_bytes)  # a numpy array is a writable buffer too
    assert words.tobytes() == src


@pytest.mark.parametrize("kind", ["native", "python"])
def test_plane_argument_errors(kind: str) -> None:
    split, merge = _impl(SPLIT, kind), _impl(MERGE, kind)
    with pytest.raises(ValueError):
        split(bytes(7), 2)
    with pytest.raises(ValueError):
        split(bytes(6), 4)
    with pytest.raises(ValueError):
        split(bytes(6), 3)
    planes = split(bytes(range(8)), 2)
    with pytest.raises(ValueError):
        merge(planes, bytearray(8), 4)  # two planes for four-byte elements
    with pytest.raises(ValueError):
        merge([planes[0], planes[1][:-1]], bytearray(8), 2)
    with pytest.raises(ValueError):
        merge(planes, bytearray(9), 2)
    with pytest.raises(ValueError):
        merge(planes, bytearray(8), 3)
    with pytest.raises(TypeError):
        merge(planes, bytes(8), 2)  # read-only
    with pytest.raises(TypeError):
        merge(planes, memoryview(bytearray(16))[::2], 2)  # strided
    shared = bytearray(16)
    with pytest.raises(ValueError):
        merge([memoryview(shared)[:4], memoryview(shared)[4:8]], memoryview(shared)[4:12], 2)


MERGE_INTO: dict[str, Callable[[], Any]] = {"native": lambda: native.merge_planes_into, "python": lambda: native.merge_planes_into_py}


@settings(max_examples=100, deadline=None)
@given(element_bytes=st.sampled_from([2, 4]), data=st.data())
def test_merge_planes_into_writes_the_merged_bytes_at_skip_across_outs(element_bytes: int, data: st.DataObject) -> None:
    src = data.draw(_elements(element_bytes))
    sizes = data.draw(st.lists(st.integers(0, 80).map(lambda n: n * element_bytes), min_size=1, max_size=6))
    skip = data.draw(st.integers(0, 40)) * element_bytes
    sizes[-1] += max(0, skip + len(src) - sum(sizes))  # room for all of it
    expected = bytearray(b"\xaa" * sum(sizes))
    expected[skip : skip + len(src)] = src
    planes = native.split_planes_py(src, element_bytes)
    for kind in ("native", "python") if native.NATIVE_AVAILABLE else ("python",):
        outs = [bytearray(b"\xaa" * n) for n in sizes]
        assert MERGE_INTO[kind]()(planes, outs, element_bytes, skip) == len(src)
        assert b"".join(outs) == expected


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("offset", [0, 1, 2, 6, 8, 14])
def test_merge_planes_into_large_slabs_at_any_alignment(kind: str, offset: int) -> None:
    # 8 KiB slabs of a bigger buffer, as a KV cache's layers: the native
    # path streams its stores from the first 16-byte boundary on.
    merge_into = _impl(MERGE_INTO, kind)
    src = np.random.default_rng(offset).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
    planes = native.split_planes_py(src, 2)
    backing = bytearray(b"\xaa" * (offset + (72 << 10)))
    slabs = [memoryview(backing)[offset + i * (9 << 10) :][: 8 << 10] for i in range(8)]  # 1 KiB gaps between them
    assert merge_into(planes, slabs, 2, 0) == len(src)
    assert b"".join(bytes(slab) for slab in slabs) == src
    gaps = [bytes(memoryview(backing)[offset + i * (9 << 10) + (8 << 10) :][: 1 << 10]) for i in range(7)]
    assert backing[:offset] == b"\xaa" * offset and gaps == [b"\xaa" * 1024] * 7


@pytest.mark.parametrize("kind", ["native", "python"])
def test_merge_planes_into_argument_errors(kind: str) -> None:
    merge_into = _impl(MERGE_INTO, kind)
    planes = native.split_planes_py(bytes(range(16)), 2)
    with pytest.raises(ValueError, match="inside an element"):
        merge_into(planes, [bytearray(3), bytearray(13)], 2, 0)
    with pytest.raises(ValueError, match="fewer than"):
        merge_into(planes, [bytearray(8), bytearray(8)], 2, 2)
    with pytest.raises(ValueError, match="whole number"):
        merge_into(planes, bytearray(32), 2, 1)
    with pytest.raises(ValueError):
        merge_into(planes, bytearray(32), 4, 0)  # two planes for four-byte elements
    with pytest.raises(TypeError):
        merge_into(planes, [bytearray(8), bytes(8)], 2, 0)  # read-only
    assert merge_into(planes, [bytearray(3), bytearray(17)], 2, 4) == 16  # elements cut by the stream, not by the outs
    if kind == "native":  # the fallback copies through a staging buffer: overlap cannot hurt it
        shared = bytearray(32)
        with pytest.raises(ValueError, match="overlaps"):
            native.merge_planes_into([memoryview(shared)[:8], memoryview(shared)[8:16]], memoryview(shared)[12:28], 2, 0)


MERGE_SLABS: dict[str, Callable[[], Any]] = {"native": lambda: native.merge_planes_into_slabs, "python": lambda: native.merge_planes_into_slabs_py}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["native", "python"]), data=st.data())
def test_merge_planes_into_slabs_is_merge_planes_into_over_each_views_slab(kind: str, data: st.DataObject) -> None:
    merge = _impl(MERGE_SLABS, kind)
    sizes = data.draw(st.lists(st.integers(1, 150).map(lambda n: 2 * n), min_size=1, max_size=6))
    count = data.draw(st.integers(1, 5))
    index = data.draw(st.integers(0, count - 1))
    skip = 2 * data.draw(st.integers(0, sizes[0] // 2))
    src = data.draw(_elements(2).filter(lambda b: len(b) <= sum(sizes) - skip))
    planes = native.split_planes_py(src, 2)
    views = tuple(memoryview(bytearray(b"\xee" * (size * count))) for size in sizes)
    expected = [bytearray(b"\xee" * (size * count)) for size in sizes]
    assert merge(planes, views, tuple(sizes), index, 2, skip) == len(src)
    native.merge_planes_into_py(planes, [memoryview(e)[index * n : (index + 1) * n] for e, n in zip(expected, sizes)], 2, skip)
    assert [bytes(v) for v in views] == [bytes(e) for e in expected]  # only slab `index`, only its bytes


@pytest.mark.parametrize("kind", ["native", "python"])
def test_merge_planes_into_slabs_argument_errors(kind: str) -> None:
    merge = _impl(MERGE_SLABS, kind)
    planes = native.split_planes_py(bytes(range(16)), 2)
    views = (memoryview(bytearray(32)), memoryview(bytearray(32)))
    with pytest.raises(ValueError):
        merge(planes, views, (8, 8), 4, 2, 0)  # past the end of the views
    with pytest.raises(ValueError):
        merge(planes, views, (8, 8), -1, 2, 0)
    with pytest.raises(ValueError, match="fewer than"):
        merge(planes, views, (4, 4), 0, 2, 0)  # slabs too small
    with pytest.raises(ValueError, match="inside an element"):
        merge(planes, views, (3, 16), 0, 2, 0)
    with pytest.raises(TypeError):
        merge(planes, (memoryview(bytes(32)), views[1]), (8, 8), 0, 2, 0)  # read-only
    assert not any(views[0]) and not any(views[1])


# --- checked copy -------------------------------------------------------------

COPY: dict[str, Callable[[], Any]] = {"native": lambda: native.copy_into, "python": lambda: native.copy_into_py}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["native", "python"]), data=st.data())
def test_copy_into_scatters_in_order_and_hashes_what_it_copies(kind: str, data: st.DataObject) -> None:
    import xxhash

    copy = _impl(COPY, kind)
    src = data.draw(st.binary(max_size=3000))
    sizes = data.draw(st.lists(st.integers(0, 700), max_size=8))
    sizes.append(max(0, len(src) - sum(sizes)) + data.draw(st.integers(0, 5)))  # room for all, maybe more
    outs = [bytearray(b"\xee" * n) for n in sizes]
    chunk = data.draw(st.sampled_from([0, 1, 7, 64, 4096]))
    hasher = xxhash.xxh3_64(b"head")
    assert copy(src, outs, hasher, chunk) == len(src)
    joined = b"".join(outs)
    assert joined[: len(src)] == src and set(joined[len(src):]) <= {0xEE}  # the rest left as it was
    assert hasher.intdigest() == xxhash.xxh3_64(b"head" + src).intdigest()  # pieces hash like the whole
    single = bytearray(len(src) + 3)
    assert copy(src, single, None, chunk) == len(src) and single[: len(src)] == src


@pytest.mark.parametrize("kind", ["native", "python"])
def test_copy_into_hashes_a_chunk_in_one_update_across_outs(kind: str) -> None:
    # A raw unit's slabs (8 KiB each) are hashed a chunk at a time, not a
    # slab at a time: one update call per chunk, the same digest.
    import xxhash

    class Counting:
        def __init__(self) -> None:
            self.hasher, self.calls = xxhash.xxh3_64(), 0

        def update(self, piece: memoryview) -> None:
            self.calls += 1
            self.hasher.update(piece)

    src = bytes(range(256)) * 256  # 64 KiB
    outs = [bytearray(8192) for _ in range(8)]
    counting = Counting()
    assert _impl(COPY, kind)(src, outs, counting, 32768) == len(src) and b"".join(outs) == src
    assert counting.calls == 2 and counting.hasher.intdigest() == xxhash.xxh3_64_intdigest(src)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_copy_into_argument_errors(kind: str) -> None:
    copy = _impl(COPY, kind)
    with pytest.raises(ValueError):
        copy(bytes(10), [bytearray(4), bytearray(5)], None, 0)  # too small: nothing copied
    with pytest.raises(TypeError):
        copy(bytes(4), [bytes(4)], None, 0)  # read-only
    with pytest.raises(TypeError):
        copy(bytes(4), memoryview(bytearray(16))[::2], None, 0)  # strided
    if kind == "native":
        shared = bytearray(16)
        with pytest.raises(ValueError):
            copy(memoryview(shared)[:8], memoryview(shared)[4:12], None, 0)


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("offset", [0, 1, 15, 16, 63])
def test_copy_into_large_pieces_at_any_alignment(kind: str, offset: int) -> None:
    # Pieces of 4 KiB and more take the streamed-store path in C: every
    # alignment of the destination and every tail length copies exactly.
    import xxhash

    copy = _impl(COPY, kind)
    src = np.random.default_rng(offset).integers(0, 256, 3 * 8192 + 77, dtype=np.uint8).tobytes()
    backing = bytearray(len(src) + 200)
    outs = [memoryview(backing)[offset : offset + 8192 + 5], memoryview(backing)[offset + 8192 + 5 : offset + len(src) + 9]]
    hasher = xxhash.xxh3_64()
    assert copy(src, outs, hasher, 4096 + 3) == len(src)
    assert bytes(backing[offset : offset + len(src)]) == src
    assert not any(backing[:offset]) and not any(backing[offset + len(src) :])
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(src)
    single = bytearray(len(src) + offset)
    assert copy(src, memoryview(single)[offset:], None, 0) == len(src) and bytes(single[offset:]) == src


SLABS: dict[str, Callable[[], Any]] = {"native": lambda: native.copy_into_slabs, "python": lambda: native.copy_into_slabs_py}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["native", "python"]), data=st.data())
def test_copy_into_slabs_is_copy_into_over_each_views_slab(kind: str, data: st.DataObject) -> None:
    import xxhash

    copy = _impl(SLABS, kind)
    sizes = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    count = data.draw(st.integers(1, 5))
    index = data.draw(st.integers(0, count - 1))
    src = data.draw(st.binary(max_size=sum(sizes)))
    chunk = data.draw(st.sampled_from([0, 1, 7, 64, 4096]))
    views = tuple(memoryview(bytearray(b"\xee" * (size * count))) for size in sizes)
    expected = [bytearray(b"\xee" * (size * count)) for size in sizes]
    hasher = xxhash.xxh3_64(b"head")
    assert copy(src, views, tuple(sizes), index, hasher, chunk) == len(src)
    native.copy_into_py(src, [memoryview(e)[index * s : (index + 1) * s] for e, s in zip(expected, sizes)], None, 0)
    assert [bytes(v) for v in views] == [bytes(e) for e in expected]  # only slab `index`, only len(src) bytes
    assert hasher.intdigest() == xxhash.xxh3_64(b"head" + src).intdigest()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_copy_into_slabs_argument_errors(kind: str) -> None:
    copy = _impl(SLABS, kind)
    views = (memoryview(bytearray(16)), memoryview(bytearray(16)))
    with pytest.raises(ValueError):
        copy(bytes(8), views, (8, 8), 2, None, 0)  # past the end of the views
    with pytest.raises(ValueError):
        copy(bytes(8), views, (8, 8), -1, None, 0)
    with pytest.raises(ValueError):
        copy(bytes(17), views, (8, 8), 1, None, 0)  # slabs too small: nothing copied
    with pytest.raises(ValueError):
        copy(bytes(8), views, (8,), 0, None, 0)  # a size per view
    with pytest.raises(ValueError):
        copy(bytes(8), views, (8, 0), 0, None, 0)
    with pytest.raises(TypeError):
        copy(bytes(8), (memoryview(bytes(16)), views[1]), (8, 8), 0, None, 0)  # read-only
    assert not any(views[0]) and not any(views[1])
    if kind == "native":
        shared = bytearray(32)
        with pytest.raises(ValueError):
            copy(memoryview(shared)[:8], (memoryview(shared),), (8,), 0, None, 0)


GATHER: dict[str, Callable[[], Any]] = {"native": lambda: native.gather_slabs, "python": lambda: native.gather_slabs_py}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["native", "python"]), data=st.data())
def test_gather_slabs_reads_back_what_copy_into_slabs_wrote(kind: str, data: st.DataObject) -> None:
    gather = _impl(GATHER, kind)
    sizes = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    count = data.draw(st.integers(1, 5))
    indices = data.draw(st.lists(st.integers(0, count - 1), max_size=8))
    views = tuple(memoryview(bytearray(data.draw(st.binary(min_size=size * count, max_size=size * count)))) for size in sizes)
    out = bytearray(b"\xee" * (len(indices) * sum(sizes) + 5))
    assert gather(views, tuple(sizes), indices, out) == len(indices) * sum(sizes)
    rows = [b"".join(bytes(v[i * s : (i + 1) * s]) for v, s in zip(views, sizes)) for i in indices]
    assert bytes(out) == b"".join(rows) + b"\xee" * 5  # in order, nothing past the rows
    for row, i in zip(rows, indices):  # the inverse of copy_into_slabs
        scratch = tuple(memoryview(bytearray(len(v))) for v in views)
        native.copy_into_slabs_py(row, scratch, tuple(sizes), i, None, 0)
        assert all(bytes(s[i * n : (i + 1) * n]) == bytes(v[i * n : (i + 1) * n]) for s, v, n in zip(scratch, views, sizes))


@pytest.mark.parametrize("kind", ["native", "python"])
def test_gather_slabs_argument_errors_write_nothing(kind: str) -> None:
    gather = _impl(GATHER, kind)
    views = (memoryview(bytes(range(16))), memoryview(bytes(range(16, 32))))  # read-only views are fine to read
    out = bytearray(32)
    with pytest.raises(ValueError):
        gather(views, (8, 8), [0, 2], out)  # past the end of the views
    with pytest.raises(ValueError):
        gather(views, (8, 8), [-1], out)
    with pytest.raises(ValueError):
        gather(views, (8, 8), [0, 1, 0], out)  # out too small for three rows
    with pytest.raises(ValueError):
        gather(views, (8,), [0], out)  # a size per view
    with pytest.raises(ValueError):
        gather(views, (8, 0), [0], out)
    with pytest.raises(TypeError):
        gather(views, (8, 8), [0], bytes(32))  # read-only out
    assert not any(out)
    shared = bytearray(64)
    with pytest.raises(ValueError):
        gather((memoryview(shared)[:32],), (8,), [0], memoryview(shared)[16:])  # out overlaps a view
    assert not any(shared)
    if kind == "native":  # past GATHER_KEEP_GIL_BYTES the copy releases the GIL: same bytes
        big = bytearray(np.random.default_rng(0).integers(0, 256, 40 << 20, dtype=np.uint8).tobytes())
        rows = bytearray(40 << 20)
        assert gather((memoryview(big),), (1 << 20,), list(range(39, -1, -1)), rows) == 40 << 20
        assert rows[: 1 << 20] == big[39 << 20 :] and rows[39 << 20 :] == big[: 1 << 20]
