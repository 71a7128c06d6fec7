"""The fix of the review's fork finding (:mod:`ucm_db.remote.election`), on
its common path: a fork that lands while another thread is inside ``take``
(not stuck: its file system answers) waits for the take to record its
descriptor, so the child's at-fork hook closes it.

The review's own test (test_review_uploads_fork.py) holds the taking thread
until the fork has returned, so the fork's bounded wait times out and the
child closes the descriptor the take holds; this one lets the take finish
a moment later, as a real one does. Before the fix the fork went through at
once and the child kept a locked descriptor nobody knew of.

Real parts: the election lock file, a real ``os.fork`` child that never
touches the store. Simulated: only the interleaving (the taking thread's
``os.pwrite`` takes half a second, so the fork lands inside ``take``).
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


def test_a_fork_during_a_take_waits_for_it_and_the_child_drops_the_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    election = UploaderElection(tmp_path)
    locked = threading.Event()
    real_pwrite = os.pwrite

    def slow_pwrite(fd: int, data: bytes, offset: int) -> int:
        locked.set()  # flock taken, descriptor not recorded yet
        time.sleep(0.5)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(election_module.os, "pwrite", slow_pwrite)
    taker = threading.Thread(target=election.take)
    taker.start()
    assert locked.wait(30)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # unrelated work, never the store; its at-fork hooks have run by now
        try:
            os.write(ready_w, b"r")
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"r"
        taker.join(30)
        monkeypatch.undo()
        assert election.held
        election.release()  # the elected process lets go (as its death would)
        successor = UploaderElection(tmp_path)
        assert successor.take(), "the forked child holds the store directory's uploader election"
        successor.release()
    finally:
        os.close(ready_r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
