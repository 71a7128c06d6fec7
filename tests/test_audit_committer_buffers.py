"""Audit of ucm_db.committer's shared buffers: ``locate`` names a buffer
only while it is mapped, so no memory but a live shared buffer's is ever
sent to the child as one (it would commit the dropped buffer's stale
bytes, still mapped there, under another save's keys).

Finding reproduced here: ``mmap`` unmaps a dropped buffer with the GIL
released and only then runs its finalizer, which takes the buffer out of
``locate``'s sight; another thread mapping plain memory meanwhile got it
at the same address, and ``locate`` named the dropped buffer for it (about
one plain mapping in ten, with a 32 MiB buffer dropped in a loop beside).
Plain staging beside a live child comes from ``share`` failing to make
shared memory (the worker then stages in plain memory)."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from pathlib import Path

import ucm_db
from ucm_db.committer import CommitProcess

OPTIONS = {"capacity_bytes": 8 << 20, "codec": "none"}
BUFFER_BYTES = 32 << 20
RUN_S = 4.0


def test_plain_memory_in_a_dropped_buffers_place_is_never_located(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        stop = threading.Event()
        counts = {"drops": 0, "plain": 0, "located": 0}

        def drop_buffers() -> None:  # a writer thread giving staging back past the pool's bound
            while not stop.is_set():
                buffer = committer.share(BUFFER_BYTES)
                buffer.memory[::4096] = b"\1" * (BUFFER_BYTES // 4096)  # touched: its unmap takes a while
                del buffer
                counts["drops"] += 1

        def map_plain() -> None:  # another thread's plain memory (staging made where share failed)
            while not stop.is_set():
                memory = mmap.mmap(-1, BUFFER_BYTES)
                address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
                counts["plain"] += 1
                if committer.locate(address, 4096) is not None:
                    counts["located"] += 1
                memory.close()

        threads = [threading.Thread(target=drop_buffers), threading.Thread(target=map_plain)]
        for thread in threads:
            thread.start()
        time.sleep(RUN_S)
        stop.set()
        for thread in threads:
            thread.join()
        assert counts["drops"] >= 10 and counts["plain"] >= 10  # the race was run
        assert counts["located"] == 0, counts
