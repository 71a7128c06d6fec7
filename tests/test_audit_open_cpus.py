"""Audit of ``ucm_db.cpu_placement`` with real threads and real affinity
calls: a CPU set the kernel cannot take must never kill a store thread.

Found: ``set_background_cpus([-1])`` was accepted, and every store thread
started afterwards died in ``place_current_thread`` with "ValueError:
negative CPU number" (the store's maintenance thread too: its background
work silently stopped), although the module promises placement never fails
a thread. A CPU number too large for the kernel's mask (``2**40``) raised
OverflowError the same way."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ucm_db
from ucm_db import cpu_placement

NS = ucm_db.Namespace(model="audit-cpus", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(16)))
PAYLOADS = [bytes(range(256)) * 16] * 4


@pytest.fixture(autouse=True)
def _reset() -> object:
    yield
    cpu_placement.set_background_cpus(None)


@pytest.mark.parametrize("cpus", [[-1], [0, -3], [True], ["1"], [1.5]])
def test_a_value_that_is_not_a_cpu_number_is_refused_when_named(cpus: list[object]) -> None:
    cpu_placement.set_background_cpus([0])
    with pytest.raises(ValueError, match=r"CPU numbers \(ints >= 0\).*sched_getaffinity"):
        cpu_placement.set_background_cpus(cpus)  # type: ignore[arg-type]
    assert cpu_placement.background_cpus() == frozenset({0}), "the named set is left as it was"


def test_a_cpu_number_the_kernel_cannot_take_leaves_threads_alive_where_they_were() -> None:
    before = os.sched_getaffinity(0)
    cpu_placement.set_background_cpus([2**40])  # a CPU number no affinity mask holds: OverflowError before
    seen: list[set[int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cpu_placement.place_current_thread()
            seen.append(os.sched_getaffinity(0))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors and seen == [before]


def test_a_store_under_taskset_with_one_cpu_stores_and_reads(tmp_path: Path) -> None:
    """``taskset -c N``: the process sees one CPU; naming spare CPUs of that
    one set gives none, and a store's threads (codec, maintenance) run."""
    cpu = max(os.sched_getaffinity(0))
    code = (
        "import os, sys, ucm_db; from ucm_db import cpu_placement as c\n"
        "allowed = os.sched_getaffinity(0); assert len(allowed) == 1, allowed\n"
        "c.set_background_cpus(c.spare_cpus(allowed)); assert c.background_cpus() == frozenset()\n"
        "ns = ucm_db.Namespace(model='audit-cpus', kv_dtype='bfloat16', block_size=4)\n"
        "keys = ns.block_keys(list(range(16)))\n"
        "with ucm_db.open(sys.argv[1], codec='zstd') as s:\n"
        "    s.put(ns, keys, [bytes(range(256)) * 16] * 4); s.flush(); print(s.lookup(ns, keys))\n"
    )
    done = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_store_started_after_a_negative_cpu_was_named_keeps_its_threads(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        cpu_placement.set_background_cpus([-1])
    with ucm_db.open(tmp_path / "s", codec="zstd") as store:
        store.put(NS, KEYS, PAYLOADS)
        assert store.get(NS, KEYS) == PAYLOADS
