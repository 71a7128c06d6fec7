"""A process that only reads, or has stopped writing, pins no snapshot.

Under group durability a process that commits holds a read transaction on a
synced snapshot (its pin), and LMDB reuses no page freed after it
(``ucm_db.engines.lmdb.groupsync``). Every writable group Store used to pin
from its open on, moving its pin only at its own syncs: a router that opens
the store and polls ``changes_since`` (as every vLLM process with the
connector does), once stopped (SIGSTOP, Ctrl-Z), made a writer's 8 MiB
store grow to 655 MiB in 19 s (the audit's ``run_pair.sh rw_stop``); a live
one opened with ``sync_interval_s=60`` to 468 MiB. Now a process pins only
from before a commit of its own to the end of the sync that records it.

Real processes, real SIGSTOP; each test churns 40x a 4 MiB store's capacity
beside the other process and bounds the data file (the bound of
``tests/test_group_growth.py``). A process stopped while it writes still
holds its pin (an LMDB reader cannot be ended from outside): the writer
names it in a warning. And the pins that are let go must still keep the
rolled-back-to snapshot whole: a writer's commits after another process
recorded and went idle leave that record's pages alone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.lmdb.groupsync import read_record
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV
from ucm_db.store import sync_health

from .harness import NS, chain_tokens, fork_call, kill_and_reap, log_line, payload_for, tail, wait_counter, write_counter

pytestmark = [pytest.mark.multiprocess]

CAPACITY_BYTES = 4 << 20
BLOCK_BYTES = 64 << 10
OPTIONS = {"codec": "none", "durability": "group", "capacity_bytes": CAPACITY_BYTES, "sync_interval_s": 0.1}

#: A router: opens the store as ``ucm_db.open(path)`` does (writable, the store's group durability),
#: says so, and polls the change feed. argv: path, ready file, sync_interval_s.
ROUTER = """
import os, sys, time
import ucm_db
with ucm_db.open(sys.argv[1], sync_interval_s=float(sys.argv[3])) as store:
    seq = store.feed_position()
    store.changes_since(seq)
    open(sys.argv[2] + ".new", "w").write("1"); os.replace(sys.argv[2] + ".new", sys.argv[2])
    while True:
        store.changes_since(seq)
        time.sleep(0.02)
"""

#: A writer that puts (and flushes, unless argv[3] is "noflush"), says so, and idles (no rounds: 3600 s).
WRITER = """
import os, signal, sys
import ucm_db
from ucm_db.keys import Namespace
ns = Namespace(model="reliability-suite", kv_dtype="bfloat16", block_size=4)
store = ucm_db.open(sys.argv[1], sync_interval_s=3600.0)
store.put(ns, ns.block_keys(list(range(999_000, 999_016))), [os.urandom(64 << 10)] * 4)
if sys.argv[3] != "noflush":
    store.flush()
open(sys.argv[2] + ".new", "w").write("1"); os.replace(sys.argv[2] + ".new", sys.argv[2])
while True:
    signal.pause()
"""


@contextmanager
def _other_process(tmp_path: Path, script: str, *args: str) -> Iterator[int]:
    """``script`` running in a new interpreter (this process has the store
    open: its threads' locks must not be forked), once it said it is ready."""
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    with open(tmp_path / "other.log", "wb") as log:
        other = subprocess.Popen([sys.executable, "-c", script, *map(str, args[:1]), str(ready), *args[1:]],
                                 stdout=log, stderr=log)
    try:
        assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "other.log")
        yield other.pid
    finally:
        os.kill(other.pid, signal.SIGCONT)
        kill_and_reap(other.pid)
        other.wait()


def _churn(store: ucm_db.Store, times_capacity: int = 40) -> None:
    """Puts ``times_capacity`` x the capacity in 4-block chains (each evicting older ones)."""
    for round_ in range(times_capacity * CAPACITY_BYTES // (4 * BLOCK_BYTES)):
        tokens = list(range(round_ * 1000, round_ * 1000 + 16))
        store.put(NS, NS.block_keys(tokens), [os.urandom(BLOCK_BYTES)] * 4, parent=None)


def _file_bytes(store_path: Path) -> int:
    return os.path.getsize(store_path / "lmdb" / "data.mdb")


def _bound_bytes(store: ucm_db.Store) -> int:
    return 2 * CAPACITY_BYTES + store.config.sync_bytes


def test_a_router_stopped_after_its_open_grows_no_writers_file(tmp_path: Path) -> None:
    """Before: 213 MiB against a 40 MiB bound (the router's pin, taken at its open, never moved again)."""
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        _churn(store, 1)
        with _other_process(tmp_path, ROUTER, store_path, "1.0") as router:
            os.kill(router, signal.SIGSTOP)
            _churn(store)
            bound = _bound_bytes(store)
    assert _file_bytes(store_path) <= bound, _file_bytes(store_path)


def test_a_live_router_with_a_long_sync_interval_grows_no_writers_file(tmp_path: Path) -> None:
    """Before: 213 MiB against 40 MiB (the router's pin moved only at its own syncs, a minute apart)."""
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        _churn(store, 1)
        with _other_process(tmp_path, ROUTER, store_path, "60"):
            _churn(store)
            bound = _bound_bytes(store)
    assert _file_bytes(store_path) <= bound, _file_bytes(store_path)


def test_a_writer_stopped_after_its_flush_grows_no_writers_file(tmp_path: Path) -> None:
    """A process that put, flushed and then was stopped (a vLLM engine
    paused between requests). Before: 212 MiB against 40 MiB, its pin on its flush's snapshot kept."""
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        with _other_process(tmp_path, WRITER, store_path, "flush") as writer:
            os.kill(writer, signal.SIGSTOP)
            _churn(store)
            bound = _bound_bytes(store)
    assert _file_bytes(store_path) <= bound, _file_bytes(store_path)


def _growth_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "past its bound" in r.getMessage()]


