"""Audit of ucm_db.committer under SIGKILL with a real LMDB store: a child
killed at a random point of a large put (its message, its transaction,
its reply) fails the put at once, leaves the put's blocks all stored with
their own bytes or none stored, leaves no lock behind (the caller commits
the same round itself, as the writer's route does), and the store verifies
clean after many such kills. (No finding: this guards what holds.)"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np

import ucm_db
from ucm_db import maintenance
from ucm_db.committer import CommitProcess, SharedChain
from ucm_db.errors import CommitProcessError

NS = ucm_db.Namespace(model="audit-committer-crash", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 256 << 20, "codec": "none"}
UNIT_BYTES = 256 << 10
UNITS = 32
KILLS = 10


def _unit(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (UNIT_BYTES // 64)


def test_a_child_killed_anywhere_in_a_put_leaves_all_or_nothing_and_no_lock(tmp_path: Path) -> None:
    rng = random.Random(3)
    outcomes = {"committed": 0, "cut": 0}
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        for n in range(KILLS):
            committer = CommitProcess(tmp_path / "s", OPTIONS)
            buffer = committer.share(UNITS * UNIT_BYTES)
            rows = np.frombuffer(buffer.memory, dtype=np.uint8).reshape(UNITS, UNIT_BYTES)
            keys = NS.block_keys(list(range(n * 1000, n * 1000 + 4 * UNITS)))
            for i, key in enumerate(keys):
                rows[i] = np.frombuffer(_unit(key), dtype=np.uint8)
            result: dict[str, Any] = {}

            def put() -> None:
                try:
                    result["stored"] = committer.put_segments(NS, [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)])  # noqa: B023
                except CommitProcessError as exc:
                    result["error"] = exc  # noqa: B023
            thread = threading.Thread(target=put, daemon=True)
            thread.start()
            threading.Event().wait(rng.uniform(0.0, 0.03))
            os.kill(committer.pid, signal.SIGKILL)
            thread.join(60)
            assert not thread.is_alive(), "a put hung on a killed child"
            got = store.get(NS, list(keys))
            present = [g is not None for g in got]
            assert all(present) or not any(present), f"kill {n}: {sum(present)} of {len(keys)} blocks stored"
            assert all(bytes(g) == _unit(k) for g, k in zip(got, keys) if g is not None)
            outcomes["committed" if all(present) else "cut"] += 1
            # The caller commits the round itself (the killed child held the write lock, maybe).
            store.put_segments(NS, [(keys, [bytes(row) for row in rows])])
            assert [bytes(g) for g in store.get(NS, list(keys))] == [_unit(k) for k in keys]  # type: ignore[arg-type]
            committer.close()
    report = maintenance.verify(tmp_path / "s")
    assert report.checked == KILLS * UNITS and not report.problems, report
    assert outcomes["cut"] > 0, outcomes  # some kill did land before the commit
