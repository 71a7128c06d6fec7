"""The engines' one shared/exclusive gate (ucm_db/engines/gate.py), with real
threads and no timing: each step waits on an event or on the gate's own
state, never on a clock.

* An exclusive step waits until every shared holder has left, and from the
  moment it asks no new shared holder comes in before it (the LMDB map
  resize and the RocksDB commit both rely on that).
* Two exclusive steps never overlap (the LMDB engine resizes from any
  thread).
"""

from __future__ import annotations

import threading

from ucm_db.engines.gate import SharedExclusiveGate


def _wait_until(condition) -> None:
    """Spins (yielding the CPU) until ``condition()``; the suite's own
    timeout bounds a hang."""
    while not condition():
        threading.Event().wait(0.001)


def test_exclusive_waits_for_shared_holders_and_keeps_new_ones_out() -> None:
    gate = SharedExclusiveGate()
    order: list[str] = []
    release_reader = threading.Event()

    def reader() -> None:
        with gate.shared():
            order.append("reader in")
            release_reader.wait()
            order.append("reader out")

    def writer() -> None:
        with gate.exclusive():
            order.append("writer")

    def late_reader() -> None:
        with gate.shared():
            order.append("late reader")

    first = threading.Thread(target=reader)
    first.start()
    _wait_until(lambda: order == ["reader in"])
    second = threading.Thread(target=writer)
    second.start()
    _wait_until(lambda: gate._exclusive)  # the writer asked and waits for the reader  # noqa: SLF001
    third = threading.Thread(target=late_reader)
    third.start()
    assert order == ["reader in"]
    release_reader.set()
    for thread in (first, second, third):
        thread.join()
    assert order == ["reader in", "reader out", "writer", "late reader"]


def test_an_exclusive_step_waits_for_an_earlier_one() -> None:
    """The second exclusive step waits on the gate while the first runs
    (seen as a waiter on the gate's condition, not by a clock)."""
    gate = SharedExclusiveGate()
    order: list[str] = []
    release_first = threading.Event()

    def first() -> None:
        with gate.exclusive():
            order.append("first in")
            release_first.wait()
            order.append("first out")

    def second() -> None:
        with gate.exclusive():
            order.append("second")

    one = threading.Thread(target=first)
    one.start()
    _wait_until(lambda: order == ["first in"])
    two = threading.Thread(target=second)
    two.start()
    _wait_until(lambda: "second" in order or len(gate._cond._waiters) == 1)  # noqa: SLF001 - CPython's Condition
    assert order == ["first in"]
    release_first.set()
    one.join()
    two.join()
    assert order == ["first in", "first out", "second"]
