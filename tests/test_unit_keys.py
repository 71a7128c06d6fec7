"""Unit keys are permanent: every stored unit is named by one, so the answers
of ``unit_key``, ``unit_keys_of`` and ``UnitKeys`` are pinned here, and the
three agree with each other and with the documented formula
``BLAKE2b-256(block key || span tag, person="ucm-db/unit")``."""

from __future__ import annotations

import hashlib

from ucm_db.keys.units import KVGrid, UnitKeys, UnitSpan, unit_key, unit_keys_of

GRID = KVGrid(heads=4, layers=8)
SPANS = [UnitSpan(1, 2, 0, 8), UnitSpan(0, 4, 0, 4), GRID.whole]
#: unit_keys_of(_block_keys(), SPANS, GRID), block-major, as first released.
KNOWN = [
    "95b255fb305464e312ab1038e0fb6f84948f6f956a6419debb1f5c21c18c02d6",
    "c04da22c04c180eab9d32df4adbc79a396b8f3920f1e43ca3a28bd760076febc",
    "206d5d686e15b2679e791144b9881eccc917de6a46c306ac7ebbcd98e7b3f1c7",
    "32c956b7cd2197671db8c4f5525a0c914a40330f0b211baebcedbd006533709f",
    "ea6afcd20fe937539443c64c4b464ddea4820fc503878115af4c4803fcba30f7",
    "36a70910a8069a7421ce325bc2fba424b902630c5085c2c288f19bb3024efa69",
    "faf636d6b6c3725bd9636f89f96c021c4b94661089ac2a0fb842f8cf28f331e6",
    "81221e6505ca63ba7c763e9d9986523c5e1308983a1f6adea1b9b4fe9a0b7e72",
    "bc805c3ab0834395012360301eeb7af8b1ec1eb1f4ca108a46de45b05d3ebdb6",
]
KNOWN_LAST_HEAD_LATE_LAYERS = "cc75dca2cfde6b87f0b068e6d41048bed340af08872ac248d0bcebfd67c43740"


def _block_keys() -> list[bytes]:
    keys = [hashlib.blake2b(b"ucm-db known unit", digest_size=32).digest()]
    for _ in range(2):
        keys.append(hashlib.blake2b(keys[-1], digest_size=32).digest())
    return keys


def test_known_unit_keys_are_unchanged() -> None:
    keys = _block_keys()
    assert [k.hex() for k in unit_keys_of(keys, SPANS, GRID)] == KNOWN
    assert unit_key(keys[2], UnitSpan(3, 4, 4, 8), GRID).hex() == KNOWN_LAST_HEAD_LATE_LAYERS


def test_the_three_derivations_agree_with_the_formula() -> None:
    keys = _block_keys()
    spans = GRID.head_spans() + GRID.head_spans((2, 6)) + [GRID.whole]
    batch = unit_keys_of(keys, spans, GRID)
    for i, block_key in enumerate(keys):
        for j, span in enumerate(spans):
            if span == GRID.whole:
                expected = block_key
            else:
                expected = hashlib.blake2b(block_key + span.tag(), digest_size=32, person=b"ucm-db/unit").digest()
            assert batch[i * len(spans) + j] == expected
            assert unit_key(block_key, span, GRID) == expected
            assert UnitKeys(keys, GRID, span)[i] == expected
    # Repeated calls share no hasher state.
    assert unit_keys_of(keys, spans, GRID) == batch
    assert unit_keys_of([], spans, GRID) == []
