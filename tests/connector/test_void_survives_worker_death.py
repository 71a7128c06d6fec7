"""A ``kv_producer`` worker killed between its commit and its void leaves no
wrong KV stored: the store's sweep deletes what the void would have.

The scenario of ``test_void_retracts_remote.py``, run in a child process: a
TP=2 producer's rank 1 fails to load block 1, rank 0 commits its save of
blocks 2-4 (computed over that failed block: wrong KV) within the step. The
scheduler would void it a step later; here the child is killed with SIGKILL
first (a crash, an OOM kill). Before provisional tags the void lived in the
worker's memory only and the wrong units stayed stored for every engine.
Checked, in the commit process and without: after the kill, the next open
deletes the three units (the worker's store handle's sweep); with a clean
shutdown before any void (the void's verdict never came), they stand, as the
docs say; a void settles its tag (no mark left for a sweep); a void still
failing at a clean close leaves its units to the sweep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from test_failed_load_saves import _output, _seed  # noqa: E402
from test_review_voids_retry import FailingDeletes  # noqa: E402
from test_scheduler_worker import BS, _admit, _kv, _new_step, _request, _shape  # noqa: E402
from test_void_keeps_others_saves import IDS, PROMPT, _rank_worker  # noqa: E402

from ucm_db.connector.identity import grid, namespace, reader_spans  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.voids import SaveVoids, VoidJob, VoidTag  # noqa: E402
from ucm_db.index import provisional as marks  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402
from ucm_db.store import provisional as store_provisional  # noqa: E402


@dataclass
class WrongSave:
    """A TP=2 producer whose rank 0 committed a save over rank 1's failed load."""

    sched: UcmDbScheduler
    workers: list[Any]
    request: Any
    meta: Any
    head0: list[bytes]  # rank 0's unit keys of blocks 0-4 (2-4: the wrong save's)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.sched.shutdown()


def _wrong_save(path: Path, save_process: bool = False) -> WrongSave:
    """Commits the wrong save: rank 1's load of block 1 fails, rank 0 commits
    blocks 2-4 within the step (a producer does not hold)."""
    settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", "save_process": save_process})
    sched = UcmDbScheduler(settings, _shape(2), RolePolicy("kv_producer"))
    workers = [_rank_worker(settings, rank, "kv_producer") for rank in (0, 1)]
    ns, g, spans = namespace(_shape(2)), grid(_shape(2)), reader_spans(_shape(2))
    req = _request("b", PROMPT)
    assert _admit(sched, req) == 2 * BS
    meta = sched.build_connector_meta(_new_step(req, IDS, len(PROMPT) - 2 * BS))
    keys = sched.keys_for(req, 5)
    assert sched.store.delete(ns, [unit_key(keys[1], spans[1], g)]) == 1  # rank 1's load of block 1 fails
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
    head0 = [bytes(unit_key(k, spans[0], g)) for k in keys]
    assert sched.store.lookup(ns, head0) == 5, "the wrong save was not committed"
    return WrongSave(sched, workers, req, meta, head0)


CHILD = """
import sys
sys.path[:0] = [sys.argv[1]]
import time
from test_void_survives_worker_death import _wrong_save
print(" ".join(k.hex() for k in _wrong_save(sys.argv[2], sys.argv[3] == "True").head0), flush=True)
time.sleep(120)
"""


def _killed(tmp_path: Path, save_process: bool) -> list[bytes]:
    """Runs the producer in a process of its own and SIGKILLs it after its
    commit; returns its rank-0 unit keys."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(tmp_path / "s"), str(save_process)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line, "the producer did not commit"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL
    return [bytes.fromhex(k) for k in line]


def _seeded(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "codec": "none"})
    _seed(settings, {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}, blocks=2)


@pytest.mark.parametrize("save_process", [False, True], ids=["in-process", "commit-process"])
def test_a_producer_killed_before_its_void_leaves_no_wrong_units(tmp_path: Path, save_process: bool) -> None:
    _seeded(tmp_path)
    head0 = _killed(tmp_path, save_process)
    with ucm_db.open(tmp_path / "s") as store:
        ns = namespace(_shape(2))
        assert store.lookup(ns, head0) == 2, "the dead producer's wrong units (blocks 2-4) are still served"
        assert not store._engine.read(marks.owners)


def test_a_clean_shutdown_before_the_void_keeps_the_save(tmp_path: Path) -> None:
    """The docs' promise: a save whose void never came (the scheduler never
    said) stands after a clean shutdown, as it did before tags."""
    _seeded(tmp_path)
    wrong = _wrong_save(tmp_path / "s")
    wrong.shutdown()
    head0 = wrong.head0
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(namespace(_shape(2)), head0) == 5
        assert not store._engine.read(marks.owners), "a clean close left marks"


def test_a_void_leaves_no_mark(tmp_path: Path) -> None:
    """The void deletes the units and settles their tag: no mark stays for
    a sweep (which would delete the right units computed again since)."""
    _seeded(tmp_path)
    wrong = _wrong_save(tmp_path / "s")
    sched, workers, req, meta = wrong.sched, wrong.workers, wrong.request, wrong.meta
    assert sched.store._engine.read(marks.owners), "the voidable save was not marked"
    req.num_computed_tokens = 1 * BS
    sched.observe_output(_output(meta.step, {11}).kv_connector_worker_meta, {11})
    sched.request_finished(req, IDS)
    nxt = sched.build_connector_meta(_new_step(_request("idle", PROMPT[:3]), [30], 0))
    assert [t.block_ids for t in nxt.void_saves] == [(12, 13, 14)]
    for worker in workers:
        worker.start_load(nxt)
        worker.drain()
    assert sched.store.lookup(namespace(_shape(2)), wrong.head0) == 2
    assert not sched.store._engine.read(marks.owners), "the void left its tag's marks"
    wrong.shutdown()


def test_a_clean_close_leaves_a_failing_voids_units_to_the_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A void whose delete still fails at the writer's close (a full disk:
    the failing delete is the review's mock, test_review_voids_retry.py)
    leaves its tag unsettled, so the store's sweep deletes the wrong units
    once the owner is gone; a save whose void never came stands."""
    monkeypatch.setattr(store_provisional, "SWEEP_INTERVAL_S", 0.2)
    ns = ucm_db.Namespace(model="void-close", kv_dtype="bfloat16", block_size=4)
    with ucm_db.open(tmp_path / "s", codec="none", sync_interval_s=0.1) as store:
        flaky = FailingDeletes(store)
        voids = SaveVoids(flaky)  # type: ignore[arg-type]
        voided, standing = ns.block_keys(list(range(12))), ns.block_keys(list(range(100, 112)))
        for step, chain in enumerate((voided, standing)):
            tag = VoidTag((f"req-{step}", chain[0], 3), step)
            job = SimpleNamespace(void_tag=tag)
            voids.begin_round(True)
            provisional = {key: voids.tag_for(job) for key in chain}
            voids.stored(store.put_segments(ns, [(chain, [b"\x11" * 4096] * 3)], provisional=provisional).stored_keys, job)
            voids.end_round([(tag, (tuple(chain),))])
        voids.delete(VoidJob(ns, ("req-0", voided[0], 3), 3, step=2))  # fails: kept for its retry
        voids.close()
        deadline = time.monotonic() + 10
        while store.lookup(ns, voided) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.lookup(ns, voided) == 0, "a failing void's wrong units outlived the writer's close"
        assert store.lookup(ns, standing) == 3
