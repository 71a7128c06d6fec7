"""Which opens may skip the page walk: a data file that nothing but LMDB has
written since a clean walk, within one boot.

The page check at open (:func:`ucm_db.engines.lmdb.checks.check_pages_at_open`)
walks every branch and leaf page of the store in a child process: 1.2-1.6 s
at a million records, once per process that opens the store (a vLLM engine
opens it three times as it starts). Damage that walk can find comes from
writes LMDB did not make (a disk fault, a tool writing into the file) or
from an OS crash (pages LMDB wrote but the disk never got). Within one boot
the page cache holds what LMDB wrote, and LMDB's commits, from any process
(one killed mid-commit too), never leave a reachable page damaged.

So a *ledger* beside the data file (:data:`RECORD_FILE`) holds the file's
state (boot id, device, inode, size, modification and change times in ns)
that is vouched for: written after a clean walk, or by a commit that found
the file in the ledger's state when it began and so only moved it on by an
LMDB commit. Every commit, of any process, holds the ledger's lock from its
look at the ledger to its update of it, so the ledger follows the commits
of all processes; any other write leaves the file in a state no ledger
names, and from then on no commit vouches for the file until an open walks
it clean again. An open that finds the file in the ledger's state skips
its walk.

Invariants:
    * A ledger vouches only in the boot that wrote it: after an OS crash (a
      new boot id) every open walks. No boot id (not Linux, no
      ``UCM_DB_BOOT_ID``): no ledger is written, every open walks.
    * File states only move forward (inode, size, times), so a stale ledger
      never matches again; a ledger read torn or damaged fails its checksum
      and vouches for nothing.
    * A walk that could not run or finish vouches for nothing; a
      read-only handle reads the ledger at open and never writes it.
    * What it cannot see: a write landing between a commit and its update
      of the ledger (microseconds), or in the same clock tick as a commit
      and keeping the file's size; a disk returning other bytes for a page
      nobody wrote (``ucm-db verify`` walks every page, always).
    * A process killed between its commit and the ledger's update leaves
      the ledger behind the file: the next open walks (safe side).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import zlib
from dataclasses import astuple, dataclass
from pathlib import Path

from ucm_db.engines.lmdb.recovery import boot_id

logger = logging.getLogger("ucm_db")

#: The ledger of the last vouched-for state, in the LMDB directory.
RECORD_FILE = "walked-clean"
#: boot id digest (16), device, inode, size, mtime ns, ctime ns; then a CRC-32 of those.
_LEDGER = struct.Struct("<16s5Q")
_CRC = struct.Struct("<I")
_RECORD_BYTES = _LEDGER.size + _CRC.size


@dataclass(frozen=True)
class FileState:
    """What tells one version of the data file from another within a boot."""

    boot: bytes
    device: int
    inode: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int


def boot_digest() -> bytes | None:
    """This boot's id as 16 bytes (None without one)."""
    boot = boot_id()
    return hashlib.blake2b(boot.encode(), digest_size=16).digest() if boot is not None else None


def file_state(data: Path, boot: bytes | None = None) -> FileState | None:
    """The data file's state now; None without a boot id or a file.
    ``boot``: :func:`boot_digest` read already (a handle reads it once, at
    open: reading it costs more than the ``stat``)."""
    boot = boot if boot is not None else boot_digest()
    if boot is None:
        return None
    fields = _stat_fields(data)
    return FileState(boot, *fields) if fields is not None else None


def _stat_fields(data: Path) -> tuple[int, int, int, int, int] | None:
    """What a state holds besides the boot (device, inode, size, times), or None without a file."""
    try:
        st = os.stat(data)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_record(env_dir: Path) -> FileState | None:
    """The ledger's state; None where there is none or it fails its checksum."""
    try:
        with open(env_dir / RECORD_FILE, "rb") as f:
            raw = f.read(_RECORD_BYTES)
    except OSError:
        return None
    return _parse(raw)


def _parse(raw: bytes) -> FileState | None:
    if len(raw) != _RECORD_BYTES or _CRC.unpack_from(raw, _LEDGER.size)[0] != zlib.crc32(raw[:_LEDGER.size]):
        return None
    return FileState(*_LEDGER.unpack_from(raw))


def _pack(state: FileState) -> bytes:
    return _with_crc(_LEDGER.pack(*astuple(state)))


