"""Review of d287ae6's retried voids (connector/worker/voids.py): what a
failed void delete leaves served.

The writer's ``SaveVoids`` is driven as the writer drives it (begin_round,
stored, end_round, delete) over a real LMDB store. The failing delete is a
mock (a store wrapper whose ``delete`` raises TierError, as a full disk's
does): one void's delete failing while other writes go on cannot be made
with a real full disk."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.worker.voids import MAX_FAILED_VOIDS, SaveVoids, VoidJob, VoidTag  # noqa: E402
from ucm_db.errors import TierError  # noqa: E402

NS = ucm_db.Namespace(model="review-voids-retry", kv_dtype="bfloat16", block_size=4)
WRONG = b"\x11" * 4096


class FailingDeletes:
    """The store, but ``delete`` raises while ``failing`` (the mocked fault)."""

    def __init__(self, store: ucm_db.Store) -> None:
        self.store, self.failing = store, True

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        if self.failing:
            raise TierError("No space left on device (mocked)")
        return self.store.delete(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def save_round(voids: SaveVoids, store: ucm_db.Store, save: tuple[str, bytes, int], step: int,
               chain: list[bytes], payload: bytes) -> None:
    """One writer round holding one voidable save of ``chain``."""
    voids.begin_round(True)
    tag = VoidTag(save, step)
    voids.stored(store.put(NS, chain, [payload] * len(chain)).stored_keys, SimpleNamespace(void_tag=tag))
    voids.end_round([(tag, (tuple(chain),))])


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with ucm_db.open(tmp_path / "s", codec="none") as opened:
        yield opened


def test_a_second_failed_void_of_the_same_save_keeps_the_first_ones_units(store: ucm_db.Store) -> None:
    chain = NS.block_keys(list(range(12)))
    save = ("req-1", chain[0], 3)
    flaky = FailingDeletes(store)
    voids = SaveVoids(flaky)  # type: ignore[arg-type]
    save_round(voids, store, save, 1, chain, WRONG)
    voids.delete(VoidJob(NS, save, 3, step=2))  # fails: kept with its units (chain[0] and descendants)
    store.delete(NS, chain[2:])  # the tail evicted meanwhile (eviction takes chain tails first)
    save_round(voids, store, save, 3, chain, WRONG)  # the same save again (recomputed after a preemption): stores chain[2]
    voids.delete(VoidJob(NS, save, 3, step=4))  # fails again: now kept with chain[2] only
    flaky.failing = False
    voids.begin_round(False)  # the retry
    assert store.lookup(NS, chain) == 0, "voided units of the first save stay stored for good"


def test_a_void_given_up_after_many_failures_leaves_no_voided_units(store: ucm_db.Store) -> None:
    flaky = FailingDeletes(store)
    voids = SaveVoids(flaky)  # type: ignore[arg-type]
    chains = [NS.block_keys(list(range(1000 * i, 1000 * i + 4))) for i in range(MAX_FAILED_VOIDS + 1)]
    for i, chain in enumerate(chains):
        save = (f"req-{i}", chain[0], 1)
        save_round(voids, store, save, 2 * i, chain, WRONG)
        voids.delete(VoidJob(NS, save, 1, step=2 * i + 1))
    flaky.failing = False
    voids.begin_round(False)
    assert store.lookup(NS, chains[0]) == 0, "the first void was given up: its voided unit is served for good"
