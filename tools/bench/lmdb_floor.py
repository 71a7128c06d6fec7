"""What LMDB itself costs a stored unit: ``ucm-db bench lmdb-floor``.

    ucm-db bench lmdb-floor [--unit-kib 16,64,2048] [--live-mib 256] [--txns 200] [--repeat 3]
                            [--records format3|folded|body]
                            [--dir DIR] [--json]

The in-engine save target of issue 50 compares the connector's writer, which
stores a block as one unit per KV head (16 KiB at 2 layers, 64 KiB at 8),
against ``bench core``'s durable put of 2 MiB blocks. This benchmark asks
how much of that gap is LMDB's own, with none of ucm-db's code: bare
py-lmdb writes, per unit, the records the store writes (format 3: head,
body, metadata and child link under the unit's random key; recency
appended in put order), in transactions of
:func:`units_per_txn` units, into a store whose live set is held at
``--live-mib`` by deleting the oldest units in the same transactions (a
full store's eviction: later commits reuse the freed pages; 0: a growing
store, as a fresh one). The file is
synced every :data:`SYNC_EVERY_TXNS` transactions, as group durability
does, inside the measured window.

``--records body`` writes the unit's body alone under its key (no head,
metadata, recency or child link): the least any record layout writes for a
unit, so the ceiling a store format with fewer records a unit could reach
(``format3``, the default, is the store's layout today). ``--records
folded`` is the candidate between them: head and metadata inside the body's
value (one randomly keyed record), recency and child link as format 3.
``--records headmeta`` keeps the body alone and folds the head into the
metadata record instead (both small: a touch would rewrite the head, not
the body), recency and child link as format 3.

Two settings of the environment, in turns:

* ``pwrite`` (``writemap=False``: the store's setting, DESIGN.md): a commit
  copies each dirty page into the page cache with ``pwrite``, one call per
  run of adjacent pages;
* ``writemap`` (``writemap=True``, which the design forbids: a write fault
  on a full disk is SIGBUS): the pages are written in place in the shared
  mapping, no copy and no call per page.

Figures per unit size and setting, medians of ``--repeat``: user and
kernel CPU microseconds a unit (``getrusage(RUSAGE_THREAD)`` of the one
thread that writes and syncs) and GB/s of unit bytes per CPU second; the
ratio of each size's figure to the largest size's (the baseline's unit).

``host`` is what one 4 KiB ``pwrite`` into a page the page cache already
holds costs the kernel on the scratch directory's file system (a file
written 256 KiB at a time, LMDB's longest commit write, then synced): a
commit pays about that for every page it dirtied, apart from the runs of a
large value's overflow pages.

Invariants:
    * Nothing of ucm-db's store is imported (only the benchmarks' option
      parsing): the figures are LMDB's and the kernel's alone. Every
      scratch file is removed.
    * glibc's malloc keeps freed memory as the store's LMDB engine tells it
      to (:func:`keep_freed_memory`, the same thresholds, which a test holds
      equal to the engine's): LMDB mallocs a
      large value's overflow pages and frees them at commit, and memory
      given back to the system is paid for again at the next commit (on a
      virtual machine that returns freed pages to its host, several times
      the copy), which would make the largest units look slow.
    * Settings take turns within a repetition, each on a fresh
      environment, so a slow spell of the shared host hits both.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import platform
import random
import resource
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import lmdb

from ucm_db.tools.bench.common import int_list

#: Transactions between two syncs of the file (group durability's interval at these rates).
SYNC_EVERY_TXNS = 16
#: Bytes of units one transaction holds at most (and units at most), as the writer's coalescing rounds.
TXN_MAX_BYTES, TXN_MAX_UNITS = 32 << 20, 64
#: Untimed transactions before a growing store's (``--live-mib 0``) timed ones.
GROWING_WARM_TXNS = 4
#: Sizes of the format-3 records beside the body (a 1-frame head; the metadata record).
HEAD_BYTES, META_BYTES = 120, 88
SETTINGS = ("pwrite", "writemap")
#: ``--records``: the store's format-3 records a unit, or the body alone (module docstring).
RECORDS = ("format3", "folded", "body", "headmeta")
PAGE_BYTES = 4096
#: The host probe: file size and 4 KiB writes timed per kind.
PROBE_FILE_BYTES, PROBE_WRITES = 64 << 20, 4096


#: glibc's ``mallopt`` parameters and the store's LMDB engine's values (ucm_db/engines/lmdb/malloc.py).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 32 << 20, 128 << 20


def keep_freed_memory() -> bool:
    """Tells glibc to keep freed memory (see the invariants); False where
    there is no glibc ``mallopt``."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