def _with_crc(body: bytes) -> bytes:
    """A ledger record: ``body`` (a packed state) and its CRC-32."""
    return body + _CRC.pack(zlib.crc32(body))


class Custody:
    """One engine handle's part in the ledger (module docstring). Called by
    the engine under its open lock, and around each write transaction
    (:meth:`committing`)."""

    def __init__(self, env_dir: Path, *, read_only: bool = False) -> None:
        self._env_dir = env_dir
        self._read_only = read_only  # reads the ledger at open, never writes it
        self._data = env_dir / "data.mdb"
        self._boot: bytes | None = None  # read at each open: a process lives in one boot
        self._candidate: FileState | None = None
        self._fresh = False
        self._fd: int | None = None
        self._fd_pid = -1
        self._held: int | None = None  # the ledger's descriptor while a commit holds its lock
        self._vouched = False  # the commit under way found the file in the vouched state

    def take_recorded(self) -> bool:
        """Before the open's page check: True if the ledger vouches for the
        file as it is now (no walk needed); else False, and a caller that
        walks calls :meth:`walked_clean`."""
        self._boot = boot_digest()
        state = file_state(self._data, self._boot)
        self._candidate = state
        self._fresh = state is None and not self._data.exists()
        return state is not None and read_record(self._env_dir) == state

    def walked_clean(self) -> None:
        """The page check found no damage in the state seen before it: the
        ledger vouches for it, if no commit moved the file meanwhile."""
        state = self._candidate
        if state is not None and file_state(self._data, self._boot) == state:
            self._write(state)

    def opened(self) -> None:
        """After a writable open: a file this open created (LMDB's own
        first pages) is vouched for as it is now."""
        if self._fresh:
            self._fresh = False
            state = file_state(self._data, self._boot)
            if state is not None:
                self._write(state)

    def committing(self) -> Custody:
        """Around a write transaction (``with custody.committing():``):
        holds the ledger's lock (``flock``) from before the transaction
        begins to after the ledger is updated, so the commits of all
        processes pass through it one at a time; the ledger moves on with
        the file only if the commit found the file in the vouched state. A
        transaction that fails leaves the ledger as it was (the safe side:
        a file it changed no longer matches). The engine's write lock makes
        a handle's commits one at a time, so the state of the one under way
        lives on the handle. Lean on purpose: it runs at every commit (two
        ``stat``, a ``pread``, a ``pwrite``, two ``flock``: about 12 us alone)."""
        return self

    def __enter__(self) -> None:
        fd = self._ledger() if self._boot is not None else None  # no boot id: no ledger, nothing to do a commit
        self._held = fd
        if fd is None:
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now = self._packed_now()
            raw = os.pread(fd, _RECORD_BYTES, 0)
            self._vouched = now is not None and raw == _with_crc(now)
        except BaseException:
            self._held = None
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        fd, self._held = self._held, None
        if fd is None:
            return
        try:
            if exc_type is None and self._vouched:
                after = self._packed_now()
                if after is not None:
                    self._write_raw(fd, _with_crc(after))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _packed_now(self) -> bytes | None:
        """The data file's state now, packed as the ledger holds it (None without a file)."""
        fields = _stat_fields(self._data)
        assert self._boot is not None
        return _LEDGER.pack(self._boot, *fields) if fields is not None else None

    def close(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def _ledger(self) -> int | None:
        """The ledger's descriptor, opened once per process (0600, as every file of a store)."""
        if self._read_only:
            return None
        if self._fd is None or self._fd_pid != os.getpid():
            try:
                self._fd = os.open(self._env_dir / RECORD_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._fd_pid = os.getpid()
            except OSError as exc:
                logger.debug("ucm-db: no ledger for %s: %s", self._env_dir, exc)
                self._fd = None
                return None
        return self._fd

    def _write(self, state: FileState) -> None:
        fd = self._ledger()
        if fd is not None:
            self._write_raw(fd, _pack(state))

    def _write_raw(self, fd: int, record: bytes) -> None:
        """One ``pwrite`` of the whole record (no fsync: a ledger is worth nothing after a reboot)."""
        try:
            os.pwrite(fd, record, 0)
        except OSError as exc:
            logger.debug("ucm-db: could not update the ledger of %s: %s", self._env_dir, exc)
