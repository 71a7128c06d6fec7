"""``_native.plan_units``: a chunk of a read's units planned in one call (ucm_db.codec.batch_loads).

* Over valid and damaged heads (another owner, a body cut short, a wrong
  magic, version, frame count or head length, a frame table not known raw,
  zstd frames too large for the caller's thread), absent blocks, blocks of
  another namespace and blocks written with the head before the body, the
  plan gives exactly the kind and checksum the per-unit Python path gives:
  ``with_blocks``'s checks, then ``raw_loads.batch_checksum`` (0 wherever
  that path would not hand the unit to the native load).
* ``load_units`` neither reads nor pins a unit planned 0: its head and body
  may be None.
* ``Store.get_into`` into slabs reads in chunks of ``FLUSH_UNITS`` and a
  unit the plan leaves to the Python path (a block of another namespace, a
  table not seen yet) is still decided there.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db.codec import batch_loads, native, raw_loads
from ucm_db import codec
from ucm_db.codec.header import CHECKSUM_OFFSET, HEADER_BYTES, RAW_TABLES
from ucm_db.codec.slabs import ScatterSlabs
from ucm_db.index.entries import META, body_of
from ucm_db.index.reads import in_namespace

pytestmark = pytest.mark.skipif(not batch_loads.AVAILABLE, reason="the native batch path is not built (see test_native.py)")

SLAB = 4096
NS_ID, OTHER_NS_ID = bytes(range(16)), bytes(16)
FORMAT = batch_loads._FORMAT  # noqa: SLF001 - the constants the module passes


def _python_plan(key: bytes, stored: bytes | None, head: bytes | None, meta: bytes | None, below: int | None) -> tuple[int, int]:
    """The per-unit path's verdict: (kind, checksum), 0 where it would not
    reach the native load with the whole stored value as the body."""
    if stored is None or not in_namespace(meta, NS_ID):  # the per-unit path's own check
        return 0, 0
    head_view = memoryview(head or b"")
    body = body_of(head_view, memoryview(stored))
    if len(body) != len(stored):
        return 0, 0
    checked = raw_loads.batch_checksum(head_view, len(body), key, below)
    if checked is None:
        return 0, 0
    return (2 if checked[0] else 1), checked[1]


def _cases() -> list[tuple[str, bytes, bytes | None, bytes | None, bytes | None]]:
    key, other = os.urandom(32), os.urandom(32)
    raw = os.urandom(2 * SLAB)
    head, body = (bytes(p) for p in codec.split(codec.encode(key, [raw[:SLAB], raw[SLAB:]], codec="none")))
    codec.decode(head + body, key)  # the codec's path learns the table
    zhead, zbody = (bytes(p) for p in codec.split(codec.encode(key, [raw], codec="zstd", element_bytes=2)))
    meta = NS_ID + bytes(META.size - len(NS_ID))

    def patched(at: int, fmt: str, value: int) -> bytes:
        out = bytearray(head)
        struct.pack_into(fmt, out, at, value)
        return bytes(out)

    unknown_table = bytearray(head)
    unknown_table[HEADER_BYTES + 1] ^= 0x01  # a frame table never seen raw
    return [
        ("raw", key, body, head, meta),
        ("zstd", key, zbody, zhead, meta),
        ("absent", key, None, None, None),
        ("no head", key, body, None, meta),
        ("no meta", key, body, head, None),
        ("another namespace", key, body, head, OTHER_NS_ID + bytes(META.size - len(NS_ID))),
        ("a meta of the wrong length", key, body, head, NS_ID + bytes(40)),
        ("a short meta", key, body, head, NS_ID[:8]),
        ("another owner", other, body, head, meta),
        ("body cut short", key, body[:-1], head, meta),
        ("body too long", key, body + b"x", head, meta),
        ("zstd body cut short", key, zbody[:-1], zhead, meta),
        ("zstd of another owner", other, zbody, zhead, meta),
        ("head before body", key, head + body, head, meta),
        ("wrong magic", key, body, b"XCMB" + head[4:], meta),
        ("wrong version", key, body, patched(4, "<H", 9), meta),
        ("frames past the head", key, body, patched(8, "<I", 3), meta),
        ("raw length off", key, body, patched(12, "<Q", len(body) + 1), meta),
        ("head cut short", key, body, head[:-1], meta),
        ("head only a header", key, body, head[:HEADER_BYTES], meta),
        ("unknown table", key, body, bytes(unknown_table), meta),
    ]


@pytest.mark.parametrize("below", [None, 1, 1 << 20])
def test_the_plan_gives_the_kind_and_checksum_of_the_per_unit_path(below: int | None) -> None:
    cases = _cases()
    keys = [c[1] for c in cases]
    stored, heads, metas = [c[2] for c in cases], [c[3] for c in cases], [c[4] for c in cases]
    kinds, checksums = native.extension().plan_units(keys, stored, heads, metas, NS_ID, RAW_TABLES,
                                                     -1 if below is None else below, FORMAT)
    for i, (name, key, s, h, m) in enumerate(cases):
        expected_kind, expected_sum = _python_plan(key, s, h, m, below)
        got_sum = int.from_bytes(checksums[8 * i : 8 * i + 8], "little")
        assert (kinds[i], got_sum) == (expected_kind, expected_sum), name
    # the cases cover every verdict: raw, shuffled (given room), and declined
    assert kinds[0] == 1 and int.from_bytes(checksums[:8], "little") == int.from_bytes(
        cases[0][3][CHECKSUM_OFFSET:HEADER_BYTES], "little")
    assert kinds[1] == (0 if below == 1 else 2)
    assert sum(1 for k in kinds if k == 0) >= len(cases) - 2


def test_without_a_namespace_check_metas_may_be_none_and_bad_input_is_refused() -> None:
    (_, key, body, head, _meta) = _cases()[0]
    ext = native.extension()
    kinds, _ = ext.plan_units([key], [body], [head], None, b"", RAW_TABLES, -1, FORMAT)
    assert kinds == b"\x01"
    with pytest.raises(ValueError, match="one entry per unit"):
        ext.plan_units([key, key], [body], [head], None, b"", RAW_TABLES, -1, FORMAT)
    with pytest.raises(TypeError, match="must be lists"):
        ext.plan_units((key,), [body], [head], None, b"", RAW_TABLES, -1, FORMAT)
    with pytest.raises(ValueError, match="magic"):
        ext.plan_units([key], [body], [head], None, b"", RAW_TABLES, -1, (b"UC",) + FORMAT[1:])


def test_load_units_leaves_a_unit_planned_zero_unread() -> None:
    (_, key, body, head, _meta) = _cases()[0]
    ext = native.extension()
    kinds, checksums = ext.plan_units([key, key], [body, None], [head, None], None, b"", RAW_TABLES, -1, FORMAT)
    assert kinds == b"\x01\x00"
    layers = [bytearray(2 * SLAB) for _ in range(2)]
    state = bytearray(10)
    ext.load_units([memoryview(head), None], [memoryview(body), None], kinds, checksums,
                   tuple(memoryview(layer) for layer in layers), (SLAB, SLAB), [0, 1], state, 1, 1 << 16)
    assert list(state[8:]) == [1, 3]  # the planned unit loaded, the other declined without being read
    assert bytes(layers[0][:SLAB]) + bytes(layers[1][:SLAB]) == bytes(body)


def test_get_into_reads_in_chunks_and_leaves_what_the_plan_declines_to_the_python_path(tmp_path: Path) -> None:
    ns = ucm_db.Namespace(model="batch-plan", kv_dtype="bfloat16", block_size=1, layout="units")
    foreign = ucm_db.Namespace(model="batch-plan-other", kv_dtype="bfloat16", block_size=1, layout="units")
    units = 3 * batch_loads.FLUSH_UNITS + 5  # several chunks and a short one
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, 2 * SLAB, dtype=np.uint8).tobytes() for _ in range(units)]
    keys = ns.block_keys(list(range(units)))
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 30) as store:
        store.put(ns, keys, [ucm_db.Framed(p, (SLAB, SLAB)) for p in payloads])
        other_keys = foreign.block_keys(list(range(4)))
        store.put(foreign, other_keys, [ucm_db.Framed(p, (SLAB, SLAB)) for p in payloads[:4]])
        asked = keys[:70] + other_keys[:2] + keys[70:]  # two units of another namespace inside a chunk
        RAW_TABLES.clear()  # the first read meets a table not seen yet: the Python path decides it
        layers = [np.zeros((len(asked), SLAB), np.uint8) for _ in range(2)]
        slabs = ScatterSlabs(layers, [SLAB, SLAB], range(len(asked)))
        for _ in range(2):  # the second read is planned natively throughout
            for layer in layers:
                layer[:] = 0
            got = store.get_into(ns, asked, slabs)
            assert got == [True] * 70 + [False, False] + [True] * (units - 70)
            expected = payloads[:70] + [bytes(2 * SLAB)] * 2 + payloads[70:]
            assert [layers[0][i].tobytes() + layers[1][i].tobytes() for i in range(len(asked))] == expected
