"""The compiled extension (ucm_db._native) and its fallbacks mean the same thing.

* The extension is built in this environment (a missing compiler at install
  time otherwise goes unnoticed: the fallbacks are slower, not wrong).
* chain_keys: native == Python fallback == the documented derivation with
  hashlib, for any tokens, block size and parent; lists, tuples and uint32
  buffers alike; BLAKE2b itself == hashlib's for any input length.
* split/merge planes: native == fallback == codec's numpy shuffle, and a
  round trip is the identity, also into a slice of a bigger buffer.
* Bad input raises the same exception class on both paths, and keys.py
  turns bad token ids into ConfigError.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import ConfigError, Namespace, codec, native

_REBUILD_HINT = (
    "ucm_db._native is not built: install a C compiler and the Python headers "
    "(e.g. `apt-get install gcc python3-dev`), then reinstall: "
    "`.venv/bin/python -m pip install --no-build-isolation --no-deps -e '.[vllm,dev]'` "
    "(or `python3 dev.py setup` after deleting .venv/.ucm-db-installed)"
)

CHAIN: dict[str, Callable[[], Any]] = {"native": lambda: native.chain_keys, "python": lambda: native.chain_keys_py}
SPLIT: dict[str, Callable[[], Any]] = {"native": lambda: native.split_planes, "python": lambda: native.split_planes_py}
MERGE: dict[str, Callable[[], Any]] = {"native": lambda: native.merge_planes, "python": lambda: native.merge_planes_py}


def _impl(table: dict[str, Callable[[], Any]], kind: str) -> Any:
    if kind == "native" and not native.NATIVE_AVAILABLE:
        pytest.skip("extension not built (see test_extension_is_built)")
    return table[kind]()


def _reference_chain(prev: bytes, tokens: list[int], block_size: int, n_blocks: int) -> list[bytes]:
    """The derivation as documented, with hashlib: no shared code with either path."""
    out = []
    for i in range(n_blocks):
        block = tokens[i * block_size : (i + 1) * block_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{block_size}I", *block), digest_size=32).digest()
        out.append(prev)
    return out


def test_extension_is_built() -> None:
    assert native.NATIVE_AVAILABLE, _REBUILD_HINT
    import ucm_db._native as ext

    assert native.chain_keys is ext.chain_keys
    assert native.split_planes is ext.split_planes


# --- BLAKE2b and chain_keys -------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 31, 32, 96, 127, 128, 129, 255, 256, 257, 1000, 65536, 1 << 20])
def test_blake2b_matches_hashlib_around_block_edges(length: int) -> None:
    if not native.NATIVE_AVAILABLE:
        pytest.skip("extension not built")
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert native.blake2b_256(data) == hashlib.blake2b(data, digest_size=32).digest()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=700))
def test_blake2b_matches_hashlib_for_any_input(data: bytes) -> None:
    if not native.NATIVE_AVAILABLE:
        pytest.skip("extension not built")
    assert native.blake2b_256(data) == hashlib.blake2b(data, digest_size=32).digest()
    assert native.blake2b_256(memoryview(bytearray(data))) == native.blake2b_256_py(data)


_TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=150, deadline=None)
@given(prev=st.binary(min_size=32, max_size=32), tokens=_TOKENS, block_size=st.integers(1, 64), data=st.data())
def test_chain_keys_native_equals_python_and_reference(prev: bytes, tokens: list[int], block_size: int, data: st.DataObject) -> None:
    n_blocks = data.draw(st.integers(0, len(tokens) // block_size), label="n_blocks")
    expected = _reference_chain(prev, tokens, block_size, n_blocks)
    raw = np.array(tokens, dtype=np.uint32).astype("<u4")
    for kind in ("native", "python") if native.NATIVE_AVAILABLE else ("python",):
        chain = CHAIN[kind]()
        assert chain(prev, tokens, block_size, n_blocks) == expected
        assert chain(bytearray(prev), tuple(tokens), block_size, n_blocks) == expected
        assert chain(prev, raw.tobytes(), block_size, n_blocks) == expected
        assert chain(memoryview(prev), raw, block_size, n_blocks) == expected
        # start: the same keys from a later index of a longer list or buffer, no slicing.
        pad = data.draw(st.integers(0, 40), label="pad")
        padded = [7] * pad + tokens
        assert chain(prev, padded, block_size, n_blocks, pad) == expected
        assert chain(prev, np.array(padded, dtype="<u4").tobytes(), block_size, n_blocks, pad) == expected
        with pytest.raises(ValueError):
            chain(prev, padded, block_size, n_blocks, len(padded) - n_blocks * block_size + 1)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_long_chain_equals_reference(kind: str) -> None:
    # 2048 blocks of 16: large enough that the native path releases the GIL.
    chain = _impl(CHAIN, kind)
    tokens = np.random.default_rng(3).integers(0, 2**32, 2048 * 16 + 5, dtype=np.uint64).tolist()
    prev = bytes(range(32))
    assert chain(prev, tokens, 16, 2048) == _reference_chain(prev, tokens, 16, 2048)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_chain_keys_accepts_index_objects_like_array(kind: str) -> None:
    chain = _impl(CHAIN, kind)
    tokens = [np.int64(5), True, np.uint32(7), 2**32 - 1]
    assert chain(bytes(32), tokens, 2, 2) == _reference_chain(bytes(32), [5, 1, 7, 2**32 - 1], 2, 2)


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("token,error", [(-1, OverflowError), (2**32, OverflowError), (2**70, OverflowError), ("7", TypeError), (1.0, TypeError), (None, TypeError)])
def test_bad_token_ids_raise(kind: str, token: object, error: type[Exception]) -> None:
    chain = _impl(CHAIN, kind)
    with pytest.raises(error):
        chain(bytes(32), [1, 2, token, 4], 2, 2)
    # Ids past the last full block are not read, as in keys.py.
    assert chain(bytes(32), [1, 2, 3, 4, token], 2, 2) == _reference_chain(bytes(32), [1, 2, 3, 4], 2, 2)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_chain_keys_argument_errors(kind: str) -> None:
    chain = _impl(CHAIN, kind)
    with pytest.raises(ValueError):
        chain(bytes(31), [1, 2], 2, 1)
    with pytest.raises(ValueError):
        chain(bytes(32), [1, 2, 3], 2, 2)  # fewer ids than n_blocks * block_size
    with pytest.raises(ValueError):
        chain(bytes(32), bytes(12), 2, 2)  # fewer bytes than 4 * n_blocks * block_size
    with pytest.raises(ValueError):
        chain(bytes(32), [1, 2], 0, 1)
    with pytest.raises(TypeError):
        chain(bytes(32), np.arange(4, dtype=np.int64), 2, 2)  # not uint32: refused, not misread
    with pytest.raises(TypeError):
        chain(bytes(32), np.arange(4, dtype=">u4"), 2, 2)
    with pytest.raises(TypeError):
        chain(bytes(32), iter([1, 2]), 2, 1)
    assert chain(bytes(32), [], 2, 0) == []


def test_native_survives_a_list_that_shrinks_during_conversion() -> None:
    chain = _impl(CHAIN, "native")
    tokens: list[object] = []

    class Shrinking:
        def __index__(self) -> int:
            tokens.clear()
            return 1

    tokens.extend([1, Shrinking(), 3, 4])
    with pytest.raises(ValueError, match="changed size"):
        chain(bytes(32), tokens, 2, 2)


# --- keys.py on both paths -------------------------------------------------

NS = Namespace(model="native-test", kv_dtype="bfloat16", block_size=16)


def _key_cases() -> list[tuple[Any, dict[str, Any]]]:
    tokens = np.random.default_rng(5).integers(0, 150_000, 16 * 40 + 9).tolist()
    return [
        (tokens, {}),
        (tuple(tokens), {"extras": {"cache_salt": "s", "lora": "a"}}),
        (np.array(tokens, dtype=np.int64), {}),
        (np.array(tokens, dtype=np.uint32), {"parent": bytes(range(32))}),
        (range(16 * 9), {}),
    ]


def test_block_keys_are_identical_on_the_fallback_path(monkeypatch: pytest.MonkeyPatch) -> None:
    before = [NS.block_keys(tokens, **kwargs) for tokens, kwargs in _key_cases()]
    calls = []

    def fallback(*args: Any) -> list[bytes]:
        calls.append(args[2:])
        return native.chain_keys_py(*args)

    monkeypatch.setattr(native, "chain_keys", fallback)
    after = [NS.block_keys(tokens, **kwargs) for tokens, kwargs in _key_cases()]
    assert calls == [(16, 40, 0), (16, 40, 0), (16, 40, 0), (16, 40, 0), (16, 9, 0)]
    assert after == before
    tokens = _key_cases()[0][0]
    assert before[0] == _reference_chain(NS.root_key(), tokens, 16, 40)


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [1.5] * 16, ["1"] * 16, (0,) * 15 + (-3,)])
def test_block_keys_turn_bad_ids_into_config_errors(monkeypatch: pytest.MonkeyPatch, kind: str, bad: Any) -> None:
    monkeypatch.setattr(native, "chain_keys", _impl(CHAIN, kind))
    with pytest.raises(ConfigError, match="non-negative integers"):
        NS.block_keys(bad)


# --- byte planes -------------------------------------------------------------


def _elements(element_bytes: int) -> st.SearchStrategy[bytes]:
    return st.integers(0, 300).flatmap(lambda n: st.binary(min_size=n * element_bytes, max_size=n * element_bytes))


@settings(max_examples=100, deadline=None)
@given(element_bytes=st.sampled_from([2, 4]), data=st.data())
def test_planes_equal_codec_shuffle_and_round_trip(element_bytes: int, data: st.DataObject) -> None:
    src = data.draw(_elements(element_bytes))
    expected = [bytes(p) for p in codec._shuffle(memoryview(src), element_bytes)]
    for kind in ("native", "python") if native.NATIVE_AVAILABLE else ("python",):
        planes = SPLIT[kind]()(src, element_bytes)
        assert [bytes(p) for p in planes] == expected
        out = bytearray(len(src))
        MERGE[kind]()(planes, out, element_bytes)
        assert out == src
        via_codec = bytearray(len(src))
        codec._unshuffle(list(planes), memoryview(via_codec), element_bytes)
        assert via_codec == src


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_merge_writes_only_its_slice_of_a_bigger_buffer(kind: str, element_bytes: int) -> None:
    split, merge = _impl(SPLIT, kind), _impl(MERGE, kind)
    src = np.random.default_rng(element_bytes).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # 1 MiB: GIL released
    unaligned = memoryview(bytearray(1) + src)[1:]
    planes = split(unaligned, element_bytes)
    assert [bytes(p) for p in planes] == [bytes(p) for p in codec._shuffle(memoryview(src), element_bytes)]
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
