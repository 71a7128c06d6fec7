"""Malformed arguments to the public store API raise ConfigError (the
package's own hierarchy) naming the problem, and lose nothing stored: a
wrong namespace object, a BlockKeys with a malformed parent, a segment that
is not a (keys, payloads) pair, a non-bytes key amid a lookup's keys."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import ucm_db
from ucm_db import BlockKeys, ConfigError, Framed, Namespace
from ucm_db.keys.units import KVGrid

NS = Namespace(model="bad-input", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(16)))  # 4 blocks
PAYLOADS = [bytes([i]) * 256 for i in range(4)]
GRID = KVGrid(2, 4)

CALLS: dict[str, Callable[[Any], Any]] = {
    "put, namespace None": lambda s: s.put(None, KEYS, PAYLOADS),
    "put_segments, namespace str": lambda s: s.put_segments("model", [(KEYS, PAYLOADS)]),
    "get, namespace None": lambda s: s.get(None, KEYS),
    "get, namespace str": lambda s: s.get("model", KEYS),
    "get_into, namespace None": lambda s: s.get_into(None, KEYS, [bytearray(256)] * 4),
    "lookup, namespace None": lambda s: s.lookup(None, KEYS),
    "delete, namespace None": lambda s: s.delete(None, KEYS),
    "warm, namespace None": lambda s: s.warm(None, keys=[KEYS]),
    # Audit F10: a TypeError before ('int' object is not iterable; a generator was not subscriptable).
    "warm, keys an int": lambda s: s.warm(NS, keys=5),  # type: ignore[arg-type]
    "warm, a bare key": lambda s: s.warm(NS, keys=KEYS[0]),
    "warm, a chain of ints": lambda s: s.warm(NS, keys=[[1, 2]]),  # type: ignore[list-item]
    "warm, a generator of short keys": lambda s: s.warm(NS, keys=(k[:8] for k in KEYS)),
    "put, BlockKeys parent int": lambda s: s.put(NS, BlockKeys(list(KEYS), parent=5), PAYLOADS),  # type: ignore[arg-type]
    "put, BlockKeys parent short": lambda s: s.put(NS, BlockKeys(list(KEYS), parent=b"short"), PAYLOADS),
    "put_segments, BlockKeys parent str": lambda s: s.put_segments(NS, [(BlockKeys(list(KEYS), parent="p"), PAYLOADS)]),  # type: ignore[arg-type]
    "put_segments, not pairs": lambda s: s.put_segments(NS, [b"abc"]),
    "put_segments, a triple": lambda s: s.put_segments(NS, [(KEYS, PAYLOADS, None)]),
    "put_segments, None": lambda s: s.put_segments(NS, None),
    # A key twice in one chain: the second copy named the first its parent and its payload was dropped.
    "put, a key repeated": lambda s: s.put(NS, [KEYS[0], KEYS[0]], PAYLOADS[:2], parent=None),
    "put_segments, a key repeated in a chain": lambda s: s.put_segments(NS, [(BlockKeys([KEYS[0], KEYS[0]], parent=None), PAYLOADS[:2])]),
    # The binary search must read a middle key: the last one is not stored.
    "lookup, ints amid the keys": lambda s: s.lookup(NS, [KEYS[0], 5, 6, bytes(32)]),
    # Issue 26 item 14: raw ValueError / TypeError before.
    "put, datetime64 payload": lambda s: s.put(NS, KEYS, [np.zeros(32, dtype="datetime64[s]")] * 4),
    "put, timedelta64 frame in a list": lambda s: s.put(NS, KEYS, [[np.zeros(32, dtype="timedelta64[ns]")]] * 4),
    "get_into, datetime64 buffer": lambda s: s.get_into(NS, KEYS, [np.zeros(32, dtype="datetime64[s]")] * 4),
    "put, Framed with an int for frame_bytes": lambda s: s.put(NS, KEYS, [Framed(b"x" * 256, 2)] * 4),  # type: ignore[arg-type]
    "put, Framed over a datetime64 array": lambda s: s.put(NS, KEYS, [Framed(np.zeros(32, dtype="datetime64[s]"), (256,))] * 4),
    # Audit F18: an AttributeError ('int' object has no attribute 'check' / 'head_stop') before.
    "lookup_many, grid an int": lambda s: s.lookup_many(NS, [KEYS], grid=0, spans=[(0, 1)]),  # type: ignore[arg-type]
    "lookup_many, a span a tuple": lambda s: s.lookup_many(NS, [KEYS], grid=GRID, spans=[(0, 5)]),  # type: ignore[list-item]
    "lookup_many, spans a str": lambda s: s.lookup_many(NS, [KEYS], grid=GRID, spans="ab"),  # type: ignore[arg-type]
    "pin, grid an int": lambda s: s.pin(NS, [KEYS], grid=3, spans=[(0, 1)]),  # type: ignore[arg-type]
    "pin, a span None": lambda s: s.pin(NS, [KEYS], grid=GRID, spans=[None]),  # type: ignore[list-item]
    "unpin, spans an int": lambda s: s.unpin(NS, [KEYS], grid=GRID, spans=5),  # type: ignore[arg-type]
    "unpin, grid a span": lambda s: s.unpin(NS, [KEYS], grid=GRID.whole, spans=[GRID.whole]),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_malformed_argument_is_a_config_error_and_loses_nothing(tmp_path, engine: str, call: str) -> None:
    with ucm_db.open(tmp_path / "s", engine=engine) as store:
        store.put(NS, KEYS, PAYLOADS)
        with pytest.raises(ConfigError) as raised:
            CALLS[call](store)
        assert raised.value.hint, "the error says how to fix it"
        assert store.get(NS, KEYS) == PAYLOADS
        assert store.lookup(NS, KEYS) == 4 and store._tier.check() == []


def test_an_error_crosses_a_process_boundary_as_its_public_class_with_message_and_hint() -> None:
    """UcmDbError.to_dict / error_from_dict: the one way errors cross to the commit process and the
    isolated maintenance child; a subclass defined outside ucm_db.errors travels as its public class."""
    from ucm_db.errors import DamagedRecordError, UcmDbError, error_from_dict
    from ucm_db.index.namespace_guard import ForeignNamespaceError
    from ucm_db.store.epochs import EpochUnknownError

    for error, public in ((ForeignNamespaceError("put refused", hint="use its namespace"), ConfigError),
                          (EpochUnknownError("no epoch", hint="invalidate it"), DamagedRecordError),
                          (ConfigError("bad option"), ConfigError)):
        again = error_from_dict(error.to_dict())
        assert type(again) is public and str(again) == str(error) and again.hint == error.hint
        assert again.message == error.message and "(hint:" not in again.message
    assert type(error_from_dict({"type": "Exception", "message": "m"})) is UcmDbError
    assert type(error_from_dict("junk")) is UcmDbError
