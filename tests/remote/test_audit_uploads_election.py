"""Audit of the uploader election across processes: a dead elected uploader
is replaced even when it forked a child before it died.

The finding: the election is an exclusive ``flock`` on ``uploader.lock``,
held through one descriptor. ``fork`` copies that descriptor into the child,
and a ``flock`` lasts while any descriptor of its open file lives. The child
dropped its copy only when it used the store (``Store`` after a fork starts
its threads again at its next operation). A forked child that never touches
the store (a vLLM worker, a ``multiprocessing`` helper, a subprocess fork
before ``exec``-free work) kept the election for as long as it lived: when
the elected process died, no process of the store directory uploaded again,
and every ``flush`` failed with ``UploaderElsewhereError`` naming the dead
pid. Now the descriptor is closed in every forked child at the fork
(:mod:`ucm_db.remote.election`), which leaves the parent's lock alone.

A second finding: the uploader's thread died on the first failure to open
the lock file (``EMFILE`` under load, a stray directory in its place, a
permission), so the process never uploaded again, even once the cause was
gone, and ``flush`` blamed "another process" that did not exist. Now a
failed open (or a ``flock`` that fails for another reason than a holder) is
retried at the next poll, and a flush that times out names it.

Real parts: forked processes (one SIGKILLed), LMDB store, a shared
directory remote (``file://``), the election lock.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.remote.tier import RemoteRoot

from reliability.harness import fork_call, kill_and_reap, read_counter, tail, wait_counter, write_counter
from .conftest import chain

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]
CAP = 64 << 20


def _elected_then_fork(store_path: Path, remote_url: str, namespace: ucm_db.Namespace, grandchild_pid: Path) -> None:
    """Opens the store, waits until it is the elected uploader, forks a
    child that never touches the store, publishes the child's pid, sleeps."""
    store = ucm_db.open(store_path, capacity_bytes=CAP, remote=remote_url)
    keys, payloads = chain(namespace, 2, seed=7)
    store.put(namespace, keys, payloads)
    store.flush(upload_timeout_s=30)  # only the elected uploader drains the queue
    assert store._wing is not None and store._wing.uploader is not None and store._wing.uploader.election.held
    pid = os.fork()
    if pid == 0:  # the child: unrelated work, never the store
        while True:
            signal.pause()
    write_counter(grandchild_pid, pid)
    while True:
        signal.pause()


def test_a_dead_uploader_is_replaced_though_its_forked_child_lives(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    remote_url = f"file://{tmp_path}/shared"
    store_path = tmp_path / "store"
    child_pid = tmp_path / "grandchild.pid"
    log = tmp_path / "elected.log"
    elected = fork_call(_elected_then_fork, store_path, remote_url, namespace, child_pid, log_path=log)
    grandchild = 0
    try:
        assert wait_counter(child_pid, 1, timeout_s=60) > 0, tail(log)
        grandchild = read_counter(child_pid)
        kill_and_reap(elected)  # the elected uploader dies; its forked child lives on
        keys, payloads = chain(namespace, 3, seed=8)
        with ucm_db.open(store_path, capacity_bytes=CAP, remote=remote_url) as store:
            store.put(namespace, keys, payloads)
            began = time.monotonic()
            store.flush(upload_timeout_s=10)  # failed: UploaderElsewhereError naming the dead pid
            assert time.monotonic() - began < 10
        root = RemoteRoot.from_url(remote_url)
        assert root.tier(namespace.id).exists(keys) == [True] * 3
    finally:
        kill_and_reap(elected)
        if grandchild:
            try:
                os.kill(grandchild, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_election_that_cannot_be_taken_for_a_while_is_taken_once_it_can(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """``uploader.lock`` cannot be opened when the store opens (a directory
    stands in its place: a real fault of the file system, as EMFILE or
    EACCES would be); once it can, this process is elected and drains."""
    remote_url = f"file://{tmp_path}/shared"
    store_path = tmp_path / "store"
    (store_path / "uploader.lock").mkdir(parents=True)
    keys, payloads = chain(namespace, 3, seed=9)
    with ucm_db.open(store_path, capacity_bytes=CAP, remote=remote_url) as store:
        store.put(namespace, keys, payloads)
        with pytest.raises(TierError) as raised:
            store.flush(upload_timeout_s=1.5)
        assert "cannot take" in str(raised.value) and "Is a directory" in str(raised.value), str(raised.value)
        (store_path / "uploader.lock").rmdir()
        store.flush(upload_timeout_s=10)  # the thread had died: UploaderElsewhereError naming no process
    assert RemoteRoot.from_url(remote_url).tier(namespace.id).exists(keys) == [True] * 3
