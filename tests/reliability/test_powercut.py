"""Power cuts under a writer, on a file system that forgets unsynced writes.

The store lives on the FUSE file system of :mod:`tests.reliability.powercut`
(real LMDB files, real fsyncs, the kernel's real page cache and mmap): it
keeps written data only once it is fsynced. Each cycle forks a writer that
opens the store and puts chains (logging an intent line before each put, an
ack line after it returns and, with ``group``, a sync line after each
``Store.flush()``), SIGKILLs it at a random instant (0-100 ms after its start
or, every other cycle, after it opened the store), cuts the power (the file
system drops every unsynced page, or a random subset of them at random
versions), and reopens the store in a fresh process under a new boot id (what
a reboot looks like to ucm-db) to check it against the log:

Each durability mode is reached by every opening path (``OPENINGS``): the
option passed to :func:`ucm_db.open`; the store created with it and every
later writer opening it without options, as the CLI does (the recorded
setting); and the connector's ``kv_connector_extra_config`` without
``durability``, parsed by the connector's own settings code. Issue 46: a
``sync`` store reopened without options ran unsynced and lost every acked
block at the cut.

* ``sync``: every acknowledged block is there and whole;
* ``group``: every block acknowledged before the last completed sync is there
  and whole;
* any other block is absent or whole (nothing wrong is ever served, nothing
  is quarantined), the index is consistent, and the store opened without
  being set aside.

Every other store lives on the simulator with ``names strict``: a name is
durable only once its directory is fsynced (POSIX), not with any fsync as in
ext4's journal.

The log lives on the real disk: it is the outside observer, not part of the
machine that lost power. Failing to mount FUSE fails the test with the
reason (never a skip).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import (
    NS, fork_call, kill_and_reap, log_line, run_child, segment_keys, segment_payloads, tail, write_cut_segments,
)
from .powercut import PowerCutMount

pytestmark = [pytest.mark.multiprocess, pytest.mark.crash, pytest.mark.slow]

OPENINGS = ("explicit", "recorded", "connector")
CUTS = 34           # per durability and opening path: 204 per normal run
LONG_CUTS = 334     # per durability and opening path with --long: 2004
CYCLES_PER_STORE = 8
MAX_WRITE_S = 0.1
OPTIONS = {"capacity_bytes": 1 << 30, "sync_interval_s": 0.05, "encode_threads": 0, "map_size_bytes": 1 << 20}  # the map grows under the cuts


# -- the writer (a forked child) ---------------------------------------------------
_log, _segment, _payloads = log_line, segment_keys, segment_payloads


def _open_for_writing(store_path: str, durability: str, opening: str) -> ucm_db.Store:
    """The store opened as ``opening`` says (module docstring). A new store
    is always created with ``durability``: that is what it records."""
    if opening == "explicit" or not Path(store_path).exists():
        return ucm_db.open(store_path, durability=durability, **OPTIONS)
    unrecorded = {k: v for k, v in OPTIONS.items() if k != "capacity_bytes"}
    if opening == "recorded":
        return ucm_db.open(store_path, **unrecorded)
    from ucm_db.connector.settings import ConnectorSettings

    settings = ConnectorSettings.from_extra_config({"path": store_path, **unrecorded})
    assert "durability" not in settings.store_options
    return ucm_db.open(settings.path, **settings.store_options)


def _writer(store_path: str, durability: str, opening: str, log_path: Path, boot: str, cycle: int) -> None:
    os.environ[BOOT_ID_ENV] = boot
    rng = random.Random()
    store = _open_for_writing(store_path, durability, opening)
    _log(log_path, "O")  # opened (the parent times most cuts from here)
    write_cut_segments(store, log_path, cycle, rng, durability, 10_000)


# -- the checker (a forked child, after the cut) --------------------------------------
def _check(store_path: str, durability: str, log_path: Path, boot: str, result_path: Path) -> None:
    os.environ[BOOT_ID_ENV] = boot
    intents: list[tuple[str, int, int, int]] = []
    acked: set[tuple[str, int, int, int]] = set()
    durable: set[tuple[str, int, int, int]] = set()
    for line in (log_path.read_text() if log_path.exists() else "").splitlines():
        parts = line.split()
        if not parts or (parts[0] != "S" and len(parts) != 5):
            continue  # a line torn by the kill
        if parts[0] == "S":
            durable |= acked
            continue
        seg = (parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
        if parts[0] == "X":  # acked after the last sync, and lost by an earlier cut: allowed, and stays lost
            acked.discard(seg)
            durable.discard(seg)
        else:
            (intents.append if parts[0] == "I" else acked.add)(seg)
    if durability == "sync":
        durable = set(acked)
    result: dict[str, Any] = {"durable_blocks": 0, "lost": [], "wrong": [], "torn": [], "acked_not_durable_missing": 0,
                              "acked_not_durable": 0}
    lost_by_contract: list[tuple[str, int, int, int]] = []
    with ucm_db.open(store_path, durability=durability, **OPTIONS) as store:
        engine = store._tier.engine
        result["rolled_back"] = engine.rollback is not None
        result["set_aside"] = (Path(store_path) / "damaged").exists() or (
            engine.recovery is not None and engine.recovery.damaged)
        for seg in intents:
            label, n, start, end = seg
            keys = _segment(label, n)[start:end]
            got = store.get(NS, keys)
            want = _payloads(keys)
            if len({have is None for have in got}) > 1:
                result["torn"].append(f"{label}[{start}:{end}]")  # a put is atomic: all or nothing
            if seg in acked and seg not in durable and got[0] is None:
                lost_by_contract.append(seg)
            for key, have, expected in zip(keys, got, want):
                if have is not None and have != expected:
                    result["wrong"].append(f"{label}[{start}:{end}] {key.hex()[:12]}")
                if seg in durable:
                    result["durable_blocks"] += 1
                    if have is None:
                        result["lost"].append(f"{label}[{start}:{end}] {key.hex()[:12]}")
                elif seg in acked:
                    result["acked_not_durable"] += 1
                    result["acked_not_durable_missing"] += have is None
        result["quarantined"] = store.stats().quarantined
        result["index_problems"] = store._tier.check()
    for label, n, start, end in lost_by_contract:
        _log(log_path, f"X {label} {n} {start} {end}")
    _log(log_path, "S")  # closing synced: what this check saw is durable
    result_path.write_text(json.dumps(result))


def _run_cuts(tmp_path: Path, durability: str, cuts: int, opening: str = "explicit") -> dict[str, Any]:
    mount_dir = tmp_path / "mnt"
    totals: dict[str, Any] = {"cuts": 0, "durable_blocks_checked": 0, "acked_after_last_sync": 0,
                              "acked_after_last_sync_missing": 0, "rollbacks": 0, "unsynced_pages_dropped": 0,
                              "unsynced_pages_kept": 0, "set_aside": 0, "quarantined": 0}
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    started = time.monotonic()
    with PowerCutMount(mount_dir, tmp_path) as mount:
        store_path = log_path = None
        for cycle in range(cuts):
            if cycle % CYCLES_PER_STORE == 0:
                mount.strict_names(cycle // CYCLES_PER_STORE % 2 == 1)  # every other store: names by directory syncs only
                store_path = str(mount_dir / f"store-{cycle}")
                log_path = tmp_path / f"log-{cycle}.txt"
            assert store_path is not None and log_path is not None
            writer_log = tmp_path / "writer.log"
            log_bytes = log_path.stat().st_size if log_path.exists() else 0
            pid = fork_call(_writer, store_path, durability, opening, log_path, f"boot-{cycle}", cycle, log_path=writer_log)
            if cycle % 2:  # every other cut while writing (however slow the machine), the others from the start
                deadline = time.monotonic() + 30
                while (not log_path.exists() or log_path.stat().st_size == log_bytes) and time.monotonic() < deadline:
                    time.sleep(0.002)
            time.sleep(rng.uniform(0.0, MAX_WRITE_S))
            status = kill_and_reap(pid)
            assert status == -9, f"the writer died by itself (status {status}) before its cut:\n{tail(writer_log)}"
            mode = "random" if (cycle // 2) % 2 else "drop"  # both modes with both timings
            cut = mount.cut(mode, rng.randrange(1 << 30))
            totals["unsynced_pages_dropped"] += cut["unsynced_pages"] - cut["kept"]
            totals["unsynced_pages_kept"] += cut["kept"]
            result_path = tmp_path / "result.json"
            result_path.unlink(missing_ok=True)
            check_log = tmp_path / "check.log"
            code = run_child(_check, store_path, durability, log_path, f"boot-{cycle + 1}", result_path,
                             log_path=check_log, timeout_s=120)
            assert code == 0, f"cut {cycle} ({mode}): reopening the store failed:\n{tail(check_log)}"
            result = json.loads(result_path.read_text())
            where = f"cut {cycle} ({durability} opened {opening}, {mode} cut)"
            assert result["wrong"] == [], f"{where}: wrong bytes served: {result['wrong'][:5]}"
            assert result["torn"] == [], f"{where}: puts half there: {result['torn'][:5]}"
            assert result["lost"] == [], f"{where}: acknowledged durable blocks lost: {result['lost'][:5]}"
            assert not result["set_aside"], f"{where}: the store was set aside"
            assert result["quarantined"] == 0, f"{where}: {result['quarantined']} blocks quarantined (damage was visible)"
            assert result["index_problems"] == [], f"{where}: index problems {result['index_problems'][:5]}"
            totals["cuts"] += 1
            totals["durable_blocks_checked"] += result["durable_blocks"]
            totals["acked_after_last_sync"] += result["acked_not_durable"]
            totals["acked_after_last_sync_missing"] += result["acked_not_durable_missing"]
            totals["rollbacks"] += result["rolled_back"]
    totals["wall_s"] = round(time.monotonic() - started, 1)
    print(f"\npower cuts ({durability}, opened {opening}): {json.dumps(totals)}")
    return totals


@pytest.mark.parametrize("opening", OPENINGS)
@pytest.mark.parametrize("durability", ["sync", "group"])
def test_power_cuts_lose_nothing_beyond_the_durability_contract(tmp_path: Path, durability: str, opening: str) -> None:
    totals = _run_cuts(tmp_path, durability, CUTS, opening)
    assert totals["cuts"] == CUTS
    assert totals["durable_blocks_checked"] > 0, "no cut found durable blocks to check: the writer never got going"
    if durability == "group":
        assert totals["rollbacks"] > 0, "no cut ever tore unsynced group commits: the simulator did not bite"


@pytest.mark.long
@pytest.mark.parametrize("opening", OPENINGS)
@pytest.mark.parametrize("durability", ["sync", "group"])
def test_power_cuts_long(tmp_path: Path, durability: str, opening: str) -> None:
    totals = _run_cuts(tmp_path, durability, LONG_CUTS, opening)
    assert totals["cuts"] == LONG_CUTS and totals["durable_blocks_checked"] > 0
