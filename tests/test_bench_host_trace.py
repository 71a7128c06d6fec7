"""``tools/bench/host_trace.py``: the rest of the machine during a pass.
A real busy process is found by name with its CPU time; kernel workers
merge by work queue; pressure totals come from a copy of the kernel's file
format in a temporary directory (a stall cannot be produced on demand)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucm_db.tools.bench import host_trace

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads Linux's /proc")

_SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_a_busy_process_outside_the_traced_ones_gets_a_row_by_name() -> None:
    exclude = [os.getpid()]
    before = host_trace.other_ticks(exclude)
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _SPIN + "print('spun', flush=True)\ninput()\n"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        after = host_trace.other_ticks(exclude)  # the child still lives: one gone by then would be absent
    finally:
        child.communicate("\n", timeout=10)
    rows = host_trace.other_rows(before, after, time.perf_counter() - started)
    name = Path(sys.executable).name[:15]
    mine = [r for r in rows if r["thread"] == name]
    assert mine, rows
    assert mine[0]["cpu_s"] >= 0.4  # born after the first reading: counted from zero
    assert rows == sorted(rows, key=lambda r: -r["cpu_s"])
    assert all(r["process"] == "(other)" and r["cpu_share"] >= 0.01 for r in rows)


def test_the_excluded_processes_are_not_counted() -> None:
    ticks = host_trace.other_ticks([os.getpid()])
    assert os.getpid() not in ticks and ticks  # the rest of the machine is there


def test_kernel_workers_merge_by_their_work_queue() -> None:
    assert host_trace.group_name("kworker/u8:1-writeback") == host_trace.group_name("kworker/u8:3-writeback") == "kworker-writeback"
    assert host_trace.group_name("kworker/1:1H-kblockd") == "kworker-kblockd"
    assert host_trace.group_name("kworker/0:2") == "kworker"
    assert host_trace.group_name("jbd2/vda-8") == "jbd2/vda-8"
    assert host_trace.group_name("kdamond.0") == "kdamond.0"


def test_a_renamed_worker_keeps_its_count_and_a_reused_pid_counts_from_zero() -> None:
    """A kernel worker renames itself for each queue it runs: its time is
    the difference all the same, filed under its last queue. A pid whose
    ticks went back is a new task."""
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    before = {7: ("kworker-events", 1000), 8: ("old", 1000)}
    after = {7: ("kworker-mm_percpu_wq", 1050), 8: ("new", 150)}
    rows = host_trace.other_rows(before, after, 1.0)
    assert [(r["thread"], r["cpu_s"]) for r in rows] == [("new", round(150 * tick_s, 4)), ("kworker-mm_percpu_wq", round(50 * tick_s, 4))]


def _pressure(root: Path, totals: dict[str, int]) -> None:
    (root / "pressure").mkdir(exist_ok=True)
    for resource, total in totals.items():
        (root / "pressure" / resource).write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")


def test_pressure_stalls_become_shares_of_the_pass(tmp_path) -> None:
    _pressure(tmp_path, {"cpu": 1_000, "io": 5_000, "memory": 0})
    before = host_trace.pressure_us(tmp_path)
    _pressure(tmp_path, {"cpu": 1_000 + 2_000, "io": 5_000 + 300_000, "memory": 900_000})
    after = host_trace.pressure_us(tmp_path)
    rows = {r["thread"]: r for r in host_trace.pressure_rows(before, after, 2.0)}
    assert set(rows) == {"io some", "memory some"}  # cpu: 0.1% of the pass, under the floor
    assert rows["io some"]["wait_share"] == 0.15 and rows["memory some"]["wait_s"] == 0.9


def test_a_kernel_without_pressure_files_gives_no_rows(tmp_path) -> None:
    assert host_trace.pressure_us(tmp_path) == {}
    assert host_trace.pressure_rows({}, {}, 1.0) == []
    assert host_trace.other_ticks([], tmp_path) == {}


def test_interrupt_time_becomes_one_row(tmp_path) -> None:
    tick_hz = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text(f"cpu  100 0 50 900 3 {tick_hz // 10} {tick_hz // 10} 0 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    before = host_trace.interrupt_ticks(tmp_path)
    (tmp_path / "stat").write_text(f"cpu  100 0 50 900 3 {tick_hz // 2} {tick_hz // 10 + tick_hz} 0 0 0\n")
    rows = host_trace.interrupt_rows(before, host_trace.interrupt_ticks(tmp_path), 2.0)
    assert [(r["thread"], r["cpu_share"]) for r in rows] == [("irq+softirq", 0.7)]  # 1.4 s of 2
    assert host_trace.interrupt_ticks(tmp_path / "absent") is None and host_trace.interrupt_rows(None, 5, 1.0) == []
    assert host_trace.interrupt_ticks() is not None  # this machine's own /proc/stat
