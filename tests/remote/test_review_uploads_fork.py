"""Review of eb42ace's at-fork hook (:mod:`ucm_db.remote.election`): a fork
that lands while another thread is inside ``take`` leaves the child holding
the election.

``take`` opens the lock file, ``flock``s it, writes its pid (``ftruncate``
and ``pwrite``, both of which let the GIL go) and only then stores the
descriptor in ``_fd``. A fork by another thread in that window copies a
locked descriptor the at-fork hook cannot see (``_fd`` is still None in the
child), so the child keeps the election's open file alive for as long as it
lives: after the parent lets go (dies, closes its store) no process of the
store directory can take it. That is the outage the hook was added for,
narrowed to a window that opens exactly when a store starts (its uploader
thread takes the election at once) -- when vLLM forks its workers.

Real parts: the election lock file, a real ``os.fork`` child that never
touches the store. Simulated: only the interleaving (the taking thread's
``os.pwrite`` waits until the main thread has forked), which a test cannot
otherwise hit on demand.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ucm_db.remote import election as election_module
from ucm_db.remote.election import UploaderElection

pytestmark = [pytest.mark.timeout(60), pytest.mark.multiprocess]


def test_a_fork_during_take_leaves_no_election_in_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    election = UploaderElection(tmp_path)
    locked, forked = threading.Event(), threading.Event()
    real_pwrite = os.pwrite

    def paused_pwrite(fd: int, data: bytes, offset: int) -> int:
        locked.set()  # flock taken, _fd not set yet
        assert forked.wait(30)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(election_module.os, "pwrite", paused_pwrite)
    taker = threading.Thread(target=election.take)
    taker.start()
    assert locked.wait(30)
    child = os.fork()
    if child == 0:  # unrelated work, never the store (a worker, a helper)
        try:
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        forked.set()
        taker.join(30)
        monkeypatch.undo()
        assert election.held
        election.release()  # the elected process lets go (as its death would)
        successor = UploaderElection(tmp_path)
        # The child drops its copy in its own at-fork hook, whenever it is
        # scheduled: a successor polls (the uploader every half second).
        deadline = time.monotonic() + 10
        while not successor.take() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert successor.held, "the forked child still holds the store directory's uploader election"
        successor.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
