"""BlockEventFields' packing of vLLM's extra keys (record version 2): a
round trip of every allowed type, version 1 kept where there are none, and
malformed or hostile trailers refused as corrupt, never decoded further."""

from __future__ import annotations

import struct

import pytest

from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.events import BlockEventFields

BASE = dict(block_hash=b"h" * 32, parent_block_hash=b"p" * 32, token_ids=(1, 2, 3, 4), block_size=4)


def test_extra_keys_round_trip_and_plain_records_stay_version_1() -> None:
    fields = BlockEventFields(**BASE, lora_name="ad", extra_keys=("ad", ("img-7", 16), "salt", b"\x00\xff", 1.5))
    assert BlockEventFields.unpack(fields.pack()) == fields
    plain = BlockEventFields(**BASE)
    assert plain.pack()[0] == 1 and BlockEventFields.unpack(plain.pack()) == plain


@pytest.mark.parametrize("bad", [("x", object()), ("x", True), ["not", "a", "tuple"]])
def test_extra_keys_of_other_types_are_refused_at_pack(bad: object) -> None:
    with pytest.raises(ConfigError):
        BlockEventFields(**BASE, extra_keys=bad).pack()  # type: ignore[arg-type]


@pytest.mark.parametrize("trailer", [
    struct.pack("<I", 100) + b"[1]",          # length past the end
    struct.pack("<I", 3) + b"[1",             # not JSON
    struct.pack("<I", 7) + b'{"a":1}',        # not a list
    struct.pack("<I", 9) + b'[{"y":1}]',      # an object that is not bytes
    struct.pack("<I", 4) + b"[[[",            # cut
])
def test_a_malformed_trailer_is_corrupt(trailer: bytes) -> None:
    packed = BlockEventFields(**BASE, extra_keys=("a",)).pack()
    body = packed[: len(packed) - (4 + len(b'["a"]'))]
    with pytest.raises(CorruptBlockError):
        BlockEventFields.unpack(body + trailer)


def test_deep_nesting_is_corrupt_not_a_crash() -> None:
    packed = BlockEventFields(**BASE, extra_keys=("a",)).pack()
    body = packed[: len(packed) - (4 + len(b'["a"]'))]
    deep = b"[" * 60_000 + b"]" * 60_000
    with pytest.raises(CorruptBlockError):
        BlockEventFields.unpack(body + struct.pack("<I", len(deep)) + deep)
