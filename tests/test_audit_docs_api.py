"""docs/api.md's promises, each bullet held on a real LMDB store:

* the error classes and the builtins they are, each with a ``hint``;
* "Arguments are checked before anything is written": every kind of bad
  argument the bullet lists is a ``ConfigError`` naming the fix, and the
  store holds what it held; iterators and generators are read, not lost;
* "The store path is checked before anything is created";
* the chain rules (a ``BlockKeys`` slice knows its parent, a plain list
  must say it), first writer wins, namespaces never mix, a delete takes
  descendants, epochs key new chains apart;
* ``get_into``: a plain buffer needs only room (tail kept, flag True),
  slabs must fit exactly (else a miss); ``Framed`` and ``codec_name``
  store the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError

NS = ucm_db.Namespace(model="audit/api", kv_dtype="bfloat16", block_size=4)
OTHER = ucm_db.Namespace(model="audit/api-other", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(40)))  # 10 blocks
DATA = [bytes([i + 1]) * 4096 for i in range(10)]

#: api.md, "Errors": class -> the builtin (or ucm-db parent) it is.
ERRORS = {
    "ConfigError": ValueError, "TierError": OSError, "StoreFullError": ucm_db.TierError, "LockedError": ucm_db.TierError,
    "DamagedPageError": ucm_db.TierError, "DamagedRecordError": ucm_db.TierError, "MissingAncestorError": ucm_db.UcmDbError,
    "CorruptBlockError": ValueError, "FormatVersionError": ucm_db.UcmDbError, "MigrationError": ucm_db.UcmDbError,
    "ClosedError": ucm_db.UcmDbError, "CommitProcessError": ucm_db.UcmDbError,
}


def test_every_documented_error_is_a_ucm_db_error_of_the_stated_kind_with_a_hint() -> None:
    from ucm_db.remote.warming import RemoteEpochUnknownError

    wrong = [name for name, base in ERRORS.items()
             if not (issubclass(getattr(ucm_db, name), ucm_db.UcmDbError) and issubclass(getattr(ucm_db, name), base))]
    assert not wrong
    assert issubclass(RemoteEpochUnknownError, ucm_db.TierError)  # "(a `TierError`)"
    assert ucm_db.ConfigError("x", hint="do y").hint == "do y"


def _store(tmp_path: Path) -> ucm_db.Store:
    store = ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20)
    store.put(NS, KEYS[:2], DATA[:2])
    return store


def _bad_calls(store: ucm_db.Store) -> list[tuple[str, Callable[[], Any], str]]:
    """(what api.md lists, the call, a fragment of the error) of each refused argument."""
    new = OTHER.block_keys(list(range(8)))
    return [
        ("token id >= 2**32", lambda: NS.block_keys([2**32] * 4), "< 2**32"),
        ("negative token id", lambda: NS.block_keys([-1] * 4), "non-negative"),
        ("numpy id >= 2**32", lambda: NS.block_keys(np.full(4, 2**32, np.int64)), "< 2**32"),
        ("2-D array", lambda: NS.block_keys(np.zeros((2, 4), np.int64)), "1-D"),
        ("non-integer array", lambda: NS.block_keys(np.zeros(4, np.float32)), "integers"),
        ("bool array", lambda: NS.block_keys(np.zeros(4, bool)), "integers"),
        ("first id a bool", lambda: NS.block_keys([True, 1, 2, 3]), "bools"),
        ("last id a bool", lambda: NS.block_keys([1, 2, 3, False]), "bools"),
        ("str", lambda: NS.block_keys("abcd"), "str"),
        ("bytes", lambda: NS.block_keys(b"abcd"), "bytes"),
        ("str payload", lambda: store.put(OTHER, new[:1], ["abc"]), "bytes-like"),
        ("None payload", lambda: store.put(OTHER, new[:1], [None]), "bytes-like"),
        ("strided payload", lambda: store.put(OTHER, new[:1], [np.zeros(16, np.uint8)[::2]]), "C-contiguous"),
        ("dtype=object payload", lambda: store.put(OTHER, new[:1], [np.array([1, 2], dtype=object)]), "object"),
        ("datetime64 payload", lambda: store.put(OTHER, new[:1], [np.zeros(2, "datetime64[s]")]), "datetime64"),
        ("malformed key", lambda: store.put(OTHER, [b"short"], [b"x"], parent=None), "32 bytes"),
        ("malformed parent", lambda: store.put(OTHER, new[1:2], [b"x"], parent=b"abc"), "parent"),
        ("plain key list without parent=", lambda: store.put(OTHER, list(new), [b"x", b"y"]), "parent="),
        ("keys of another namespace", lambda: store.put(OTHER, KEYS[:2], DATA[:2]), "audit/api"),
        ("too small get_into buffer", lambda: store.get_into(NS, KEYS[:1], [bytearray(10)]), "smaller"),
    ]


def test_bad_arguments_are_config_errors_naming_the_fix_and_write_nothing(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        before = store.stats().to_dict()
        wrong = []
        for what, call, fragment in _bad_calls(store):
            try:
                call()
            except ConfigError as exc:
                if fragment not in str(exc) or not exc.hint:
                    wrong.append((what, str(exc)))
            else:
                wrong.append((what, "not refused"))
        assert not wrong, wrong
        after = store.stats().to_dict()
        assert (after["blocks"], after["stored_bytes"], sorted(after["namespaces"])) == (
            before["blocks"], before["stored_bytes"], sorted(before["namespaces"]))
        # "A bool in the middle of a list is taken as the id 0 or 1"; iterators and generators are read.
        assert NS.block_keys([5, True, 2, 3]) == NS.block_keys([5, 1, 2, 3])
        assert NS.block_keys(i for i in range(40)) == KEYS
        assert store.lookup(NS, iter(KEYS)) == 2 and len(store.get(NS, iter(KEYS[:3]))) == 3


@pytest.mark.parametrize(("path", "fragment"), [
    ("", "empty"), (b"/tmp/x", "str or os.PathLike"), (None, "str or os.PathLike"),
    ("NAME" * 64, "this file system allows"), ("STORE/lmdb", "lies inside"), ("STORE/a/b", "lies inside"),
])
def test_the_store_path_is_checked_before_anything_is_created(tmp_path: Path, path: Any, fragment: str) -> None:
    ucm_db.open(tmp_path / "s").close()
    if isinstance(path, str):
        path = str(tmp_path / path.replace("STORE", "s")) if path else path
    listing = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=fragment):
        ucm_db.open(path)
    assert sorted(p for p in tmp_path.rglob("*")) == listing


def test_the_chain_namespace_and_epoch_promises(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        with pytest.raises(ucm_db.MissingAncestorError):  # a slice knows its parent: KEYS[2] is not stored
            store.put(NS, KEYS[3:], DATA[3:])
        assert store.put(NS, KEYS[2:], DATA[2:]).stored == 8  # no parent= needed
        first = store.put(NS, KEYS[:3], [b"other"] * 3)  # "The first writer wins"
        assert (first.stored, first.already_present, first.stored_keys) == (0, 3, [])
        assert store.lookup(OTHER, KEYS) == 0 and store.get(OTHER, KEYS[:1]) == [None]  # namespaces never mix
        assert store.get_into(OTHER, KEYS[:1], [bytearray(4096)]) == [False]
        assert store.delete(OTHER, KEYS[:1]) == 0  # "it counts as not removed"
        assert store.delete(NS, KEYS[6:7]) == 4  # "removes blocks and their descendants"
        assert store.lookup(NS, KEYS) == 6
        assert NS.block_keys(list(range(40)), epoch=0) == KEYS  # "Epoch 0 (never bumped) gives the keys ..."
        assert store.bump_epoch(NS) == store.epoch(NS) == 1
        assert store.lookup(NS, NS.block_keys(list(range(40)), epoch=store.epoch(NS))) == 0  # "find nothing stored before"
    with pytest.raises(ucm_db.ClosedError):  # "every call on a closed store"
        store.lookup(NS, KEYS)


def test_get_into_buffers_slabs_frames_and_codecs(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        roomy = [bytearray(b"\xee" * 5000) for _ in range(2)]  # "a buffer needs only room for the block"
        assert store.get_into(NS, KEYS[:2], roomy) == [True, True]
        assert [bytes(b[:4096]) for b in roomy] == DATA[:2] and all(b[4096:] == b"\xee" * 904 for b in roomy)
        parts = [[bytearray(1000), bytearray(3096)] for _ in range(2)]  # a scatter list fills in order
        assert store.get_into(NS, KEYS[:2], parts) == [True, True]
        assert [bytes(a + b) for a, b in parts] == DATA[:2]
        views = [np.zeros((4, 2048), np.uint8) for _ in range(2)]
        slabs = ucm_db.ScatterSlabs([memoryview(v).cast("B") for v in views], [2048, 2048], [3, 1])
        assert store.get_into(NS, KEYS[:2], slabs) == [True, True]  # key i fills slab indices[i] of each view
        assert bytes(views[0][3]) + bytes(views[1][3]) == DATA[0]
        out = bytearray(slabs.row_bytes * 2)
        slabs.gather_into(out)
        assert bytes(out) == b"".join(DATA[:2])
        small = ucm_db.ScatterSlabs([memoryview(v).cast("B") for v in views], [1024, 1024], [0, 1])
        assert store.get_into(NS, KEYS[:2], small) == [False, False]  # "one of another size is a miss"
        framed = np.frombuffer(bytes(range(256)) * 32, np.uint8)
        more = NS.block_keys(list(range(40, 48)))
        store.put(NS, more[:1], [ucm_db.Framed(framed, (1024,) * 8)], codec_name="none")
        store.put(NS, more[1:], [[framed[:4096].tobytes(), framed[4096:].tobytes()]], codec_name="zstd")
        assert [bytes(b) for b in store.get(NS, more)] == [framed.tobytes()] * 2  # type: ignore[arg-type]


def test_a_rocksdb_store_has_one_opener(tmp_path: Path) -> None:
    """docs/cli.md, "RocksDB engine": "a second opener gets `LockedError`"."""
    with ucm_db.open(tmp_path / "r", engine="rocksdb", capacity_bytes=64 << 20):
        with pytest.raises(ucm_db.LockedError) as info:
            ucm_db.open(tmp_path / "r")
        assert "LMDB" in info.value.hint
