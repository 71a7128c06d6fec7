"""``upload_concurrency`` (docs/configuration.md, README): "parallel uploads
of the background uploader".

A write-back store over ``ucmfault://`` on a local directory where every
request takes :data:`LATENCY_S`; the fault plan's gauge counts the
``pipe_file`` calls under way at once (tests/faultfs.py), so the peak is
how many uploads the uploader really overlapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucm_db
from faultfs import FaultPlan

from .conftest import chain

LATENCY_S = 0.05
#: Blocks queued at once: several rounds of 4 uploads, so all four slots are busy together.
BLOCKS = 24
CAP = 64 << 20


@pytest.mark.parametrize("concurrency", [4, 1])
def test_the_uploader_overlaps_upload_concurrency_uploads(tmp_path: Path, namespace: Any, concurrency: int) -> None:
    plan = FaultPlan(latency_s=LATENCY_S)
    keys, payloads = chain(namespace, BLOCKS)
    with ucm_db.open(tmp_path / "store", capacity_bytes=CAP, remote=f"ucmfault://{tmp_path / 'remote'}",
                     remote_options={"target_protocol": "file", "plan": plan}, remote_mode="write_back",
                     upload_concurrency=concurrency) as store:
        store.put(namespace, keys, payloads)  # queued: the uploader drains them in the background
        store.flush(upload_timeout_s=30)
        stats = store.stats()
        assert stats.pending_uploads == 0 and stats.remote["uploaded"] == BLOCKS
    assert plan.writes_in_flight == 0
    assert plan.max_writes_in_flight == concurrency
