"""Keys: deterministic, chained, namespaced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_db import ConfigError, Namespace

NS = Namespace(model="tiny-llama", kv_dtype="bfloat16", block_size=4)

_SCRIPT = (
    "from ucm_db import Namespace\n"
    "ns = Namespace(model='tiny-llama', kv_dtype='bfloat16', block_size=4, tp_rank=1, tp_size=2)\n"
    "print(ns.digest.hex(), ns.block_keys(list(range(40)), extras={'cache_salt': 's', 'lora': 'a'})[-1].hex())\n"
)


def test_keys_identical_across_interpreters_with_different_hash_seeds() -> None:
    outs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout)
    assert len(outs) == 1
    ns = Namespace(model="tiny-llama", kv_dtype="bfloat16", block_size=4, tp_rank=1, tp_size=2)
    local = f"{ns.digest.hex()} {ns.block_keys(list(range(40)), extras={'lora': 'a', 'cache_salt': 's'})[-1].hex()}\n"
    assert outs == {local}


def test_only_full_blocks_get_keys_of_32_bytes() -> None:
    keys = NS.block_keys(list(range(11)))
    assert len(keys) == 2
    assert all(len(k) == 32 for k in keys)
    assert NS.block_keys([1, 2, 3]) == []


def test_key_names_its_whole_prefix() -> None:
    a = NS.block_keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = NS.block_keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different first block


@pytest.mark.parametrize("field,value", [
    ("model", "other"), ("kv_dtype", "float16"), ("block_size", 8), ("tp_rank", 1), ("layout", "cuda"), ("extra", "q4"),
])
def test_every_namespace_field_changes_the_keys(field: str, value: object) -> None:
    kwargs = {"model": "tiny-llama", "kv_dtype": "bfloat16", "block_size": 4, "tp_size": 2}
    other = Namespace(**{**kwargs, field: value})
    base = Namespace(**kwargs)
    tokens = list(range(16))
    assert base.digest != other.digest
    assert not set(base.block_keys(tokens)) & set(other.block_keys(tokens))


def test_extras_change_keys_and_none_values_are_ignored() -> None:
    tokens = list(range(8))
    plain = NS.block_keys(tokens)
    assert NS.block_keys(tokens, extras={"cache_salt": None}) == plain
    assert NS.block_keys(tokens, extras={"cache_salt": "x"})[0] != plain[0]
    assert NS.block_keys(tokens, extras={"mm": b"\x01"}) != NS.block_keys(tokens, extras={"mm": "01"})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=60), st.integers(0, 15))
def test_incremental_chain_equals_whole_chain(tokens: list[int], split_blocks: int) -> None:
    whole = NS.block_keys(tokens)
    cut = min(split_blocks, len(whole)) * NS.block_size
    head = NS.block_keys(tokens[:cut])
    tail = NS.block_keys(tokens[cut:], parent=head[-1]) if head else NS.block_keys(tokens[cut:])
    assert head + tail == whole


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(0, 80), st.integers(0, 80))
def test_start_and_stop_equal_slicing(tokens: list[int], start: int, stop: int) -> None:
    parent = NS.block_keys(list(range(NS.block_size)))[0]
    assert NS.block_keys(tokens, start=start, stop=stop) == NS.block_keys(tokens[start:stop])
    assert NS.block_keys(tokens, parent=parent, start=start) == NS.block_keys(tokens[start:], parent=parent)
    assert NS.block_keys(tuple(tokens), {"cache_salt": "s"}, stop=stop) == NS.block_keys(tokens[:stop], {"cache_salt": "s"})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**16), min_size=4, max_size=60),
    st.dictionaries(st.integers(0, 15), st.binary(min_size=1, max_size=8), max_size=4),
    st.integers(0, 15),
)
def test_block_extras_change_keys_from_their_block_on(tokens: list[int], block_extras: dict[int, bytes], split_blocks: int) -> None:
    plain = NS.block_keys(tokens)
    marked = NS.block_keys(tokens, block_extras=block_extras)
    first = min((k for k in block_extras if k < len(plain)), default=len(plain))
    assert marked[:first] == plain[:first]
    assert all(a != b for a, b in zip(marked[first:], plain[first:]))
    cut = min(split_blocks, len(plain)) * NS.block_size
    head = NS.block_keys(tokens, stop=cut, block_extras=block_extras)
    tail = NS.block_keys(tokens, parent=head[-1], start=cut, block_extras=block_extras) if head else marked
    assert (head + tail if head else tail) == marked


def test_block_extras_need_a_block_boundary_and_bytes() -> None:
    tokens = list(range(16))
    with pytest.raises(ConfigError):
        NS.block_keys(tokens, start=2, block_extras={1: b"x"})
    with pytest.raises(ConfigError):
        NS.block_keys(tokens, block_extras={1: "x"})  # type: ignore[dict-item]
    np = pytest.importorskip("numpy")
    assert NS.block_keys(np.array(tokens), start=4, block_extras={2: b"x"}) == NS.block_keys(tokens, start=4, block_extras={2: b"x"})


def test_numpy_tokens_match_list_tokens() -> None:
    np = pytest.importorskip("numpy")
    tokens = list(range(1000, 1040))
    assert NS.block_keys(np.array(tokens, dtype=np.int64)) == NS.block_keys(tokens)


@pytest.mark.parametrize("kwargs", [
    {"model": "", "kv_dtype": "bf16", "block_size": 4},
    {"model": "m", "kv_dtype": "bf16", "block_size": 0},
    {"model": "m", "kv_dtype": "bf16", "block_size": 4, "tp_rank": 2, "tp_size": 2},
])
def test_invalid_namespace_is_a_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        Namespace(**kwargs)  # type: ignore[arg-type]
    assert info.value.hint


def test_bad_tokens_and_parent_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        NS.block_keys([-1, 2, 3, 4])
    with pytest.raises(ConfigError):
        NS.block_keys([1, 2, 3, 4], parent=b"short")
    with pytest.raises(ConfigError):
        NS.block_keys([1, 2, 3, 4], extras={"a": "b"}, parent=bytes(32))


def test_namespace_round_trips_through_dict() -> None:
    assert Namespace.from_dict(NS.to_dict()) == NS
    with pytest.raises(ConfigError, match="unknown Namespace field"):
        Namespace.from_dict({**NS.to_dict(), "colour": "red"})
