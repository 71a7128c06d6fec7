"""Group durability that a power loss cannot damage: pinned synced snapshots.

``durability="group"`` commits with LMDB's MDB_NOSYNC (a commit reaches the
OS page cache, not the disk) and syncs in the background. A process crash
loses nothing. A power loss can leave on disk any subset of the pages
written since the last sync, including a meta page naming pages that never
arrived. This module turns that into "the store is as it was at the last
completed sync":

* :class:`SnapshotPin`, on every sync: begin a read transaction (its
  snapshot ``S`` is the newest commit), copy ``S``'s meta page with ``pread``,
  ``fdatasync`` the file (``S`` and everything before it is now on disk),
  write ``S``'s meta into the *sync record* ``synced-snapshot`` beside the
  data file and fdatasync it, and only then end the previous pin. The read
  transaction stays open: LMDB reuses no page that a live reader's snapshot
  can reach, so no later commit, synced or not, overwrites a page of ``S``.
* :func:`roll_back_after_os_crash`, at open, under the recovery lock: if the
  record was written under another boot (the machine went down since) and
  the data file's newest meta page is newer than ``S``, the commits after
  ``S`` may be torn: both meta pages are rewritten to ``S``'s (fsynced), and
  LMDB opens snapshot ``S``, whose pages are all on disk and untouched.
  Pages written after ``S`` are unreferenced, so LMDB reuses them.

Invariants:
    * The record's snapshot is durable before the record is, and stays
      pinned (by a live or a stale reader slot) until a newer record is
      durable: an open writes a fresh record before it clears dead readers.
    * The record only moves forward (a newer transaction id, under ``flock``);
      it is tied to the data file's inode, so a file replaced by ``compact``
      or ``migrate`` is never rolled back with another file's meta page, and
      a record of the replaced file never outranks the new file's.
    * After a process crash (same boot) nothing is rolled back: the page
      cache still holds every commit. The dead process's reader slots are
      cleared by the next open, and by every recorded sync of a process
      that has the store open (a long-running writer never reopens).
    * Without a boot id (not Linux, no ``UCM_DB_BOOT_ID``) nothing is rolled
      back, and group durability keeps LMDB's own MDB_NOSYNC risk.

The record file has two 512-byte slots written alternately, each with a
CRC-32, so a write torn by a power loss leaves the other slot valid.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from ucm_db.errors import TierError
from ucm_db.engines.lmdb.meta import META_BODY_BYTES, read_meta_pages, write_meta_body
from ucm_db.engines.lmdb.recovery import boot_id

RECORD_FILE = "synced-snapshot"
_SLOT_BYTES = 512
_MAGIC = b"UCMSNAP1"
_RECORD = struct.Struct(f"<8sQQ64s{META_BODY_BYTES}s")  # magic, txnid, data inode, boot id, meta body
#: Attempts to copy a snapshot's meta page before two newer commits replace it.
_META_COPY_TRIES = 8
#: The longest a sync waits for the sync record's lock (held by a process stopped while it wrote one, a
#: sync skips its record: the previous one stays, pinned, and a later sync records): writers never wedge.
RECORD_LOCK_WAIT_S = 2.0

logger = logging.getLogger("ucm_db")


@dataclass(frozen=True)
class SyncRecord:
    """The last snapshot known to be on disk."""

    txnid: int
    data_inode: int
    boot: str
    meta_body: bytes


@dataclass(frozen=True)
class RollbackReport:
    """What :func:`roll_back_after_os_crash` did."""

    from_txnid: int   # the newest meta page on disk after the crash
    to_txnid: int     # the synced snapshot the store now opens


def _encode(record: SyncRecord) -> bytes:
    packed = _RECORD.pack(_MAGIC, record.txnid, record.data_inode, record.boot.encode()[:64], record.meta_body)
    slot = packed + struct.pack("<I", zlib.crc32(packed))
    return slot.ljust(_SLOT_BYTES, b"\0")


def _decode(slot: bytes) -> SyncRecord | None:
    if len(slot) < _RECORD.size + 4:
        return None
    packed = slot[:_RECORD.size]
    (crc,) = struct.unpack_from("<I", slot, _RECORD.size)
    if zlib.crc32(packed) != crc:
        return None
    magic, txnid, inode, boot, body = _RECORD.unpack(packed)
    if magic != _MAGIC:
        return None
    return SyncRecord(txnid, inode, boot.rstrip(b"\0").decode(errors="replace"), body)


def _read_slots(fd: int) -> list[SyncRecord | None]:
    return [_decode(os.pread(fd, _SLOT_BYTES, i * _SLOT_BYTES)) for i in (0, 1)]


def read_record(env_dir: Path) -> SyncRecord | None:
    """The newest valid sync record of the environment's data file as it is
    now, or None. A record of a file since replaced (``compact``,
    ``migrate``: the copy's transaction ids start again low) is no record of
    it: were it counted, it would outrank every record of the new file until
    that file's ids passed it, and no rollback would be made meanwhile."""
    try:
        fd = os.open(env_dir / RECORD_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        records = [r for r in _read_slots(fd) if r is not None]
    finally:
        os.close(fd)
    try:
        inode = os.stat(env_dir / "data.mdb").st_ino
    except FileNotFoundError:
        return None
    current = [r for r in records if r.data_inode == inode]
    return max(current, key=lambda r: r.txnid) if current else None


def drop_record(env_dir: Path) -> None:
    """Removes the environment's sync record, for a new file written whole
    and synced (a conversion's copy): it starts without one, as any new
    store does, and a group process's first sync records it."""
    (env_dir / RECORD_FILE).unlink(missing_ok=True)


def _write_record(env_dir: Path, record: SyncRecord, *, force: bool = False) -> bool:
    """Writes ``record`` into the older slot and fdatasyncs, unless a newer
    one is already recorded (``force``: write it anyway, for a rollback,
    waiting as long as the file's lock is held). Returns False, writing
    nothing, where another process held the lock for :data:`RECORD_LOCK_WAIT_S`
    (a process stopped while it wrote: a writer's sync must not wait on it)."""
    fd = os.open(env_dir / RECORD_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if force:
            fcntl.flock(fd, fcntl.LOCK_EX)
        elif not _lock_within(fd, RECORD_LOCK_WAIT_S):
            return False
        slots = _read_slots(fd)
        # Only records of the same data file count (read_record): one of a replaced file is overwritten first.
        valid = [(r.txnid, i) for i, r in enumerate(slots) if r is not None and r.data_inode == record.data_inode]
        newest = max(valid) if valid else None
        if newest is not None and not force:
            current = slots[newest[1]]
            assert current is not None
            if current.txnid > record.txnid or (current.txnid == record.txnid and current.boot == record.boot):
                return True
        stale = next((i for i, r in enumerate(slots) if r is None or r.data_inode != record.data_inode), 0)
        target = stale if newest is None else 1 - newest[1]
        os.pwrite(fd, _encode(record), target * _SLOT_BYTES)
        if force:  # the other slot must not outrank the rollback target
            os.pwrite(fd, _encode(record), (1 - target) * _SLOT_BYTES)
        os.fdatasync(fd)
        return True
    finally:
        os.close(fd)


def _lock_within(fd: int, wait_s: float) -> bool:
    """Takes ``fd``'s exclusive ``flock`` within ``wait_s``; False if another holder kept it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


class SnapshotPin:
    """One process's pinned synced snapshot of one environment (module doc).

    Thread-safe. Create a new one after ``fork`` (transactions do not cross
    it) and call :meth:`release` before the environment closes.
    """

    def __init__(self, env_dir: Path) -> None:
        self._dir = env_dir
        self._boot = boot_id()
        self._lock = threading.Lock()
        self._pin: Any = None  # the read transaction on the last recorded snapshot
        self._record_waits = 0  # syncs in a row whose record another process's lock kept out (warned at the first)

    def sync(self, env: lmdb.Environment, *, must_record: bool = False) -> bool:
        """Makes every commit so far durable and records the newest one;
        returns whether it is recorded (and pinned).

        The snapshot's meta page is copied while writers go on; where two
        commits raced every copy (commits are flowing, so LMDB's writer
        lock comes soon), it is copied again under that lock, held by an
        empty write transaction: no commit can replace it then. (Fenced
        only then: a writer stopped inside a transaction in another process
        would hold every fenced sync, and it commits nothing meanwhile.)
        A record kept out, by another process holding its lock for
        :data:`RECORD_LOCK_WAIT_S`, returns False, or with ``must_record``
        (an explicit sync: a flush, an epoch change, a pin, a close)
        raises :class:`~ucm_db.errors.TierError`: a sync whose record did
        not move is undone by the rollback after an OS crash, so its
        caller must not be told it is durable.

        Raises ``lmdb.MapResizedError`` when another process grew the map
        (the caller adopts the size and calls again)."""
        with self._lock:
            snapshot = self._raced_snapshot(env)
            if snapshot is not None and snapshot[0] is None:  # commits raced every copy
                if self._boot is None:
                    env.sync(True)
                    return True  # nothing is recorded without a boot id (module invariants)
                snapshot = self._fenced_snapshot(env)
            if snapshot is None:
                return True  # no commit since the pinned snapshot, which is durable and recorded
            txn, meta = snapshot
            assert txn is not None and meta is not None  # a raced-out copy was made again under the fence
            try:
                env.sync(True)
                if self._boot is not None:
                    inode = os.stat(self._dir / "data.mdb").st_ino
                    if not _write_record(self._dir, SyncRecord(txn.id(), inode, self._boot, meta)):
                        txn.abort()  # durable, but not recordable now: the previous pin stays
                        if must_record:
                            raise TierError(
                                f"{self._dir}: synced, but another process has held its sync record's lock for "
                                f"{RECORD_LOCK_WAIT_S:g} s (stopped?): a power loss could still undo this change",
                                hint="resume or stop the process that holds synced-snapshot's lock "
                                     "(`fuser` names it), then retry",
                            )
                        if not self._record_waits:
                            logger.warning("ucm-db: %s: synced, but another process held its sync record for %.0f s "
                                           "(stopped?): recorded at a later sync", self._dir, RECORD_LOCK_WAIT_S)
                        self._record_waits += 1
                        return False
                    self._record_waits = 0
            except BaseException:
                txn.abort()
                raise
            previous, self._pin = self._pin, txn
            if previous is not None:
                previous.abort()
            # The record is ours (or a live process's newer one), pinned: the slots of readers that died
            # can go, as an open clears them, or their snapshots would keep every page freed since.
            env.reader_check()
            return True

    def _raced_snapshot(self, env: lmdb.Environment) -> tuple[Any, bytes] | tuple[None, None] | None:
        """The newest snapshot's read transaction and meta body, copied
        without stopping writers; None when it is the pinned one, (None,
        None) when commits raced every copy."""
        for _ in range(_META_COPY_TRIES):
            txn = env.begin(write=False)
            if self._pin is not None and txn.id() == self._pin.id():
                txn.abort()
                return None
            meta = self._copied_meta(txn)
            if meta is not None:
                return txn, meta
            txn.abort()  # two newer commits replaced its meta page: take a newer snapshot
        return None, None

    def _fenced_snapshot(self, env: lmdb.Environment) -> tuple[Any, bytes] | None:
        """As :meth:`_raced_snapshot`, with LMDB's writer lock held (an
        empty write transaction, aborted) while the snapshot begins and its
        meta page is copied: no commit of any process lands meanwhile, so
        the newest meta page is the snapshot's and the copy succeeds."""
        fence = env.begin(write=True)
        try:
            txn = env.begin(write=False)
            if self._pin is not None and txn.id() == self._pin.id():
                txn.abort()
                return None
            meta = self._copied_meta(txn)
        finally:
            fence.abort()
        if meta is None:  # cannot happen under the fence: a meta page not where LMDB keeps it
            txn.abort()
            raise TierError(f"{self._dir}: the newest snapshot's meta page is not in data.mdb's meta slots")
        return txn, meta

    def _copied_meta(self, txn: Any) -> bytes | None:
        """:meth:`_meta_of` ``txn``'s snapshot; ``txn`` ends if the copy
        raises (a read transaction left open would pin its snapshot)."""
        try:
            return self._meta_of(txn.id())
        except BaseException:
            txn.abort()
            raise

    def _meta_of(self, txnid: int) -> bytes | None:
        """Snapshot ``txnid``'s meta body, read twice alike (a read racing a
        commit that rewrites that slot could mix two metas); None if that
        slot already holds a newer snapshot."""
        bodies = []
        for _ in range(2):
            pages, _ = read_meta_pages(self._dir / "data.mdb")
            bodies.append(next((p.body for p in pages if p.txnid == txnid), None))
        return bodies[0] if bodies[0] == bodies[1] else None

    def ended(self) -> None:
        """Forgets the pin's transaction, which py-lmdb already ended (a map
        resize ends every transaction); the next :meth:`sync` pins again."""
        with self._lock:
            self._pin = None

    def release(self) -> None:
        """Ends the pin (the environment is about to close)."""
        with self._lock:
            if self._pin is not None:
                self._pin.abort()
                self._pin = None


def roll_back_after_os_crash(env_dir: Path) -> RollbackReport | None:
    """Reopens the last synced snapshot if an OS crash may have torn later
    commits (module doc). Call under the environment's recovery lock,
    before LMDB opens it. Returns None when nothing was rolled back."""
    current_boot = boot_id()
    record = read_record(env_dir)
    data = env_dir / "data.mdb"
    if current_boot is None or record is None or record.boot == current_boot or not data.is_file():
        return None
    if os.stat(data).st_ino != record.data_inode:
        return None  # the file was replaced (compact, migrate): the record is not about it
    try:
        pages, _ = read_meta_pages(data)
    except OSError:
        return None
    newest = max((p.txnid for p in pages), default=-1)
    report = None
    if newest > record.txnid or len(pages) < 2:
        mark_rolled_back(env_dir)  # first: a crash right after the rewrite still leaves the feed its restart
        write_meta_body(data, record.meta_body)
        report = RollbackReport(newest, record.txnid)
        logger.warning(
            "ucm-db: %s: the machine went down with commits not yet synced (durability='group'); "
            "reopened the last synced snapshot (transaction %d; the disk's newest was %d)",
            env_dir, record.txnid, newest,
        )
    _write_record(env_dir, SyncRecord(record.txnid, record.data_inode, current_boot, record.meta_body), force=True)
    return report


#: A file beside the data file while the store's change feed owes a restart:
#: the feed handed out sequence numbers the rollback undid, and the next
#: writable open moves the sequence past them (``ucm_db.index.changefeed.restart``)
#: before anything appends, whichever process (a read-only view too) rolled back.
ROLLED_BACK_MARKER = "rolled-back"


def mark_rolled_back(env_dir: Path) -> None:
    """Leaves :data:`ROLLED_BACK_MARKER`, durably, holding a token of this
    rollback (its feed restart is made once, by whichever open gets there
    first: ``ucm_db.index.changefeed.restart``)."""
    fd = os.open(env_dir / ROLLED_BACK_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(16).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rolled_back(env_dir: Path) -> bytes | None:
    """The token of the rollback whose marker is there (:data:`ROLLED_BACK_MARKER`), or None."""
    try:
        return (env_dir / ROLLED_BACK_MARKER).read_bytes() or b"unnamed"  # a marker torn empty still marks
    except FileNotFoundError:
        return None


def clear_rolled_back(env_dir: Path) -> None:
    (env_dir / ROLLED_BACK_MARKER).unlink(missing_ok=True)