def test_a_writer_stopped_while_it_holds_a_pin_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process stopped after a put it has not synced yet holds its pin
    (no one can end it): the file grows, and the writer's maintenance
    thread names the stopped process and how far behind its snapshot is
    (once its slot kept one snapshot for STUCK_S, shortened here)."""
    caplog.set_level(logging.WARNING, logger="ucm_db")
    monkeypatch.setattr(sync_health, "STUCK_S", 0.3)
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        with _other_process(tmp_path, WRITER, store_path, "noflush") as writer:
            os.kill(writer, signal.SIGSTOP)
            _churn(store)
            # The rounds (every sync_interval_s) check the growth; the slot must have been seen for STUCK_S
            # past the bound, which a fast host's churn outruns: wait for a round after that.
            deadline_s = time.monotonic() + 10
            while not _growth_warnings(caplog) and time.monotonic() < deadline_s:
                time.sleep(0.05)
    assert _file_bytes(store_path) > 2 * CAPACITY_BYTES + 8 * (CAPACITY_BYTES // 2), "the pin kept pages from reuse"
    named = _growth_warnings(caplog)
    assert named and f"pid {writer} (running or stopped) holds a snapshot" in named[0], named


# -- the pins that are let go still keep the rollback's snapshot whole ---------------
GROUP = {"codec": "none", "durability": "group", "sync_interval_s": 3600.0, "sync_bytes": 1 << 40,
         "capacity_bytes": 1 << 30}
RECORDED, CHURNED = 16, 48  # blocks the idle process records, blocks the writer churns after


def _recorder(store_path: Path, recorded: Path) -> None:
    """Child: puts RECORDED blocks and flushes (its record, then no pin), idles."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    store = ucm_db.open(store_path, **GROUP)
    keys = NS.block_keys(chain_tokens("recorded", RECORDED))
    store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
    store.flush()
    write_counter(recorded, 1)
    signal.pause()


def _churner(store_path: Path, opened: Path, go: Path, done: Path) -> None:
    """Child: opens before the recorder's flush, then deletes the recorded
    blocks and puts others in their place, unsynced (their pages are free
    for reuse unless a pin keeps them), and waits to be killed."""
    os.environ[BOOT_ID_ENV] = "boot-a"
    store = ucm_db.open(store_path, **GROUP)
    write_counter(opened, 1)
    wait_counter(go, 1, timeout_s=60)
    recorded = NS.block_keys(chain_tokens("recorded", RECORDED))
    for i in range(CHURNED):
        store.delete(NS, recorded[-1 - i % RECORDED:])
        keys = NS.block_keys(chain_tokens(f"churn-{i}", 2))
        store.put(NS, keys, [payload_for(k, BLOCK_BYTES) for k in keys])
    write_counter(done, 1)
    signal.pause()


