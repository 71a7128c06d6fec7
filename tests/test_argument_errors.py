"""Arguments of the wrong kind are a ConfigError naming the argument and
what it wants, at the point they enter, never a TypeError from deep inside:
``block_keys``' ``parent``, ``start``, ``stop``, ``extras`` and
``block_extras``, ``Namespace.from_dict`` of a description lacking fields
(its docstring promised a ConfigError), and ``changes_since``' ``seq`` and
``limit`` on a real store of each engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError, Namespace

NS = Namespace(model="argument-errors", kv_dtype="bfloat16", block_size=4)
IDS = list(range(100, 116))  # 4 blocks

REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "parent a 32-character str": (lambda: NS.block_keys(IDS, parent="a" * 32), "parent"),  # type: ignore[arg-type]
    "parent an int": (lambda: NS.block_keys(IDS, parent=5), "parent"),  # type: ignore[arg-type]
    "parent of 31 bytes": (lambda: NS.block_keys(IDS, parent=b"a" * 31), "parent"),
    "start a str": (lambda: NS.block_keys(IDS, start="1"), "start"),  # type: ignore[arg-type]
    "start a float": (lambda: NS.block_keys(IDS, start=4.0), "start"),  # type: ignore[arg-type]
    "stop a float": (lambda: NS.block_keys(IDS, stop=6.0), "stop"),  # type: ignore[arg-type]
    "stop a bool": (lambda: NS.block_keys(IDS, stop=True), "stop"),
    "extras with mixed-type names": (lambda: NS.block_keys(IDS, extras={1: "a", "b": "c"}), "extras"),  # type: ignore[dict-item]
    "extras a list of pairs": (lambda: NS.block_keys(IDS, extras=[("a", "b")]), "extras"),  # type: ignore[arg-type]
    "extras to root_key with an int name": (lambda: NS.root_key({1: "a"}), "extras"),  # type: ignore[dict-item]
    "block_extras a list": (lambda: NS.block_keys(IDS, block_extras=[b"x"]), "block_extras"),  # type: ignore[arg-type]
    "block_extras with str indices": (lambda: NS.block_keys(IDS, block_extras={"0": b"x"}), "block_extras"),  # type: ignore[dict-item]
    "from_dict without kv_dtype and block_size": (lambda: Namespace.from_dict({"model": "m"}), "block_size"),
    "from_dict of an empty dict": (lambda: Namespace.from_dict({}), "model"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_wrong_argument_is_a_config_error_naming_it(name: str) -> None:
    call, named = REFUSED[name]
    with pytest.raises(ConfigError) as raised:
        call()
    assert named in str(raised.value), str(raised.value)
    assert raised.value.hint


def test_integer_like_positions_and_indices_still_key_alike() -> None:
    expected = NS.block_keys(IDS, start=4, stop=12)
    assert NS.block_keys(IDS, start=np.int64(4), stop=np.int32(12)) == expected
    marked = NS.block_keys(IDS, block_extras={1: b"img"})
    assert NS.block_keys(IDS, block_extras={np.int64(1): b"img"}) == marked
    assert marked[:1] == NS.block_keys(IDS)[:1] and marked[1] != NS.block_keys(IDS)[1]
    parent = NS.block_keys(IDS)[0]
    assert NS.block_keys(IDS[4:], parent=bytearray(parent)) == NS.block_keys(IDS)[1:]
    assert Namespace.from_dict(NS.to_dict()) == NS


@pytest.fixture(params=["lmdb", "rocksdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    with ucm_db.open(tmp_path / "s", engine=request.param) as opened:
        opened.put(NS, NS.block_keys(IDS), [b"x" * 64] * 4)
        yield opened


@pytest.mark.parametrize("seq, limit, named", [("0", 10, "seq"), (0.0, 10, "seq"), (None, 10, "seq"), (-1, 10, "seq"),
                                               (True, 10, "seq"), (0, "10", "limit"), (0, 1.5, "limit")])
def test_changes_since_refuses_a_seq_or_limit_that_is_not_an_int(store: ucm_db.Store, seq: Any, limit: Any, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        store.changes_since(seq, limit)


def test_changes_since_still_reads_the_feed(store: ucm_db.Store) -> None:
    position = store.feed_position()
    assert store.changes_since(position, 10) == ucm_db.ChangeBatch((), position, False)
    assert store.changes_since(np.int64(position)).next_seq == position  # type: ignore[arg-type]
