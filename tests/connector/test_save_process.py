"""``save_process``: the worker's saves committed by a commit process
(ucm_db.committer) over a real store; no engine (tests/vllm runs the
connector's saves in an engine). The store's in-process put is wrapped to
fail where a test proves the child committed: a fault a real store never
produces on demand."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db import cpu_placement  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402


def _halves(path: Path, **extra: object) -> tuple[UcmDbScheduler, UcmDbWorker, dict[str, torch.Tensor]]:
    settings = ConnectorSettings.from_extra_config({"path": str(path), **extra})
    kv = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
    sched, worker = UcmDbScheduler(settings, _shape()), UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    worker.register_kv_caches(kv, 0, 0)
    return sched, worker, kv


def _save(sched: UcmDbScheduler, worker: UcmDbWorker, req_id: str, tokens: list[int], block_ids: list[int]) -> None:
    req = _request(req_id, tokens)
    assert _admit(sched, req) == 0
    worker.save(sched.build_connector_meta(_new_step(req, block_ids, len(tokens))))
    worker.drain()
    sched.request_finished(req, block_ids)


def _hits(sched: UcmDbScheduler, tokens: list[int]) -> int:
    return sched.get_num_new_matched_tokens(_request("probe", tokens), 0)[0]


def _no_put_here(worker: UcmDbWorker) -> None:
    store = worker._store
    assert store is not None

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("put in the worker process")
    store.put_segments = refuse  # type: ignore[method-assign]


def test_the_child_commits_the_saves_and_counts_its_cpu(tmp_path: Path) -> None:
    sched, worker, _kv_caches = _halves(tmp_path / "s", save_process=True)
    _no_put_here(worker)
    tokens = list(range(1, 4 * BS + 3))
    _save(sched, worker, "a", tokens, [0, 1, 2, 3, 4])
    assert worker.counters.totals.data["saved_blocks"] == 4
    assert worker.counters.totals.data["save_commit_cpu_s"] > 0  # the child's CPU, reported back
    assert _hits(sched, tokens) == 4 * BS  # committed, visible to the scheduler's own handle
    worker.shutdown()
    sched.shutdown()


def test_a_killed_child_leaves_the_saves_to_the_worker(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sched, worker, _kv_caches = _halves(tmp_path / "s", save_process=True)
    committer = worker._writer._route.committer  # type: ignore[union-attr]
    assert committer is not None
    first = list(range(1, 2 * BS + 3))
    _save(sched, worker, "a", first, [0, 1, 2])
    os.kill(committer.pid, signal.SIGKILL)
    time.sleep(0.2)
    second = list(range(1000, 1000 + 3 * BS + 1))
    with caplog.at_level(logging.WARNING):
        _save(sched, worker, "b", second, [4, 5, 6, 7])
    assert "saves now commit in the worker process" in caplog.text
    assert worker.counters.totals.data["save_errors"] == 0
    assert _hits(sched, first) == 2 * BS and _hits(sched, second) == 3 * BS
    worker.shutdown()
    sched.shutdown()


def test_shutdown_ends_the_child(tmp_path: Path) -> None:
    sched, worker, _kv_caches = _halves(tmp_path / "s", save_process=True)
    committer = worker._writer._route.committer  # type: ignore[union-attr]
    assert committer is not None
    pid = committer.pid
    worker.shutdown()
    sched.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped by close: no zombie either


def test_save_process_is_true_false_or_auto(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_process must be true, false or"):
        ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "save_process": "yes"})
    assert ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}).save_process == "auto"


@pytest.fixture()
def spare_cpus_named() -> Iterator[None]:
    cpu_placement.set_background_cpus(os.sched_getaffinity(0))
    yield
    cpu_placement.set_background_cpus(None)


def test_auto_commits_in_a_child_only_where_background_cores_are_named(tmp_path: Path, spare_cpus_named: None) -> None:
    sched, worker, _kv_caches = _halves(tmp_path / "on")
    assert worker._writer._route.committer is not None  # type: ignore[union-attr]
    worker.shutdown()
    sched.shutdown()
    cpu_placement.set_background_cpus(None)  # a host that named none (no binding, a GPU host, TP > 1)
    sched, worker, _kv_caches = _halves(tmp_path / "off")
    assert worker._writer._route.committer is None  # type: ignore[union-attr]
    worker.shutdown()
    sched.shutdown()


def test_worker_halves_over_one_store_share_one_commit_process(tmp_path: Path) -> None:
    """A hybrid model's groups each have a worker half over the same store
    (hybrid/hooks.py): one commit process serves them all, and lives until
    the last of them shuts down."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "save_process": True})
    sched = UcmDbScheduler(settings, _shape())
    halves = []
    for _ in range(2):
        worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
        worker.register_kv_caches({name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}, 0, 0)
        halves.append(worker)
    first, second = (w._writer._route.committer for w in halves)  # type: ignore[union-attr]
    assert first is not None and first is second
    halves[0].shutdown()
    assert second.alive  # the other half still commits through it
    _no_put_here(halves[1])
    tokens = list(range(1, 3 * BS + 2))
    _save(sched, halves[1], "a", tokens, [0, 1, 2, 3])
    assert _hits(sched, tokens) == 3 * BS
    halves[1].shutdown()
    assert not second.alive
    with pytest.raises(ProcessLookupError):
        os.kill(second.pid, 0)  # exited and reaped
    sched.shutdown()
