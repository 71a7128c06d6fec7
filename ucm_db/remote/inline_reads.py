"""When a remote tier's reads run on the caller's thread instead of a pool.

A ``file://`` remote on a local disk answers a read of a 45 KB object from the
page cache in about 15 us; handing it to a thread pool and waiting on the
future costs more than the read (a connector lookup's fetch measured 27 us a
block inline against 44-74 us through the pool on 2 cores, where 16 pool
threads also contend for the interpreter). :class:`InlineReads` decides, per
remote, which way its requests go.

Invariants:
    * Only a remote directory on a local-disk file system (:data:`LOCAL_DISK_FS_TYPES`,
      from the kernel's mount table) is ever read inline: a network or FUSE
      file system can stall a read far past a lookup's deadline, and only
      the pool lets the deadline abandon a stalled read. Anything unknown
      (no mount table, an object store, NFS, SMB, FUSE) keeps the pool.
    * Inline only while the moving average of request times stays under
      :data:`INLINE_REQUEST_S`. Every request of such a remote is timed,
      inline or pooled, so a disk that turns slow (a cold cache on a
      spinning disk) moves reads to the pool and a warm one moves them back.
    * Inline requests keep the deadline between requests: a request is not
      started past it, and a large object is read in chunks that check it
      (:mod:`ucm_db.remote.object_reads`), so a lookup overruns its deadline
      by at most one chunk's read.
    * ``UCM_DB_INLINE_READS=0`` in the environment sends every request to
      the pool (to compare the two, or to rule inline reads out).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

#: File systems whose reads are local block-device or memory reads.
LOCAL_DISK_FS_TYPES = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs",
    "tmpfs", "ramfs", "overlay",
})
#: Average request time under which requests run inline (a page-cache read
#: of a block is 10-30 us; a pool hand-off 30-60 us on 2 cores).
INLINE_REQUEST_S = 200e-6
#: Weight of the newest request time in the moving average.
_AVERAGE_WEIGHT = 0.1
_MOUNTINFO = "/proc/self/mountinfo"

T = TypeVar("T")


def _unescape_mount_path(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def file_system_type(path: str, mountinfo_path: str = _MOUNTINFO) -> str | None:
    """The type of the file system holding ``path`` (``"ext4"``, ``"nfs4"``,
    ...), from the mount table; None where there is none to read."""
    try:
        with open(mountinfo_path, encoding="utf-8", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best_len, best_type = -1, None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < 5 or dash + 1 >= len(fields):
            continue
        mount_point = _unescape_mount_path(fields[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best_len:  # a later mount on the same point covers the earlier one
            best_len, best_type = len(mount_point), fields[dash + 1]
    return best_type


def is_local_disk(path: str, mountinfo_path: str = _MOUNTINFO) -> bool:
    """True when ``path`` lies on a local-disk or memory file system."""
    return file_system_type(path, mountinfo_path) in LOCAL_DISK_FS_TYPES


class InlineReads:
    """One remote's choice between inline and pooled requests (see module invariants)."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed and os.environ.get("UCM_DB_INLINE_READS", "1") != "0"
        self._average_s = 0.0  # optimistic: the first requests of a local disk go inline
        self.inline_requests = 0

    def use(self) -> bool:
        """True when the next requests should run on the caller's thread."""
        return self.allowed and self._average_s < INLINE_REQUEST_S

    def observe(self, seconds: float) -> None:
        self._average_s += (seconds - self._average_s) * _AVERAGE_WEIGHT

    @property
    def average_s(self) -> float:
        """Moving average of this remote's request times (0 until timed)."""
        return self._average_s

    def run(self, call: Callable[[], T]) -> T:
        """``call()`` on this thread, timed into the average and counted."""
        started = time.perf_counter()
        result = call()
        self.observe(time.perf_counter() - started)
        self.inline_requests += 1
        return result

    def timed(self, call: Callable[[], T]) -> Callable[[], T]:
        """``call``, timed into the average when it returns (a pooled request)."""
        if not self.allowed:
            return call

        def run() -> T:
            started = time.perf_counter()
            result = call()
            self.observe(time.perf_counter() - started)
            return result

        return run