def test_commits_after_another_process_recorded_and_idled_leave_its_snapshot_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The churner opened before the recorder flushed; the recorder then
    holds no pin. The churner pins before its first commit (on the
    recorder's snapshot: nothing committed since), so its deletes and puts
    reuse none of that snapshot's pages. After the reboot the store rolls
    back to the recorder's record, whole."""
    store_path = tmp_path / "store"
    opened, recorded, done = tmp_path / "opened", tmp_path / "recorded", tmp_path / "done"
    churner = fork_call(_churner, store_path, opened, recorded, done, log_path=tmp_path / "churner.log")
    recorder = None
    try:
        assert wait_counter(opened, 1, timeout_s=60) == 1, tail(tmp_path / "churner.log")
        recorder = fork_call(_recorder, store_path, recorded, log_path=tmp_path / "recorder.log")
        assert wait_counter(done, 1, timeout_s=120) == 1, tail(tmp_path / "churner.log") + tail(tmp_path / "recorder.log")
        record = read_record(store_path / "lmdb")
    finally:
        kill_and_reap(churner)
        if recorder is not None:
            kill_and_reap(recorder)
    monkeypatch.setenv(BOOT_ID_ENV, "boot-b")  # the machine rebooted
    keys = NS.block_keys(chain_tokens("recorded", RECORDED))
    with ucm_db.open(store_path, **GROUP) as store:
        rollback = store._tier.engine.rollback  # type: ignore[attr-defined]
        assert record is not None and rollback is not None and rollback.to_txnid == record.txnid
        assert store.get(NS, keys) == [payload_for(k, BLOCK_BYTES) for k in keys], "the recorded snapshot, whole"
        assert store._tier.check() == []
        assert store.stats().quarantined == 0


# -- power cuts under two writers, one idling between puts ----------------------------
PC_OPTIONS = {"codec": "none", "durability": "group", "sync_interval_s": 0.01, "capacity_bytes": 1 << 30,
              "map_size_bytes": 1 << 20, "encode_threads": 0}
PC_CUTS = 16
PC_BLOCK_BYTES = 24 << 10


_log = log_line


def _pc_payloads(label: str) -> tuple[list[bytes], list[bytes]]:
    keys = NS.block_keys(chain_tokens(label, 2))
    return keys, [payload_for(k, PC_BLOCK_BYTES) for k in keys]


def _pc_writer(store_path: Path, log: Path, boot: str, name: str, idles: bool) -> None:
    """Child: puts 2-block chains (intent line before, ack line after), flushes
    now and then ("S": every ack before it is durable); with ``idles``,
    pauses between puts long enough for a sync round to let its pin go."""
    import random
    import time

    os.environ[BOOT_ID_ENV] = boot
    rng = random.Random()
    store = ucm_db.open(store_path, **PC_OPTIONS)
    _log(log, "O")
    for i in range(10_000):
        label = f"{name}-{i}"
        keys, payloads = _pc_payloads(label)
        _log(log, f"I {label}")
        store.put(NS, keys, payloads)
        _log(log, f"A {label}")
        if rng.random() < 0.3:
            store.flush()
            _log(log, "S")
        if idles and rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.04))


def _pc_check(store_path: Path, logs: list[Path], boot: str, result: Path) -> None:
    """Child, after the cut: every flushed chain there and whole, every other one whole or absent, nothing damaged."""
    os.environ[BOOT_ID_ENV] = boot
    intents: list[str] = []
    durable: set[str] = set()
    for log in logs:
        acked: set[str] = set()
        for line in (log.read_text() if log.exists() else "").splitlines():
            parts = line.split()
            if parts == ["S"]:
                durable |= acked
            elif len(parts) == 2 and parts[0] in "IA":
                (intents.append if parts[0] == "I" else acked.add)(parts[1])
    problems = []
    with ucm_db.open(store_path, **PC_OPTIONS) as store:
        rolled_back = store._tier.engine.rollback is not None  # type: ignore[attr-defined]
        for label in intents:
            keys, payloads = _pc_payloads(label)
            got = store.get(NS, keys)
            if label in durable and got != payloads:
                problems.append(f"flushed {label} lost or wrong")
            elif got not in ([None, None], [payloads[0], None], payloads):
                problems.append(f"{label} wrong or torn")
        problems += [f"index: {p}" for p in store._tier.check()]
        if store.stats().quarantined:
            problems.append(f"{store.stats().quarantined} quarantined")
    if (store_path / "damaged").exists():
        problems.append("set aside")
    result.write_text("\n".join(problems) or ("ok, rolled back" if rolled_back else "ok"))


def test_power_cuts_under_two_writers_one_idling_lose_nothing_flushed(tmp_path: Path) -> None:
    """The power-cut file system (test_powercut.py): two writers, one
    pausing between puts (each pause lets its pin go at a sync round, the
    next put pins again), SIGKILLed together at a random instant, then the
    power is cut (every unsynced page dropped, or a random subset kept) and
    the store reopened under a new boot."""
    import random
    import time

    from .harness import run_child
    from .powercut import PowerCutMount

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    rollbacks = 0
    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        for cut in range(PC_CUTS):
            mount.strict_names(cut % 2 == 1)
            store_path = tmp_path / "mnt" / f"store-{cut}"
            logs = [tmp_path / f"log-{cut}-{n}" for n in "ab"]
            pids = [fork_call(_pc_writer, store_path, log, f"boot-{cut}", n, n == "b", log_path=tmp_path / "writer.log")
                    for n, log in zip("ab", logs)]
            try:
                deadline = time.monotonic() + 30
                while not all(log.exists() for log in logs) and time.monotonic() < deadline:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0.02, 0.2))
            finally:
                statuses = [kill_and_reap(pid) for pid in pids]
            assert statuses == [-9, -9], tail(tmp_path / "writer.log")
            mount.cut("random" if cut % 4 >= 2 else "drop", rng.randrange(1 << 30))
            result = tmp_path / "result"
            result.unlink(missing_ok=True)
            code = run_child(_pc_check, store_path, logs, f"boot-{cut}-after", result, log_path=tmp_path / "check.log",
                             timeout_s=120)
            assert code == 0 and result.read_text().startswith("ok"), f"cut {cut}: {tail(result)}\n{tail(tmp_path / 'check.log')}"
            rollbacks += result.read_text() == "ok, rolled back"
    assert rollbacks > 0, "no cut tore unsynced commits: the simulator did not bite"
