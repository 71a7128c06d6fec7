"""``save_process`` (README): "if the child cannot start ..., saves commit
in the worker again (logged)". The child really fails to start; no engine
(the worker's halves are driven as in test_scheduler_worker.py), a real store.

Two real causes, each set up in the environment the commit process is
spawned from (``[sys.executable, "-m", "ucm_db.committer.child", FD]``):

* ``no-interpreter``: ``sys.executable`` names a path with no interpreter,
  so the spawn itself fails (``Popen`` raises: "did not start");
* ``interpreter-exits``: ``PYTHONHOME`` names a missing directory, so the
  child's interpreter starts and exits at once with a fatal error, before
  it answers its open ("did not answer its open").
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

from test_scheduler_worker import BS, _admit, _new_step, _request, restarted  # noqa: E402


@pytest.fixture(params=["no-interpreter", "interpreter-exits"])
def child_cannot_start(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Breaks the commit process's start; returns the log text that names why."""
    if request.param == "no-interpreter":
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
        return "the commit process did not start"
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "no-such-home"))
    return "the commit process did not answer its open"


def test_saves_commit_in_the_worker_when_the_child_cannot_start(
        tmp_path: Path, child_cannot_start: str, caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "save_process": True})
    tokens = list(range(1, 4 * BS + 5))  # 4 full blocks
    # A first engine saves random KV for ``tokens`` (its commit process
    # fails to start), then a restarted engine's halves over the same store.
    with caplog.at_level(logging.WARNING):
        kv, sched, worker, fresh = restarted(settings, tokens)
    assert child_cannot_start in caplog.text
    assert "saves commit in the worker process" in caplog.text
    assert worker._writer._route.committer is None  # type: ignore[union-attr]

    # The saves committed: the restarted engine finds and loads all 4 blocks, bit for bit.
    req = _request("b", tokens)
    assert _admit(sched, req) == 4 * BS
    meta = sched.build_connector_meta(_new_step(req, [10, 11, 12, 13, 14], len(tokens) - 4 * BS))
    worker.start_load(meta)
    assert worker.take_load_errors() == set()
    for name in kv:
        assert torch.equal(fresh[name][10:14].view(torch.int16), kv[name][0:4].view(torch.int16))
    worker.shutdown()
    sched.shutdown()
