"""Hypothesis state machine: the store against a plain dict model.

The model keeps, per chain, how many leading blocks are stored. Capacity is
large enough that nothing is evicted, so the store must agree exactly.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ucm_db
from ucm_db import MissingAncestorError, Namespace

NS = Namespace(model="sm", kv_dtype="bfloat16", block_size=2)
CHAINS = [[c * 1000 + i for i in range(16)] for c in range(3)]
KEYS = [NS.block_keys(tokens) for tokens in CHAINS]


def payload(chain: int, block: int) -> bytes:
    return bytes([chain, block]) * (50 + block)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.store = ucm_db.open(self.dir, capacity_bytes=64 << 20, codec="zstd")
        self.stored = [0, 0, 0]  # leading blocks stored per chain

    @rule(chain=st.integers(0, 2), start=st.integers(0, 7), count=st.integers(1, 4))
    def put(self, chain: int, start: int, count: int) -> None:
        keys = KEYS[chain][start : start + count]
        parent = KEYS[chain][start - 1] if start else None
        data = [payload(chain, start + i) for i in range(len(keys))]
        if start > self.stored[chain]:
            try:
                self.store.put(NS, keys, data, parent=parent)
            except MissingAncestorError:
                return
            raise AssertionError("put with a missing parent succeeded")
        self.store.put(NS, keys, data, parent=parent)
        self.stored[chain] = max(self.stored[chain], start + len(keys))

    @rule(chain=st.integers(0, 2), block=st.integers(0, 7))
    def delete(self, chain: int, block: int) -> None:
        removed = self.store.delete(NS, [KEYS[chain][block]])
        assert removed == max(0, self.stored[chain] - block)
        self.stored[chain] = min(self.stored[chain], block)

    @precondition(lambda self: any(self.stored))
    @rule(chain=st.integers(0, 2))
    def get(self, chain: int) -> None:
        got = self.store.get(NS, KEYS[chain][:8])
        for i, value in enumerate(got):
            if i < self.stored[chain]:
                assert bytes(value) == payload(chain, i)
            else:
                assert value is None

    @invariant()
    def lookups_agree(self) -> None:
        for chain in range(3):
            assert self.store.lookup(NS, KEYS[chain][:8]) == self.stored[chain]
        assert self.store.stats().blocks == sum(self.stored)

    def teardown(self) -> None:
        assert self.store._tier.check() == []
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
