"""The key chain rests on hashlib's BLAKE2b and gives today's keys, byte for byte.

* Known answers: keys computed by the C BLAKE2b that ucm-db used before
  (ucm_db/_native.c up to issue 12), pinned here in hex. A change to any of
  them would turn every stored block into a miss.
* chain_keys == the documented derivation written out with hashlib and
  struct (no code shared), for any tokens, block size and parent; lists,
  tuples and uint32 buffers alike, with or without ``start``.
* Bad ids raise OverflowError/TypeError (keys.py turns them into
  ConfigError); wrong sizes raise ValueError.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import ConfigError, Namespace
from ucm_db.keys import chain as key_chain

PREV = bytes(range(32))
#: block_size 4, ids 1000..1022 (5 full blocks), chained from PREV; computed
#: with the C implementation before it was removed.
KNOWN_PLAIN = [
    "037574659ed03f658c19a413169c527e5ef5f436c5dbc90475c44b46d39bf722",
    "650a83418f9a87f81df754dff75da61bfaa2b63c62f6e8df17ae7b13c02eff91",
    "09269f14fe0c2636dbe16aea906e861fa48948e8a9eaa2cdb7af0b206c6c35fd",
    "560c119de52aef3a10efa3f53ff8e6e0a1231cf05e908dedb51af3c682049e05",
    "2b090541b0e7f21fc5f72169d09038bcd1d8ab9109311ffbb77997da5b131436",
]
#: The same tokens with block extras on blocks 0 and 2 (keys.py's mixing).
KNOWN_BLOCK_EXTRAS_LAST = "2bc61ea5de1b48f8deefb245df22fe6c7ff966c15127a818edadf5ce6d1cd9b0"
#: A uint32 array from index 8, chained from 32 zero bytes (3 blocks).
KNOWN_NUMPY_START_LAST = "783b7ba08d5d7dae22834fbbfccdd8dbca71c0d9c51b1c784de282811097cba0"
#: ids 0, 1, 2**32 - 1, 7 twice (2 blocks): the extremes of the id range.
KNOWN_BIG_IDS_LAST = "0a049d5b090e859fc42cdf32dda1519cb4e97675cca34c9c40240c7b8d58b797"

NS = Namespace(model="golden", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(1000, 1000 + 4 * 5 + 3))


def _reference_chain(prev: bytes, tokens: list[int], block_size: int, n_blocks: int) -> list[bytes]:
    """The derivation as documented, with hashlib: no shared code with key_chain."""
    out = []
    for i in range(n_blocks):
        block = tokens[i * block_size : (i + 1) * block_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{block_size}I", *block), digest_size=32).digest()
        out.append(prev)
    return out


def test_known_answers_are_unchanged() -> None:
    assert [k.hex() for k in key_chain.chain_keys(PREV, TOKENS, 4, 5)] == KNOWN_PLAIN
    assert [k.hex() for k in NS.block_keys(TOKENS, parent=PREV)] == KNOWN_PLAIN
    assert NS.block_keys(TOKENS, parent=PREV, block_extras={0: b"image-0", 2: b"image-2"})[-1].hex() == KNOWN_BLOCK_EXTRAS_LAST
    assert NS.block_keys(np.array(TOKENS, dtype=np.uint32), start=8, parent=bytes(32))[-1].hex() == KNOWN_NUMPY_START_LAST
    assert NS.block_keys([0, 1, 2**32 - 1, 7] * 2, parent=PREV)[-1].hex() == KNOWN_BIG_IDS_LAST
    assert _reference_chain(PREV, TOKENS, 4, 5) == [bytes.fromhex(k) for k in KNOWN_PLAIN]


_TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=150, deadline=None)
@given(prev=st.binary(min_size=32, max_size=32), tokens=_TOKENS, block_size=st.integers(1, 64), data=st.data())
def test_chain_keys_equal_the_reference(prev: bytes, tokens: list[int], block_size: int, data: st.DataObject) -> None:
    n_blocks = data.draw(st.integers(0, len(tokens) // block_size), label="n_blocks")
    expected = _reference_chain(prev, tokens, block_size, n_blocks)
    raw = np.array(tokens, dtype=np.uint32).astype("<u4")
    chain = key_chain.chain_keys
    assert chain(prev, tokens, block_size, n_blocks) == expected
    assert chain(bytearray(prev), tuple(tokens), block_size, n_blocks) == expected
    assert chain(prev, raw.tobytes(), block_size, n_blocks) == expected
    assert chain(memoryview(prev), raw, block_size, n_blocks) == expected
    # start: the same keys from a later index of a longer list or buffer.
    pad = data.draw(st.integers(0, 40), label="pad")
    padded = [7] * pad + tokens
    assert chain(prev, padded, block_size, n_blocks, pad) == expected
    assert chain(prev, np.array(padded, dtype="<u4").tobytes(), block_size, n_blocks, pad) == expected
    with pytest.raises(ValueError):
        chain(prev, padded, block_size, n_blocks, len(padded) - n_blocks * block_size + 1)


def test_long_chain_equals_reference() -> None:
    tokens = np.random.default_rng(3).integers(0, 2**32, 2048 * 16 + 5, dtype=np.uint64).tolist()
    assert key_chain.chain_keys(PREV, tokens, 16, 2048) == _reference_chain(PREV, tokens, 16, 2048)


def test_index_objects_are_ids() -> None:
    tokens = [np.int64(5), True, np.uint32(7), 2**32 - 1]
    assert key_chain.chain_keys(bytes(32), tokens, 2, 2) == _reference_chain(bytes(32), [5, 1, 7, 2**32 - 1], 2, 2)


@pytest.mark.parametrize("token,error", [(-1, OverflowError), (2**32, OverflowError), (2**70, OverflowError), ("7", TypeError), (1.0, TypeError), (None, TypeError)])
def test_bad_token_ids_raise(token: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        key_chain.chain_keys(bytes(32), [1, 2, token, 4], 2, 2)
    # Ids past the last full block are not read, as in keys.py.
    assert key_chain.chain_keys(bytes(32), [1, 2, 3, 4, token], 2, 2) == _reference_chain(bytes(32), [1, 2, 3, 4], 2, 2)


def test_argument_errors() -> None:
    chain = key_chain.chain_keys
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


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [1.5] * 16, ["1"] * 16, (0,) * 15 + (-3,)])
def test_block_keys_turn_bad_ids_into_config_errors(bad: object) -> None:
    ns = Namespace(model="chain-test", kv_dtype="bfloat16", block_size=16)
    with pytest.raises(ConfigError, match="non-negative integers"):
        ns.block_keys(bad)  # type: ignore[arg-type]
