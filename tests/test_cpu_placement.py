"""Background threads of the store placed off a pinned host thread's CPUs
(ucm_db.cpu_placement), with real threads, a real store and the kernel's
own affinity calls. Needs 2 CPUs (this project's machines have 2)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

import ucm_db
from ucm_db import cpu_placement
from ucm_db.keys import Namespace
from ucm_db.remote.promotion import PromotionTarget

T = TypeVar("T")

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin one away from the other")


def _in_thread_pinned_to(cpus: set[int], fn: Callable[[], T]) -> T:
    """Runs ``fn`` in a new thread bound to ``cpus`` (what vLLM-CPU does to its model thread)."""
    out: list[T] = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        out.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture(autouse=True)
def _reset() -> object:
    yield
    cpu_placement.set_background_cpus(None)


def _cpus() -> tuple[int, set[int]]:
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], set(allowed[1:])


def test_spare_cpus_are_the_allowed_ones_the_thread_is_not_bound_to() -> None:
    first, rest = _cpus()
    allowed = set(os.sched_getaffinity(0))
    assert _in_thread_pinned_to({first}, lambda: cpu_placement.spare_cpus(allowed)) == rest
    assert _in_thread_pinned_to(allowed, lambda: cpu_placement.spare_cpus(allowed)) == set()
    # Only what the caller allows: never CPUs outside it.
    assert _in_thread_pinned_to({first}, lambda: cpu_placement.spare_cpus({first})) == set()


def test_threads_move_only_once_cpus_are_named() -> None:
    first, rest = _cpus()

    def start_and_report() -> set[int]:
        seen: list[set[int]] = []

        def child() -> None:
            cpu_placement.place_current_thread()
            seen.append(set(os.sched_getaffinity(0)))

        thread = threading.Thread(target=child)
        thread.start()
        thread.join()
        return seen[0]

    assert _in_thread_pinned_to({first}, start_and_report) == {first}  # default: inherited
    cpu_placement.set_background_cpus(rest)
    assert _in_thread_pinned_to({first}, start_and_report) == rest


def test_store_threads_start_on_the_background_cpus(tmp_path: Path) -> None:
    """A pinned host opens a store and writes through its codec threads:
    maintenance and codec threads run on the named CPUs, not the host's."""
    first, rest = _cpus()
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=16)

    def open_and_write() -> dict[str, set[int]]:
        cpu_placement.set_background_cpus(cpu_placement.spare_cpus(os.sched_getaffinity(os.getpid())))
        before = set(threading.enumerate())  # threads of earlier tests' stores may still be winding down
        store = ucm_db.open(tmp_path / "s", encode_threads=2)
        try:
            keys = ns.block_keys(list(range(16 * 4)))
            # 1 MiB single-frame blocks: big enough for the codec pool.
            store.put(ns, keys, [bytes(1 << 20) for _ in keys])
            return {t.name: set(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
                    if t not in before and t.name.startswith("ucm-db") and t.native_id is not None}
        finally:
            store.close()

    placed = _in_thread_pinned_to({first}, open_and_write)
    assert "ucm-db-maintenance" in placed and any(name.startswith("ucm-db-codec") for name in placed), placed
    assert all(cpus == rest for cpus in placed.values()), placed


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names in /proc are Linux's")
def test_placed_threads_carry_their_python_name_in_the_os() -> None:
    """``top -H`` and profilers tell ucm-db's threads from the host's: a
    placed thread's OS name is its Python name (15 bytes); the main thread
    keeps the process's."""
    seen: list[str] = []

    def child() -> None:
        cpu_placement.place_current_thread()
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=child, name="ucm-db-writer-of-a-long-name")
    thread.start()
    thread.join()
    main_comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    cpu_placement.place_current_thread()
    assert seen == ["ucm-db-writer-o"]
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == main_comm


def test_remote_threads_start_on_the_background_cpus(tmp_path: Path) -> None:
    """A pinned host reading through a remote: the link's request threads
    and the background promotion's thread run on the named CPUs too."""
    first, rest = _cpus()
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=16)
    keys = ns.block_keys(list(range(16 * 8)))
    payloads = [bytes([i]) * 4096 for i in range(8)]
    remote = f"memory://ucm-placement-{os.getpid()}-{id(tmp_path)}"  # not a local disk: requests go to the pool
    with ucm_db.open(tmp_path / "a", remote=remote) as writer:
        writer.put(ns, keys, payloads)
        writer.flush(upload_timeout_s=30)

    def open_and_read() -> dict[str, set[int]]:
        cpu_placement.set_background_cpus(cpu_placement.spare_cpus(os.sched_getaffinity(os.getpid())))
        before = set(threading.enumerate())
        store = ucm_db.open(tmp_path / "b", remote=remote)
        try:
            assert store.get(ns, keys[:4]) == payloads[:4]  # read through the link's pool
            wing = store._wing
            assert wing is not None and wing.continuations.continue_later(
                store._tier, PromotionTarget(ns, store._epochs.before_put), list(keys[4:]), keys[3])
            deadline = time.monotonic() + 10
            while store.lookup(ns, keys, remote=False) < len(keys) and time.monotonic() < deadline:
                time.sleep(0.02)
            return {t.name: set(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
                    if t not in before and t.name.startswith(("ucm-db-remote", "ucm-db-promote")) and t.native_id is not None}
        finally:
            store.close()

    placed = _in_thread_pinned_to({first}, open_and_read)
    assert any(name.startswith("ucm-db-remote") for name in placed), placed
    assert any(name.startswith("ucm-db-promote") for name in placed), placed
    assert all(cpus == rest for cpus in placed.values()), placed
