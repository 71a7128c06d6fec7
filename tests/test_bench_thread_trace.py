"""``tools/bench/thread_trace.py`` (where a serving pass's CPU goes) and
``ucm-db bench hooks``' summary, on this test's own threads and on a
result shaped as the engine job writes it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ucm_db import cpu_placement
from ucm_db.tools.bench import thread_trace

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_named_thread_gets_its_own_row_with_its_cpu() -> None:
    before = thread_trace.snapshot([os.getpid()])
    started = time.perf_counter()

    def busy() -> None:
        cpu_placement.place_current_thread()  # gives it its OS name
        _spin(0.3)
        spun.set()
        done.wait(30)

    spun, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=busy, name="trace-busy")
    thread.start()
    # Its 0.3 s of CPU may take far longer than that on a loaded host: the
    # snapshot waits for it, so the CPU counted is the spin's, not the share
    # of a fixed wall window the machine happened to give it.
    assert spun.wait(30)
    after = thread_trace.snapshot([os.getpid()])
    done.set()
    thread.join()
    rows = thread_trace.diff(before, after, time.perf_counter() - started)
    busy_rows = [r for r in rows if r["thread"] == "trace-busy"]
    assert len(busy_rows) == 1 and busy_rows[0]["threads"] == 1
    assert 0.25 <= busy_rows[0]["cpu_s"] <= 0.5  # born after the first snapshot: counted from zero
    assert rows == sorted(rows, key=lambda r: -r["cpu_s"])
    assert "trace-busy" in thread_trace.format_rows(rows)


def test_rows_of_alike_threads_merge_unless_asked_apart() -> None:
    before = thread_trace.snapshot([os.getpid()])
    done = threading.Event()
    spun = [threading.Event() for _ in range(2)]

    def pooled(ready: threading.Event) -> None:
        cpu_placement.place_current_thread()
        _spin(0.1)
        ready.set()
        done.wait(30)

    threads = [threading.Thread(target=pooled, args=(ready,), name="trace-pool") for ready in spun]
    for t in threads:
        t.start()
    assert all(ready.wait(30) for ready in spun)  # both named and busy before the snapshot, however slow the host
    after = thread_trace.snapshot([os.getpid()])
    done.set()
    for t in threads:
        t.join()
    merged = [r for r in thread_trace.diff(before, after, 0.4) if r["thread"] == "trace-pool"]
    apart = [r for r in thread_trace.diff(before, after, 0.4, by_thread=True) if r["thread"] == "trace-pool"]
    assert [r["threads"] for r in merged] == [2]
    assert [r["threads"] for r in apart] == [1, 1]


def test_process_group_finds_this_process() -> None:
    assert os.getpid() in thread_trace.process_group(os.getpgid(0))


def test_a_traced_pass_carries_its_threads_and_prints_them_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    def send() -> dict:
        _spin(0.2)
        return {"duration": 0.25}

    result = thread_trace.trace_pass(os.getpgid(0), send)
    mine = [r for r in result["threads"] if r["cpu_s"] >= 0.15]
    # This process's spinning thread is among them (other processes of the group may have spun more).
    assert thread_trace.process_name(os.getpid()) in {r["process"] for r in mine}, mine
    monkeypatch.delenv("UCM_DB_BENCH_THREADS", raising=False)
    assert thread_trace.shown(result["threads"]) == ""
    monkeypatch.setenv("UCM_DB_BENCH_THREADS", "1")
    assert thread_trace.shown(result["threads"]).startswith("\n    process")


def test_each_cpu_s_busy_time_and_the_host_s_steal_get_rows(tmp_path: Path) -> None:
    """A pass on a VM whose host took CPU 0 away: threads runnable then
    count it as wait, so the trace says how much the host took, and how
    busy each CPU was with anything (a fake ``/proc/stat``; the real one
    is read the same way)."""
    stat = "cpu  10 0 5 100 0 0 0 30 0 0\ncpu0 {user0} 0 2 50 7 1 1 {steal0} 0 0\ncpu1 5 0 3 50 0 0 0 10 0 0\nintr 1 2\n"
    (tmp_path / "stat").write_text(stat.format(user0=5, steal0=20))
    before = thread_trace.cpu_ticks(tmp_path)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text(stat.format(user0=5 + 2 * ticks_per_s, steal0=20 + ticks_per_s))
    after = thread_trace.cpu_ticks(tmp_path)
    assert before == {"0": (9, 20), "1": (8, 10)}  # busy: user, nice, system, irq, softirq (not idle, not iowait)
    rows = thread_trace.cpu_rows(before, after, wall_s=4.0)
    assert [(r["thread"], r["cpus"], r["cpu_share"]) for r in rows] == [("busy", "0", 0.5), ("steal", "0", 0.25), ("busy", "1", 0.0)]
    assert all(r["process"] == "(host)" for r in rows) and "(host)" in thread_trace.format_rows(rows)
    assert thread_trace.cpu_ticks(tmp_path / "absent") == {}
    traced = [{"cpu_s": 0.5}, {"cpu_s": 0.25}]  # 0.75 s of the 2 s CPU 0 was busy: 1.25 s ran elsewhere
    (untraced,) = thread_trace.untraced_row(traced, rows, wall_s=4.0)
    assert (untraced["thread"], untraced["cpu_s"], untraced["cpu_share"]) == ("untraced", 1.25, 0.3125)
    assert thread_trace.untraced_row(traced, [], wall_s=4.0) == []


def test_hooks_summary_counts_per_step_by_role() -> None:
    from ucm_db.tools.bench.hooks import summarize

    result = {"request_s": [0.5, 0.5],
              "processes": [{"pid": 1, "hooks": {"build_connector_meta": {"calls": 200, "s": 0.01}},
                             "meta": {"steps": 200, "max_blocks": 64}},
                            {"pid": 2, "hooks": {"wait_for_save": {"calls": 200, "s": 0.02},
                                                 "save_kv_layer": {"calls": 400, "s": 0.004}},
                             "meta": {"steps": 0, "max_blocks": 0}}]}
    summary = summarize(result, num_prompts=2, output_len=50)
    assert summary["wall_ms_per_step"] == 10.0  # 1 s over 2 x 50 steps
    assert summary["hooks"]["scheduler.build_connector_meta"] == {"calls_per_step": 1.0, "us_per_step": 50.0}
    assert summary["hooks"]["worker.save_kv_layer"] == {"calls_per_step": 2.0, "us_per_step": 20.0}
    assert summary["hooks_us_per_step"] == {"scheduler": 50.0, "worker": 120.0}
    assert summary["max_blocks_a_step"] == 64


def test_pairs_with_a_pass_disturbed_by_untraced_work_are_told_apart() -> None:
    """A pass whose CPUs ran much work no traced thread did (another job on
    the machine) is disturbed; its pair is left out of the quiet pairs'
    median, never out of the row's own figure. An untraced pass counts
    as quiet."""
    from ucm_db.tools.bench import serve_paired

    def pass_(req_s: float, untraced: float | None) -> dict:
        rows = [] if untraced is None else [{"process": "(host)", "thread": "untraced", "cpu_share": untraced}]
        return {"request_throughput": req_s, "threads": rows}

    bound = [pass_(10.0, 0.02), pass_(10.0, 0.157), pass_(10.0, None)]
    ucm = [pass_(9.5, 0.03), pass_(9.9, 0.02), pass_(9.0, 0.151)]
    assert serve_paired.untraced_share(bound[0]) == 0.02 and serve_paired.untraced_share({}) is None
    assert serve_paired.quiet_pairs(bound, ucm) == [0]
    assert serve_paired.paired_ratios(bound, ucm) == [0.95, 0.99, 0.9]
