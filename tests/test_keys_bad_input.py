"""Token ids that are not a prompt's ids are a ConfigError naming what they
are (issue 26, items 14 and 16): before, a 2-D numpy batch gave 0 keys with
no error, bools and the bytes of a byte string were hashed as ids, and a
generator raised a raw TypeError. A generator is now read into a list."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ucm_db import ConfigError, Namespace

NS = Namespace(model="keys-bad-input", kv_dtype="bfloat16", block_size=4)
IDS = list(range(100, 116))  # 4 blocks

REFUSED: dict[str, tuple[Any, str]] = {
    "2-D int64 array": (np.array(IDS).reshape(2, 8), "1-D"),
    "2-D int32 array, a row per block": (np.array(IDS, dtype=np.int32).reshape(4, 4), "shape (4, 4)"),
    "0-D array": (np.array(7), "1-D"),
    "bool list": ([True, False, True, True] * 2, "bool"),
    "bool array": (np.array([True, False, True, True] * 2), "dtype bool"),
    "float array": (np.array(IDS, dtype=np.float32), "dtype float32"),
    "bytes": (b"\x01\x02\x03\x04" * 4, "bytes"),
    "bytearray": (bytearray(16), "bytearray"),
    "memoryview of bytes": (memoryview(b"abcdefgh"), "memoryview"),
    "str": ("hello world, hi", "str"),
    "set": (set(IDS), "set"),
    "int": (5, "int"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_token_ids_of_the_wrong_kind_are_a_config_error(name: str) -> None:
    token_ids, named = REFUSED[name]
    with pytest.raises(ConfigError) as raised:
        NS.block_keys(token_ids)
    assert named in str(raised.value), str(raised.value)
    assert raised.value.hint


def test_a_generator_is_read_into_a_list() -> None:
    assert NS.block_keys(i for i in IDS) == NS.block_keys(IDS)
    assert NS.block_keys(iter(IDS), start=4, stop=12) == NS.block_keys(IDS, start=4, stop=12)


def test_integer_arrays_and_sequences_still_key_alike() -> None:
    expected = NS.block_keys(IDS)
    assert len(expected) == 4
    for same in (tuple(IDS), np.array(IDS), np.array(IDS, dtype=np.uint32), np.array(IDS, dtype=np.int16), range(100, 116)):
        assert NS.block_keys(same) == expected
