"""Power cuts under a RocksDB writer, on a file system that forgets unsynced
writes (the FUSE simulator of :mod:`tests.reliability.powercut`; the LMDB
engine's cuts are :mod:`tests.reliability.test_powercut`).

Each cycle starts a writer process that opens a RocksDB store and puts
chains, each in two puts (logging an intent line before each put, an ack
line after it returns and, with ``group``, a sync line after each
``Store.flush()``), SIGKILLs it 0-300 ms after it opened the store, cuts the
power (every unsynced page dropped, or a random subset of them kept at
random versions), and checks the store in a fresh process, as a reboot
would see it. Every other writer runs with tiny memtables, so cuts also fall
in flushes, compactions and log switches, not only in log appends.

After every cut:

* the store opens, read-only (the private shadow of pinned files) and for
  writing, and ``verify`` finds no problem;
* ``sync``: every acknowledged block is there and whole; ``group``: every
  block acknowledged before the last completed flush is;
* any other block is absent or whole: nothing wrong is served, no put is
  half there, nothing is quarantined, and the read-only and the writing
  open serve the same blocks.

Every other store lives on the simulator with ``names strict`` (a name is
durable only once its directory is fsynced). Children are fresh
interpreters: a forked child of a process that ran RocksDB's threads may
hang on a lock held at the fork. The log lives on the real disk: it is the
outside observer. ``--long`` runs many more cuts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.engines.lmdb.recovery import BOOT_ID_ENV

from .harness import NS, log_line, segment_keys, segment_payloads, tail, write_cut_segments
from .powercut import PowerCutMount

pytestmark = [pytest.mark.multiprocess, pytest.mark.crash]

CUTS = 6            # per durability: both cut modes, both name modes, both memtable sizes
LONG_CUTS = 80      # per durability with --long
CYCLES_PER_STORE = 4
MAX_WRITE_S = 0.3
TINY_MEMTABLE_BYTES = 256 << 10
REPO = Path(__file__).resolve().parents[2]

Segment = tuple[str, int, int, int]  # chain label, its blocks, the put's first and end block


# -- the children (fresh interpreters: main) ----------------------------------------
_log, _keys = log_line, segment_keys
_payloads = segment_payloads  # 512 B - 24 KiB: inline values and blob files both


def _writer(store_path: str, durability: str, log_path: Path, cycle: int, tiny_memtable: bool) -> None:
    if tiny_memtable:
        import ucm_db.engines.rocksdb as rocksdb_engine
        rocksdb_engine.WRITE_BUFFER_BYTES = TINY_MEMTABLE_BYTES  # a flush every few puts
    rng = random.Random()
    store = ucm_db.open(store_path, engine="rocksdb", durability=durability, capacity_bytes=1 << 30)
    _log(log_path, "O")  # opened: the parent times the kill from here
    write_cut_segments(store, log_path, cycle, rng, durability, 100_000)


def _read_log(log_path: Path, durability: str) -> tuple[list[Segment], set[Segment], set[Segment]]:
    """The puts begun, those acknowledged, and those the contract keeps."""
    intents: list[Segment] = []
    acked: set[Segment] = set()
    durable: set[Segment] = set()
    for line in (log_path.read_text() if log_path.exists() else "").splitlines():
        parts = line.split()
        if parts == ["S"]:
            durable |= acked
        elif len(parts) == 5 and parts[0] in ("I", "A", "X"):  # else a line torn by the kill
            seg = (parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
            if parts[0] == "X":  # acked after the last flush and lost by an earlier cut: allowed, stays lost
                acked.discard(seg)
                durable.discard(seg)
            else:
                (intents.append if parts[0] == "I" else acked.add)(seg)
    return intents, acked, (set(acked) if durability == "sync" else durable)


def _served(store: ucm_db.Store, intents: list[Segment]) -> dict[str, list[bool] | str]:
    """Per put begun: which of its blocks are served whole; ``"wrong"`` if
    any served block has other bytes."""
    out: dict[str, list[bool] | str] = {}
    for label, n, start, end in intents:
        keys = _keys(label, n)[start:end]
        got = store.get(NS, keys)
        name = f"{label}[{start}:{end}]"
        wrong = any(have is not None and bytes(have) != want for have, want in zip(got, _payloads(keys)))
        out[name] = "wrong" if wrong else [have is not None for have in got]
    return out


def _check(store_path: str, durability: str, log_path: Path, result_path: Path) -> None:
    intents, acked, durable = _read_log(log_path, durability)
    with ucm_db.open(store_path, read_only=True) as store:
        read_only = _served(store, intents)
    with ucm_db.open(store_path, engine="rocksdb", durability=durability) as store:
        writing = _served(store, intents)
        quarantined = store.stats().quarantined
    report = maintenance.verify(store_path)
    result: dict[str, Any] = {"wrong": [], "torn": [], "lost": [], "durable_blocks": 0, "acked_not_durable": 0,
                              "acked_not_durable_missing": 0, "quarantined": quarantined,
                              "verify": str(report) if report.problems else "",
                              "disagree": sorted(name for name in writing if writing[name] != read_only.get(name))}
    for seg in intents:
        label, n, start, end = seg
        name = f"{label}[{start}:{end}]"
        served = writing[name]
        if served == "wrong":
            result["wrong"].append(name)
            continue
        if len(set(served)) > 1:
            result["torn"].append(name)  # a put is atomic: all or nothing
        if seg in durable:
            result["durable_blocks"] += len(served)
            if not all(served):
                result["lost"].append(name)
        elif seg in acked:
            result["acked_not_durable"] += len(served)
            result["acked_not_durable_missing"] += served.count(False)
            if not any(served):
                _log(log_path, f"X {label} {n} {start} {end}")
    _log(log_path, "S")  # the writing open's close flushed: what this check saw is durable
    result_path.write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    """A child's entry point: ``writer STORE DURABILITY LOG CYCLE TINY`` or
    ``check STORE DURABILITY LOG RESULT``."""
    role, store_path, durability, log_path = argv[:4]
    if role == "writer":
        _writer(store_path, durability, Path(log_path), int(argv[4]), argv[5] == "1")
    else:
        _check(store_path, durability, Path(log_path), Path(argv[4]))


def _child(args: list[str], log: Path, boot: str) -> subprocess.Popen[bytes]:
    code = "import sys; from tests.reliability.test_powercut_rocksdb import main; main(sys.argv[1:])"
    with open(log, "ab") as log_file:
        return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=log_file, stderr=log_file,
                                env={**os.environ, BOOT_ID_ENV: boot})  # a new boot id per cut: a reboot


# -- the cuts -------------------------------------------------------------------------
def _run_cuts(tmp_path: Path, durability: str, cuts: int) -> dict[str, Any]:
    mount_dir = tmp_path / "mnt"
    totals: dict[str, Any] = {"cuts": 0, "durable_blocks_checked": 0, "acked_after_last_flush": 0,
                              "acked_after_last_flush_missing": 0, "unsynced_pages_dropped": 0, "unsynced_pages_kept": 0}
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    started = time.monotonic()
    with PowerCutMount(mount_dir, tmp_path) as mount:
        store_path = log_path = Path()
        for cycle in range(cuts):
            if cycle % CYCLES_PER_STORE == 0:
                mount.strict_names(cycle // CYCLES_PER_STORE % 2 == 1)
                store_path, log_path = mount_dir / f"store-{cycle}", tmp_path / f"log-{cycle}.txt"
            writer_log = tmp_path / "writer.log"
            opened = log_path.read_text().count("O\n") + 1 if log_path.exists() else 1
            writer = _child(["writer", str(store_path), durability, str(log_path), str(cycle), str(cycle % 2)],
                            writer_log, f"boot-{cycle}")
            try:
                deadline = time.monotonic() + 120
                while not log_path.exists() or log_path.read_text().count("O\n") < opened:
                    assert writer.poll() is None and time.monotonic() < deadline, (
                        f"cut {cycle}: the writer did not open the store:\n{tail(writer_log)}")
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, MAX_WRITE_S))
                assert writer.poll() is None, f"cut {cycle}: the writer died by itself:\n{tail(writer_log)}"
            finally:
                writer.kill()
                writer.wait()
            mode = "random" if (cycle // 2) % 2 else "drop"
            cut = mount.cut(mode, rng.randrange(1 << 30))
            totals["unsynced_pages_dropped"] += cut["unsynced_pages"] - cut["kept"]
            totals["unsynced_pages_kept"] += cut["kept"]
            result_path, check_log = tmp_path / "result.json", tmp_path / "check.log"
            result_path.unlink(missing_ok=True)
            checker = _child(["check", str(store_path), durability, str(log_path), str(result_path)], check_log,
                             f"boot-{cycle + 1}")
            where = f"cut {cycle} ({durability}, {mode} cut, {'tiny' if cycle % 2 else 'default'} memtables)"
            assert checker.wait(timeout=180) == 0, f"{where}: opening or reading the store failed:\n{tail(check_log)}"
            result = json.loads(result_path.read_text())
            assert result["wrong"] == [], f"{where}: wrong bytes served: {result['wrong'][:5]}"
            assert result["torn"] == [], f"{where}: puts half there: {result['torn'][:5]}"
            assert result["lost"] == [], f"{where}: acknowledged durable blocks lost: {result['lost'][:5]}"
            assert result["quarantined"] == 0, f"{where}: {result['quarantined']} blocks quarantined"
            assert result["verify"] == "", f"{where}: verify found problems: {result['verify']}"
            assert result["disagree"] == [], f"{where}: read-only and writing opens differ on {result['disagree'][:5]}"
            totals["cuts"] += 1
            totals["durable_blocks_checked"] += result["durable_blocks"]
            totals["acked_after_last_flush"] += result["acked_not_durable"]
            totals["acked_after_last_flush_missing"] += result["acked_not_durable_missing"]
    totals["wall_s"] = round(time.monotonic() - started, 1)
    print(f"\nRocksDB power cuts ({durability}): {json.dumps(totals)}")
    return totals


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_rocksdb_power_cuts_lose_nothing_beyond_the_durability_contract(tmp_path: Path, durability: str) -> None:
    totals = _run_cuts(tmp_path, durability, CUTS)
    assert totals["cuts"] == CUTS
    assert totals["durable_blocks_checked"] > 0, "no cut found durable blocks to check: the writer never got going"
    assert totals["unsynced_pages_dropped"] > 0, "no cut dropped an unsynced page: the simulator did not bite"


@pytest.mark.long
@pytest.mark.parametrize("durability", ["sync", "group"])
def test_rocksdb_power_cuts_long(tmp_path: Path, durability: str) -> None:
    totals = _run_cuts(tmp_path, durability, LONG_CUTS)
    assert totals["cuts"] == LONG_CUTS and totals["durable_blocks_checked"] > 0
    assert totals["unsynced_pages_dropped"] > 0
