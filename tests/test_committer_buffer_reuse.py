"""ucm_db.committer: a dropped shared buffer is never located, so no put
names a buffer the child was told to forget (the worker audit's F3: the
kernel maps the next buffer into the dropped one's hole, ``locate`` named
the dropped id, the same request sent FORGET of it and then the PUT, and
the child answered KeyError: the writer's whole round was lost)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np

import ucm_db
from ucm_db.committer import CommitProcess, SharedBuffer, SharedChain

NS = ucm_db.Namespace(model="committer-reuse-test", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 8 << 20, "codec": "none"}
UNIT_BYTES = 4096
BLOCKS = 64  # 256 KiB: past malloc's mmap threshold, so only shared buffers take the hole


def _filled(committer: CommitProcess, seed: int) -> tuple[SharedBuffer, np.ndarray]:
    buffer = committer.share(BLOCKS * UNIT_BYTES)
    rows = np.frombuffer(buffer.memory, dtype=np.uint8).reshape(BLOCKS, UNIT_BYTES)
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    return buffer, rows


def test_a_dropped_buffer_is_not_located_before_the_next_request(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        dropped, rows = _filled(committer, seed=0)
        address = dropped.address
        assert committer.locate(address, UNIT_BYTES) == (dropped.id, 0)
        del dropped, rows
        gc.collect()
        # No request since the drop: its FORGET is still queued, yet its range is no shared buffer's now.
        assert committer.locate(address, UNIT_BYTES) is None


def test_a_buffer_mapped_into_a_dropped_ones_place_commits(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        dropped, old_rows = _filled(committer, seed=0)
        address = dropped.address
        del dropped, old_rows
        gc.collect()
        # The kernel places the next mapping of that size in the hole (as on the
        # worker's model thread, where the pool freed a buffer and the next save took one).
        buffer, rows = _filled(committer, seed=1)
        assert buffer.address == address, "the kernel did not reuse the hole: this test shows nothing here"
        place = committer.locate(rows.ctypes.data, rows.nbytes)
        assert place == (buffer.id, 0)
        keys = NS.block_keys(list(range(4 * BLOCKS)))
        committer.put_segments(NS, [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)])
        assert [bytes(g) for g in store.get(NS, list(keys))] == [rows[i].tobytes() for i in range(BLOCKS)]


def test_the_newest_buffer_over_an_address_is_located(tmp_path: Path) -> None:
    """``mmap`` unmaps before its finalizers run (with the GIL released):
    another thread can map a new buffer in the hole while the dropped one
    is still listed. The newest listed buffer over an address is the live one."""
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        older, _older_rows = _filled(committer, seed=0)
        newer, _newer_rows = _filled(committer, seed=1)
        # The listing as it stands in that window (the older one in the newer's range; share() lists in order).
        committer._buffers[older.id] = (newer.address, newer.nbytes)
        assert committer.locate(newer.address + UNIT_BYTES, UNIT_BYTES) == (newer.id, UNIT_BYTES)
