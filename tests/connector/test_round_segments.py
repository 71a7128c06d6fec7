"""A writer round's chains as ``put_segments``' segments
(connector/worker/commit_route.py, issue 50 item 3): a chain that continues
one of an earlier job of the round (a request's next step, same head) is
appended to it, so a backlog of decode steps costs one segment a head and
request instead of one a job; a chain that continues a block inside an
earlier segment (a fork) stays a segment of its own. Every unit lands, with
its own bytes, in the round's one transaction.

A real store; the one wrapper counts the segments of each ``put_segments``
call and forwards it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ucm_db
from ucm_db.connector.worker.commit_route import CommitRoute
from ucm_db.connector.worker.writer import SaveJob
from ucm_db.keys.units import KVGrid, UnitKeys

UNIT_BYTES = 2048
GRID = KVGrid(heads=2, layers=1)
NS = ucm_db.Namespace(model="round-segments", kv_dtype="uint8", block_size=4, layout="units")


@pytest.fixture
def store(tmp_path):
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 << 30) as opened:
        yield opened


def _job(block_keys: list[bytes], start: int, stop: int, fill: int) -> SaveJob:
    chains = tuple(UnitKeys(block_keys, GRID, span, start, stop) for span in GRID.head_spans())
    staging = np.empty((stop - start, GRID.heads, UNIT_BYTES), np.uint8)
    for block in range(stop - start):
        for head in range(GRID.heads):
            staging[block, head] = (fill + 10 * block + head) % 251
    return SaveJob(NS, chains, torch.from_numpy(staging))


def test_a_rounds_continued_chains_are_one_segment_a_head_and_every_unit_lands(store) -> None:
    keys = NS.block_keys(list(range(20)))
    fork = NS.block_keys(list(range(8)) + [90 + t for t in range(12)])  # blocks 0-1 shared, then its own
    jobs = [_job(keys, 0, 2, 1), _job(keys, 2, 3, 2), _job(fork, 2, 4, 3), _job(keys, 3, 5, 4)]
    segments: list[int] = []
    real = store.put_segments

    def counted(namespace, given, **kwargs):  # type: ignore[no-untyped-def]
        segments.append(len(given))
        return real(namespace, given, **kwargs)

    store.put_segments = counted  # type: ignore[method-assign]
    route = CommitRoute(store, lambda row: ucm_db.Framed(row, (UNIT_BYTES,)), None, None, None)
    stored = route.put([(job, j) for job in jobs for j in range(GRID.heads)], None)
    # keys 0-5 one segment a head (three jobs), the fork (continuing block 1, inside it) its own.
    assert segments == [2 * GRID.heads]
    every = {key for job in jobs for chain in job.chains for key in chain}
    assert sorted(stored) == sorted(every) and len(stored) == len(every)
    for job in jobs:
        rows = job.staging.numpy()
        for j, chain in enumerate(job.chains):
            got = store.get(NS, list(chain))
            assert [bytes(g) for g in got] == [rows[i, j].tobytes() for i in range(len(chain))]  # type: ignore[arg-type]
