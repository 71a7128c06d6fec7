"""Codec ``none`` of staged units without the codec's per-block layers
(issue 50 item 3: the in-engine writer's CPU per saved unit): the head
:func:`ucm_db.codec.encoding.seal_framed_raw` seals is byte for byte what
``encode_parts`` gives, and a put of :class:`ucm_db.Framed` units stores
blocks that read back and verify; :class:`Framed` checks a frame-length
tuple in full once, and only the very tuple it checked skips the checks
afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ucm_db
from ucm_db import codec
from ucm_db.codec import encoding
from ucm_db.codec.encoding import Framed, encode_parts, seal_framed_raw
from ucm_db.errors import ConfigError

NS = ucm_db.Namespace(model="framed-seal", kv_dtype="bfloat16", block_size=4)


@settings(max_examples=150, deadline=None)
@given(frames=st.lists(st.integers(0, 3000), min_size=1, max_size=12), keys=st.lists(st.binary(min_size=32, max_size=32), min_size=2, max_size=3),
       data=st.data())
def test_the_sealed_head_is_the_codecs_byte_for_byte(frames: list[int], keys: list[bytes], data: st.DataObject) -> None:
    frame_bytes = tuple(frames)
    for key in keys:  # the first seal of these lengths goes through encode_parts, the others are cached
        payload = np.frombuffer(data.draw(st.binary(min_size=sum(frames), max_size=sum(frames))), np.uint8)
        framed = Framed(payload, frame_bytes)
        head, body = seal_framed_raw(key, framed)
        expected = encode_parts(key, framed, codec="none")
        assert head == expected.head
        assert bytes(body) == payload.tobytes() and body.nbytes == expected.raw_len
        assert codec.verify(head + bytes(body), key).codec == "none"


def test_a_key_that_is_no_32_byte_bytes_is_refused_or_sealed_as_the_codec_does() -> None:
    framed = Framed(np.zeros(16, np.uint8), (8, 8))
    seal_framed_raw(b"k" * 32, framed)  # the lengths cached
    assert seal_framed_raw(bytearray(b"k" * 32), framed)[0] == encode_parts(bytearray(b"k" * 32), framed, codec="none").head
    with pytest.raises(ConfigError):
        seal_framed_raw(b"short", framed)


def test_only_the_tuple_checked_skips_the_frame_checks() -> None:
    buffer = np.zeros(8, np.uint8)
    checked = (4, 4)
    Framed(buffer, checked)  # checked in full: remembered
    assert encoding._FRAME_TOTALS[id(checked)] == (checked, 8)
    for bad in ((True, 7), (4.0, 4), (-4, 12)):  # equal sums, an equal tuple among them: each checked in full
        with pytest.raises(ConfigError):
            Framed(buffer, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Framed(np.zeros(9, np.uint8), checked)  # the remembered tuple, another buffer's length
    with pytest.raises(ConfigError):
        Framed(np.zeros((4, 4), np.uint8)[:, :2], checked)  # the remembered tuple, a strided buffer


def test_a_put_of_framed_units_reads_back(tmp_path) -> None:
    keys = NS.block_keys(list(range(12)))
    units = [np.full(3 * 1024, i + 1, np.uint8) for i in range(3)]
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put_segments(NS, [(keys, [Framed(u, (1024, 2048)) for u in units])])
        store.put_segments(NS, [(NS.block_keys(list(range(16)))[3:], [Framed(units[0], (1024, 2048)), ])])
        assert [bytes(b) for b in store.get(NS, list(keys))] == [u.tobytes() for u in units]  # type: ignore[arg-type]
        assert store.lookup(NS, NS.block_keys(list(range(16)))) == 4