def units_per_txn(unit_bytes: int) -> int:
    return max(1, min(TXN_MAX_UNITS, TXN_MAX_BYTES // unit_bytes))


def _thread_cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


@dataclass(frozen=True)
class Run:
    unit_bytes: int
    setting: str
    units: int
    user_s: float
    sys_s: float
    #: Entries of each table at the end: the live units' records (what the deletes left).
    records: dict[str, int]

    def us_a_unit(self, which: str) -> float:
        return 1e6 * (self.user_s if which == "user" else self.sys_s) / self.units

    def gb_s_per_cpu_s(self) -> float:
        return self.unit_bytes * self.units / (self.user_s + self.sys_s) / 1e9


def floor_once(unit_bytes: int, setting: str, live_bytes: int, txns: int, scratch: Path, records: str = "format3") -> Run:
    """One measurement: a fresh environment filled to its live set and
    churned once untimed, then ``txns`` transactions timed. ``live_bytes``
    0: nothing deleted, the file grows (a fresh store: what ``bench
    writer`` and ``bench core`` write into), after
    :data:`GROWING_WARM_TXNS` untimed transactions. ``records``: one of
    :data:`RECORDS` (``body``: every other table stays empty)."""
    if records not in RECORDS:
        raise ValueError(f"records {records!r}: one of {', '.join(RECORDS)}")
    whole, linked = records == "format3", records != "body"  # linked: recency and child link written
    per_txn = units_per_txn(unit_bytes)
    live_units = max(per_txn, live_bytes // unit_bytes) if live_bytes else None
    warm_txns = 2 * -(-live_units // per_txn) if live_units else GROWING_WARM_TXNS
    path = Path(tempfile.mkdtemp(prefix="ucm-bench-lmdb-floor-", dir=scratch))
    written_bytes = (warm_txns + txns) * per_txn * unit_bytes
    map_bytes = 2 * (written_bytes if live_units is None else min(written_bytes, 2 * live_bytes)) + (64 << 20)
    env = lmdb.open(str(path), map_size=map_bytes, max_dbs=8,
                    sync=False, metasync=False, readahead=True, writemap=setting == "writemap")
    try:
        tables = {name: env.open_db(name.encode()) for name in ("heads", "blocks", "meta", "lru", "children")}
        body, head, meta = os.urandom(unit_bytes), bytes(HEAD_BYTES), bytes(META_BYTES)
        value = body if records != "folded" else head + meta + body  # folded: one record holds all three
        live: collections.deque[tuple[bytes, bytes, bytes | None]] = collections.deque()  # key, recency key, child link
        sequence = 0
        start: tuple[float, float] | None = None
        for txn_index in range(warm_txns + txns):
            if txn_index == warm_txns:
                env.sync(True)
                start = _thread_cpu_s()
            with env.begin(write=True) as txn:
                parent = live[-1][0] if live else None  # one chain: each unit's child link is keyed by its parent
                for _ in range(per_txn):
                    key = os.urandom(32)
                    sequence += 1
                    lru = sequence.to_bytes(8, "big") + key
                    txn.put(key, value, db=tables["blocks"])
                    link = None if parent is None or not linked else parent + key
                    if whole:
                        txn.put(key, head, db=tables["heads"])
                        txn.put(key, meta, db=tables["meta"])
                    elif records == "headmeta":
                        txn.put(key, head + meta, db=tables["meta"])
                    if linked:
                        txn.put(lru, b"", db=tables["lru"])
                    if link is not None:
                        txn.put(link, b"", db=tables["children"])
                    live.append((key, lru, link))
                    parent = key
                while live_units is not None and len(live) > live_units:
                    old, old_lru, old_link = live.popleft()
                    for name in ("heads", "blocks", "meta") if whole else ("blocks", "meta") if records == "headmeta" else ("blocks",):
                        txn.delete(old, db=tables[name])
                    if linked:
                        txn.delete(old_lru, db=tables["lru"])
                    if old_link is not None:
                        txn.delete(old_link, db=tables["children"])
            if (txn_index + 1) % SYNC_EVERY_TXNS == 0:
                env.sync(True)
        env.sync(True)
        assert start is not None
        user_s, sys_s = (now - before for now, before in zip(_thread_cpu_s(), start))
        with env.begin() as txn:
            entries = {name: int(txn.stat(table)["entries"]) for name, table in tables.items()}
        return Run(unit_bytes, setting, txns * per_txn, user_s, sys_s, entries)
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def probe_page_write(scratch: Path, writes: int = PROBE_WRITES, file_bytes: int = PROBE_FILE_BYTES) -> float:
    """Kernel microseconds of one 4 KiB ``pwrite`` into a cached page (module docstring)."""
    directory = Path(tempfile.mkdtemp(prefix="ucm-bench-page-writes-", dir=scratch))
    try:
        fd = os.open(directory / "probe", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            chunk = bytes(256 << 10)
            for offset in range(0, file_bytes, len(chunk)):
                os.pwrite(fd, chunk, offset)
            os.fdatasync(fd)
            rng, page = random.Random(7), bytes(PAGE_BYTES)
            _, sys_before = _thread_cpu_s()
            for _ in range(writes):
                os.pwrite(fd, page, rng.randrange(file_bytes // PAGE_BYTES) * PAGE_BYTES)
            return round(1e6 * (_thread_cpu_s()[1] - sys_before) / writes, 2)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(unit_kib: Sequence[int], live_mib: int, txns: int, repeat: int, scratch: Path, records: str = "format3") -> dict[str, Any]:
    malloc_kept = keep_freed_memory()
    runs: list[Run] = []
    for _ in range(repeat):
        for kib in unit_kib:
            for setting in SETTINGS:
                runs.append(floor_once(kib << 10, setting, live_mib << 20, txns, scratch, records))
    rows: list[dict[str, Any]] = []
    for kib in unit_kib:
        for setting in SETTINGS:
            mine = [r for r in runs if r.unit_bytes == kib << 10 and r.setting == setting]
            rows.append({
                "unit_kib": kib, "setting": setting, "units_per_txn": units_per_txn(kib << 10),
                "user_us_a_unit": round(statistics.median(r.us_a_unit("user") for r in mine), 1),
                "sys_us_a_unit": round(statistics.median(r.us_a_unit("sys") for r in mine), 1),
                "gb_s_per_cpu_s": round(statistics.median(r.gb_s_per_cpu_s() for r in mine), 3),
                "runs_gb_s_per_cpu_s": [round(r.gb_s_per_cpu_s(), 3) for r in mine],
            })
    largest = max(unit_kib)
    for row in rows:
        base = next(r for r in rows if r["unit_kib"] == largest and r["setting"] == row["setting"])
        row["x_largest"] = round(row["gb_s_per_cpu_s"] / base["gb_s_per_cpu_s"], 3)
    return {"rows": rows, "records": records, "host_page_write_sys_us": probe_page_write(scratch), "live_mib": live_mib, "txns": txns,
            "repeat": repeat, "sync_every_txns": SYNC_EVERY_TXNS, "malloc_keeps_freed_memory": malloc_kept, "cpus": os.cpu_count(),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def format_table(report: dict[str, Any]) -> str:
    live = f"live set {report['live_mib']} MiB" if report["live_mib"] else "a growing store (no deletes)"
    kind = {"format3": "format-3 records a unit", "folded": "one record of head, metadata and body, recency and child "
            "link a unit (--records folded)", "body": "the body alone a unit (--records body)",
            "headmeta": "the body, one record of head and metadata, recency and child link a unit (--records headmeta)"}[report["records"]]
    lines = [f"bare py-lmdb, {kind}, {live}, {report['txns']} transactions "
             f"timed, synced every {report['sync_every_txns']}; medians of {report['repeat']}",
             f"{'unit KiB':>8} {'setting':<9} {'units/txn':>9} {'user us':>8} {'sys us':>8} {'GB/s/CPU s':>10} {'x largest':>9}"]
    for row in report["rows"]:
        lines.append(f"{row['unit_kib']:>8} {row['setting']:<9} {row['units_per_txn']:>9} {row['user_us_a_unit']:>8.1f} "
                     f"{row['sys_us_a_unit']:>8.1f} {row['gb_s_per_cpu_s']:>10.3f} {row['x_largest']:>9.3f}")
    lines.append(f"host: kernel us of one 4 KiB pwrite into a cached page {report['host_page_write_sys_us']}")
    lines.append(f"{report['cpus']} CPUs, load average at start {', '.join(map(str, report['load_avg']))}")
    return "\n".join(lines)


@click.command("lmdb-floor")
@click.option("--unit-kib", default="16,64,2048", show_default=True, callback=int_list,
              help="unit sizes, comma-separated, 4 KiB or more (the largest is the ratio's base)")
@click.option("--live-mib", type=click.IntRange(min=0), default=256, show_default=True,
              help="live set the deletes hold (0: no deletes, the file grows: a fresh store)")
@click.option("--txns", type=click.IntRange(min=1), default=200, show_default=True, help="timed transactions a run")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--records", type=click.Choice(RECORDS), default="format3", show_default=True,
              help="format3: the store's records a unit; folded: head and metadata inside the body's record; "
                   "headmeta: the head inside the metadata's record; "
                   "body: the body alone (the least a layout writes)")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="scratch directory (default: the system's temporary directory): its file system is measured")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(unit_kib: list[int], live_mib: int, txns: int, repeat: int, records: str, scratch_dir: Path | None,
            as_json: bool) -> None:
    """LMDB's own cost a stored unit (bare py-lmdb), with writemap off and on.

    Per unit size: user and kernel CPU a unit and GB/s per CPU second, the
    store's records written by bare py-lmdb, no ucm-db code; the floor of
    `ucm-db bench writer` at the connector's unit sizes.

    \b
    Example:
        ucm-db bench lmdb-floor
        ucm-db bench lmdb-floor --live-mib 0 --txns 40 --json
        ucm-db bench lmdb-floor --unit-kib 16,2048 --dir /mnt/nvme/scratch
        ucm-db bench lmdb-floor --unit-kib 16,64,256,2048 --records body
        ucm-db bench lmdb-floor --unit-kib 16,64,2048 --records folded
    """
    if min(unit_kib) < 4:
        raise click.BadParameter(f"unit sizes are 4 KiB or more; got {min(unit_kib)}", param_hint="--unit-kib")
    scratch = scratch_dir or Path(tempfile.gettempdir())
    scratch.mkdir(parents=True, exist_ok=True)
    report = run(unit_kib, live_mib, txns, repeat, scratch, records)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
