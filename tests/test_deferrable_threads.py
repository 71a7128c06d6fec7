"""Work no request waits for (write-back uploads, page prefaulting) runs at
a lower CPU priority (ucm_db.cpu_placement.place_deferrable_thread), and
work a caller waits for (write-through uploads) does not. Real threads, a
real store over a real ``file://`` remote, the kernel's own priorities."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import ucm_db
from ucm_db import cpu_placement
from ucm_db.keys import Namespace

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _nice_of_new_thread(fn: Callable[[], None]) -> int:
    seen: list[int] = []

    def run() -> None:
        fn()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def _base() -> int:
    """The main thread's nice value (what the steps count from)."""
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def test_a_thread_started_by_a_deferred_thread_steps_down_once(monkeypatch) -> None:
    monkeypatch.setenv("UCM_DB_DEFERRABLE_NICE", "3")

    inner: list[int] = []

    def deferred_then_start_another() -> None:
        cpu_placement.place_deferrable_thread()
        inner.append(_nice_of_new_thread(cpu_placement.place_deferrable_thread))

    assert _nice_of_new_thread(deferred_then_start_another) == min(19, _base() + 3)
    assert inner == [min(19, _base() + 3)]


def test_a_deferrable_thread_lowers_only_its_own_priority(monkeypatch) -> None:
    monkeypatch.delenv("UCM_DB_DEFERRABLE_NICE", raising=False)
    base = _base()
    assert _nice_of_new_thread(cpu_placement.place_deferrable_thread) == min(19, base + cpu_placement.DEFERRABLE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base, "the caller keeps its priority"
    assert _nice_of_new_thread(cpu_placement.place_current_thread) == base


def test_the_environment_sets_the_steps_and_zero_keeps_the_priority(monkeypatch, caplog) -> None:
    base = _base()
    monkeypatch.setenv("UCM_DB_DEFERRABLE_NICE", "0")
    assert _nice_of_new_thread(cpu_placement.place_deferrable_thread) == base
    monkeypatch.setenv("UCM_DB_DEFERRABLE_NICE", "3")
    assert _nice_of_new_thread(cpu_placement.place_deferrable_thread) == min(19, base + 3)
    monkeypatch.setenv("UCM_DB_DEFERRABLE_NICE", "lots")
    with caplog.at_level(logging.WARNING):
        assert cpu_placement.deferrable_nice() == cpu_placement.DEFERRABLE_NICE
    assert "UCM_DB_DEFERRABLE_NICE='lots'" in caplog.text and "0 to 19" in caplog.text


def _upload_thread_nices(tmp_path: Path, remote_mode: str) -> dict[str, int]:
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=16)
    remote = (tmp_path / "remote").as_uri()
    before = set(threading.enumerate())
    with ucm_db.open(tmp_path / f"s-{remote_mode}", remote=remote, remote_mode=remote_mode) as store:
        keys = ns.block_keys(list(range(16 * 4)))
        store.put(ns, keys, [bytes(4096) for _ in keys])
        store.flush(upload_timeout_s=60.0)
        return {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
                if t not in before and t.name.startswith("ucm-db-upload") and t.native_id is not None}


def test_write_back_uploads_defer_and_write_through_uploads_do_not(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("UCM_DB_DEFERRABLE_NICE", raising=False)
    base = _base()
    behind = _upload_thread_nices(tmp_path, "write_back")
    assert any(name.startswith("ucm-db-upload_") for name in behind) and "ucm-db-uploader" in behind, behind
    # One step below the main thread, not two: the pool's threads are
    # started by the (deferred) uploader thread and inherit its priority.
    assert set(behind.values()) == {min(19, base + cpu_placement.DEFERRABLE_NICE)}, behind
    through = _upload_thread_nices(tmp_path, "write_through")  # a put waits for these
    assert any(name.startswith("ucm-db-upload_") for name in through), through
    assert set(through.values()) == {base}, through
