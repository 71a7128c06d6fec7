"""Maps the pages of an LMDB data file that the page cache already holds
into this process's page tables, once, in the background.

Why: LMDB reads through a read-only shared mapping of ``data.mdb``, and a
process takes a (minor) page fault the first time it touches each page,
cached or not: about 1-5 us each on a virtual machine. Commits are
copy-on-write, so B-tree pages keep moving to file offsets this process has
not mapped yet; on a large store that is hundreds of faults per put (at 1M
blocks, 220-380 per 64-block put against 6 at 10k: BENCHMARKS.md, Scale)
until the process has touched most of the file. A server keeps its store
open for days; paying those faults up front, off the request path, makes a
large store's puts and lookups cost what a small store's do.

Invariants:
    * Only pages resident in the page cache are populated (``mincore``,
      then ``MADV_POPULATE_READ`` on the resident runs): no disk read is
      asked for, and the page tables grow by at most 8 bytes per 4 KiB
      page that RAM already holds, and by at most 64 MiB in all
      (:data:`MAX_POPULATED_BYTES` of file; the rest faults in on use).
    * The work starts :data:`START_DELAY_S` after the open: a handle closed
      sooner (the connector's start-up check) never runs it, and an engine
      that is still starting does not share its cores with it (at 1M
      records, 0.3 s of CPU a process).
    * The work runs on one daemon thread, in chunks of :data:`CHUNK_BYTES`,
      each inside the caller-supplied ``guard`` (the engine's shared
      transaction gate, which a map resize takes exclusively), so a chunk
      never touches a mapping the engine has replaced; :meth:`Prefault.stop`
      waits for the chunk in progress, and the engine calls it before it
      unmaps the file.
    * Best effort: not Linux, a kernel without ``MADV_POPULATE_READ``
      (before 5.14), or a mapping not found ends it quietly. Nothing
      depends on it having run; ``UCM_DB_PREFAULT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ContextManager

from ucm_db.cpu_placement import place_current_thread

#: Seconds from the open to the start of the work (module invariants).
START_DELAY_S = 5.0
#: Bytes examined and populated per step (the guard is held for one step).
CHUNK_BYTES = 64 << 20
#: Most bytes of the file populated (8 bytes of page table per 4 KiB page).
MAX_POPULATED_BYTES = 32 << 30
#: ``madvise`` advice: populate page tables, read faults only (Linux 5.14).
MADV_POPULATE_READ = 22
#: Environment variable: ``0`` disables prefaulting.
PREFAULT_ENV = "UCM_DB_PREFAULT"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(PREFAULT_ENV, "1") != "0"


def mapping_of(path: Path) -> tuple[int, int] | None:
    """``(start address, length)`` of this process's mapping of ``path``
    (the largest, if several), from ``/proc/self/maps``; None if unmapped."""
    target = os.path.realpath(path)
    best: tuple[int, int] | None = None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5].rstrip("\n") != target:
                    continue
                start_hex, end_hex = fields[0].split("-")
                start, end = int(start_hex, 16), int(end_hex, 16)
                if int(fields[2], 16) == 0 and (best is None or end - start > best[1]):
                    best = (start, end - start)
    except OSError:
        return None
    return best


#: mincore's byte per page, bit 0 set (resident) -> 1, else 0.
_RESIDENT = bytes(i & 1 for i in range(256))
_RUN = re.compile(b"\x01+")


def resident_runs(vector: bytes | bytearray, base: int) -> Iterator[tuple[int, int]]:
    """``(address, length)`` of each run of resident pages in a ``mincore``
    vector (bit 0 of each byte) for the range starting at ``base``; found
    in C (``translate``, a regular expression), not a Python loop a page."""
    for run in _RUN.finditer(bytes(vector).translate(_RESIDENT)):
        yield base + run.start() * _PAGE_BYTES, (run.end() - run.start()) * _PAGE_BYTES


class Prefault:
    """The background prefault of one environment's data file (see module)."""

    def __init__(self, data_file: Path, guard: Callable[[], ContextManager[None]]) -> None:
        self._data_file = data_file
        self._guard = guard
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Pages populated so far (tests, diagnostics).
        self.populated_pages = 0
        #: Why it ended early, if it did ("" while running or when complete).
        self.gave_up = ""

    def start(self) -> None:
        if not enabled():
            self.gave_up = "disabled"
            return
        self._thread = threading.Thread(target=self._run, name="ucm-db-prefault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread and waits for the chunk in progress."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for the prefault to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        place_current_thread()  # at once, as every background thread (cpu_placement.py)
        if self._stop.wait(START_DELAY_S):
            return  # closed before the work was due
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        except OSError:
            self.gave_up = "no libc"
            return
        try:
            file_bytes = self._data_file.stat().st_size
        except OSError:
            self.gave_up = "no data file"
            return
        offset = 0
        while offset < file_bytes and not self._stop.is_set():
            if self.populated_pages * _PAGE_BYTES >= MAX_POPULATED_BYTES:
                return
            with self._guard():
                if self._stop.is_set():
                    return
                found = mapping_of(self._data_file)
                if found is None:
                    self.gave_up = "mapping not found"
                    return
                start, length = found
                end = min(length, file_bytes)
                if offset >= end:
                    return
                step = min(CHUNK_BYTES, end - offset)
                if not self._populate(libc, start + offset, step):
                    return
            offset += step

    def _populate(self, libc: ctypes.CDLL, address: int, length: int) -> bool:
        pages = (length + _PAGE_BYTES - 1) // _PAGE_BYTES
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
            self.gave_up = f"mincore: {os.strerror(ctypes.get_errno())}"
            return False
        for run_start, run_bytes in resident_runs(bytes(vector), address):
            if libc.madvise(ctypes.c_void_p(run_start), ctypes.c_size_t(run_bytes), MADV_POPULATE_READ) != 0:
                self.gave_up = f"madvise: {os.strerror(ctypes.get_errno())}"
                return False
            self.populated_pages += run_bytes // _PAGE_BYTES
        return True
