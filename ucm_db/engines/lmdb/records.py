"""Sync records: the synced snapshots a rollback after an OS crash may reopen.

A *record* names a snapshot of ``data.mdb`` whose pages were on disk when it
was written: its transaction id, a copy of its meta page, the data file's
identity (inode number and inode generation, :func:`data_identity`) and the
boot it was written under
(:mod:`ucm_db.engines.lmdb.groupsync` says when records are written and
what keeps their pages intact). Each process that records keeps its own
file beside the data file, ``synced-snapshot.<pid>.<token>``; no lock is
shared between processes' writes, so a process stopped (SIGSTOP, Ctrl-Z)
or killed at any instant holds up no other process's records. Each process
holds a shared ``flock`` on its own file for its lifetime, which only tells
a remover that the file is in use: a file is unlinked only under an
exclusive non-blocking ``flock`` (a live process's file, in this PID
namespace or another, is never removed; a dead one's lock is gone).

A file has two 512-byte slots, each a record with its CRC-32, written
alternately in place (``pwrite`` + ``fdatasync``): a write torn by a power
loss leaves the other slot, the process's previous record, valid. Written in
place, a record needs no new disk block, so a full disk stops no sync.

Invariants:
    * A record is *durable* once the ``fdatasync`` after its write has
      returned and its file's name is durable (the directory is fsynced
      when the file is created, before its first record counts).
    * A process's file only moves forward: a slot is written only with a
      newer transaction id than the file's newest (under a lock of this
      process), into the older slot, so the newer one survives a torn write.
    * The rollback's record (:func:`newest`) is the newest valid record of
      the current data inode in any file, one of this boot winning a tie.
      Records of a replaced data file (``compact``, ``migrate``) never
      count, nor do torn slots: a record names the inode's number and
      generation (``FS_IOC_GETVERSION``: ext4, xfs, btrfs hand a new inode
      a new generation, so a reused inode number does not match), and
      ``compact`` removes every record when it swaps the file in.
      Where the file system has no generation (0) the number alone is
      compared.
    * Another process's record is relied on (:func:`newest_durable`) only
      after this process fdatasynced its file and fsynced the directory.
    * A file is removed (:func:`remove_stale`) only under an exclusive
      ``flock`` (its process holds no shared one), only if its process is gone
      (or it is of another boot or another data file) and none of its
      records is as new as one durable in this process's file: the newest
      record never goes, and a removal a power loss undoes only brings
      back an older record.
    * The single file ``synced-snapshot`` of earlier versions (the same two
      slots, written by every process under an ``flock``) is read as one
      more file and never written: a store upgraded in place rolls back to
      it until a newer record is durable, which then removes it as stale.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from ucm_db.engines.lmdb.meta import META_BODY_BYTES
from ucm_db.engines.lmdb.recovery import boot_id, pid_alive

#: The file of earlier versions, and the prefix of every record file.
RECORD_FILE = "synced-snapshot"
SLOT_BYTES = 512
_MAGIC_V1 = b"UCMSNAP1"  # no inode generation (f65b138 and earlier)
_MAGIC = b"UCMSNAP2"
_RECORD = struct.Struct(f"<8sQQ64s{META_BODY_BYTES}sQ")  # magic, txnid, data inode, boot id, meta body, generation
_RECORD_V1 = struct.Struct(f"<8sQQ64s{META_BODY_BYTES}s")
#: ``_IOR('v', 1, long)``: the inode's generation (ext4, xfs, btrfs).
_FS_IOC_GETVERSION = 0x80087601
logger = logging.getLogger("ucm_db")


@dataclass(frozen=True)
class SyncRecord:
    """A snapshot whose pages were on disk when it was recorded."""

    txnid: int
    data_inode: int
    boot: str
    meta_body: bytes
    data_generation: int = 0  # 0: unknown (no FS_IOC_GETVERSION, or an earlier version's record)

    def of_data(self, identity: tuple[int, int] | None) -> bool:
        """Whether this record is of the data file whose :func:`data_identity` is ``identity``."""
        if identity is None or self.data_inode != identity[0]:
            return False
        return self.data_generation == 0 or identity[1] == 0 or self.data_generation == identity[1]


def encode(record: SyncRecord) -> bytes:
    """One slot: the record and its CRC-32 (the layout of every version's files)."""
    packed = _RECORD.pack(_MAGIC, record.txnid, record.data_inode, record.boot.encode()[:64], record.meta_body,
                          record.data_generation)
    return (packed + struct.pack("<I", zlib.crc32(packed))).ljust(SLOT_BYTES, b"\0")


def decode(slot: bytes) -> SyncRecord | None:
    """The record in ``slot``, or None where it is short, torn or foreign."""
    layout = {_MAGIC: _RECORD, _MAGIC_V1: _RECORD_V1}.get(slot[:8])
    if layout is None or len(slot) < layout.size + 4:
        return None
    packed = slot[:layout.size]
    (crc,) = struct.unpack_from("<I", slot, layout.size)
    if zlib.crc32(packed) != crc:
        return None
    _, txnid, inode, boot, body, *generation = layout.unpack(packed)
    return SyncRecord(txnid, inode, boot.rstrip(b"\0").decode(errors="replace"), body, *generation)


def read_slots(fd: int) -> list[SyncRecord | None]:
    """Both slots of an open record file (None: empty or torn)."""
    return [decode(os.pread(fd, SLOT_BYTES, i * SLOT_BYTES)) for i in (0, 1)]


# -- this process's file ------------------------------------------------------------
_token = secrets.token_hex(4)
_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()
#: This process's open record files (shared ``flock`` held), by directory;
#: a name is in :data:`_named` once the directory was fsynced with it.
_own_fds: dict[str, int] = {}
_named: set[str] = set()


def _after_fork() -> None:
    """A forked child is another process: its own file, its own locks (the
    parent's descriptors are closed here; the parent's flocks stay its own)."""
    global _token, _write_locks, _write_locks_guard, _own_fds, _named
    for fd in _own_fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _token, _write_locks, _write_locks_guard = secrets.token_hex(4), {}, threading.Lock()
    _own_fds, _named = {}, set()


os.register_at_fork(after_in_child=_after_fork)


def own_file(env_dir: Path) -> Path:
    """This process's record file in ``env_dir``."""
    return env_dir / f"{RECORD_FILE}.{os.getpid()}.{_token}"


def _write_lock(env_dir: Path) -> threading.Lock:
    with _write_locks_guard:
        return _write_locks.setdefault(str(env_dir), threading.Lock())


def write_own(env_dir: Path, record: SyncRecord) -> None:
    """Makes ``record`` durable in this process's file (module invariants),
    unless the file holds one at least as new of the same data file and
    boot already (durable: this process wrote it). Raises OSError."""
    with _write_lock(env_dir):
        for _ in range(8):
            fd = _own_fd(env_dir)
            slots = read_slots(fd)
            same = [(r.txnid, i) for i, r in enumerate(slots) if r is not None and r.boot == record.boot
                    and r.data_inode == record.data_inode and r.data_generation == record.data_generation]
            if same and max(same)[0] >= record.txnid:
                return
            target = 1 - max(same)[1] if same else (0 if slots[0] is None else 1 if slots[1] is None else 0)
            os.pwrite(fd, encode(record), target * SLOT_BYTES)
            os.fdatasync(fd)
            if os.fstat(fd).st_nlink == 0:  # removed meanwhile (compact, or a remover that raced our flock)
                _forget_own(env_dir)
                continue
            if str(own_file(env_dir)) not in _named:
                fsync_dir(env_dir)
                _named.add(str(own_file(env_dir)))
            return
        raise OSError(errno.EIO, f"{own_file(env_dir)} keeps being removed")


def _own_fd(env_dir: Path) -> int:
    """This process's record file, open and under its shared flock (for the
    process's lifetime); opened again where its name is gone. Under the write lock."""
    fd = _own_fds.get(str(env_dir))
    if fd is not None and os.fstat(fd).st_nlink == 0:
        _forget_own(env_dir)
        fd = None
    if fd is None:
        fd = os.open(own_file(env_dir), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            os.close(fd)
            raise
        _own_fds[str(env_dir)] = fd
    return fd


def _forget_own(env_dir: Path) -> None:
    fd = _own_fds.pop(str(env_dir), None)
    _named.discard(str(own_file(env_dir)))
    if fd is not None:
        os.close(fd)


def release_own(env_dir: Path) -> None:
    """Closes this process's record file of ``env_dir`` (its flock ends);
    the next record opens it again."""
    with _write_lock(env_dir):
        fd = _own_fds.pop(str(env_dir), None)
        if fd is not None:
            os.close(fd)


def fsync_dir(env_dir: Path) -> None:
    """Makes the directory's names durable."""
    fd = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- every process's files ----------------------------------------------------------
def _record_files(env_dir: Path) -> list[str]:
    try:
        names = os.listdir(env_dir)
    except FileNotFoundError:
        return []
    return [n for n in names if n == RECORD_FILE or n.startswith(RECORD_FILE + ".")]


def all_records(env_dir: Path) -> list[tuple[str, SyncRecord | None]]:
    """(file name, record, or None for an empty or torn slot) of both slots
    of every record file in ``env_dir``, the earlier versions' included."""
    found: list[tuple[str, SyncRecord | None]] = []
    for name in _record_files(env_dir):
        try:
            fd = os.open(env_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # removed meanwhile (a stale file)
        try:
            found += [(name, record) for record in read_slots(fd)]
        finally:
            os.close(fd)
    return found


def exist(env_dir: Path) -> bool:
    """Whether any record file is there (a store a group process has used)."""
    return bool(_record_files(env_dir))


def data_identity(env_dir: Path) -> tuple[int, int] | None:
    """The data file's inode number and inode generation (0 where the file
    system has none), or None where there is no data file."""
    try:
        fd = os.open(env_dir / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        inode = os.fstat(fd).st_ino
        try:
            (generation,) = struct.unpack_from("<I", fcntl.ioctl(fd, _FS_IOC_GETVERSION, bytes(8)))
        except OSError:
            generation = 0  # tmpfs and others: the inode number alone
        return inode, generation
    finally:
        os.close(fd)


def _newest(env_dir: Path, at_most: int | None, boot: str | None) -> tuple[str, SyncRecord] | None:
    identity, current = data_identity(env_dir), boot_id()
    found = [(name, r) for name, r in all_records(env_dir) if r is not None and r.of_data(identity)
             and (at_most is None or r.txnid <= at_most) and (boot is None or r.boot == boot)]
    return max(found, key=lambda item: (item[1].txnid, item[1].boot == current)) if found else None


def newest(env_dir: Path, *, at_most: int | None = None, boot: str | None = None) -> SyncRecord | None:
    """The newest valid record of the data file as it is now (module
    invariants), or None; ``at_most``: of those no newer than that
    transaction id; ``boot``: of those written under that boot."""
    found = _newest(env_dir, at_most, boot)
    return None if found is None else found[1]


def newest_durable(env_dir: Path, boot: str, txnid: int, known_txnid: int) -> int:
    """The transaction id of a durable record of ``boot`` at least as new
    as ``txnid`` where there is one, else ``known_txnid`` (the newest known
    durable already). Another process's record is made durable here first
    (its file fdatasynced, the directory fsynced: its writer may not have
    finished)."""
    if known_txnid >= txnid:
        return known_txnid
    found = _newest(env_dir, None, boot)
    if found is None or found[1].txnid < txnid:
        return known_txnid
    try:
        fd = os.open(env_dir / found[0], os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return known_txnid  # removed meanwhile: a newer record is durable elsewhere, found next time
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)
    fsync_dir(env_dir)
    return found[1].txnid


def remove_stale(env_dir: Path, durable_txnid: int) -> None:
    """Removes the record files no rollback needs (module invariants): a
    file of a gone process, of another boot or of a replaced data file
    none of whose records is as new as ``durable_txnid`` (durable in this
    process's file)."""
    identity, boot, own = data_identity(env_dir), boot_id(), own_file(env_dir).name
    for name, found in _by_file(env_dir).items():
        if name == own or any(r is not None and r.of_data(identity) and r.txnid >= durable_txnid for r in found):
            continue
        gone = name == RECORD_FILE or not _alive(_pid_of(name)) or any(
            r is not None and (r.boot != boot or not r.of_data(identity)) for r in found)
        if gone:
            unlink_unlocked(env_dir / name)


def remove_other_boots(env_dir: Path, boot: str) -> None:
    """Removes the files none of whose records is of ``boot`` (their
    processes are gone with the boot), under an exclusive flock each."""
    for name, found in _by_file(env_dir).items():
        if not any(r is not None and r.boot == boot for r in found):
            unlink_unlocked(env_dir / name)


def _by_file(env_dir: Path) -> dict[str, list[SyncRecord | None]]:
    files: dict[str, list[SyncRecord | None]] = {}
    for name, record in all_records(env_dir):
        files.setdefault(name, []).append(record)
    return files


def unlink_unlocked(path: Path) -> bool:
    """Unlinks ``path`` while holding an exclusive non-blocking flock on it:
    never a file a live process holds its shared flock on (whatever its
    PID namespace). Whether it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use by a live process
        if os.fstat(fd).st_nlink == 0:
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def _pid_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1


_alive = pid_alive  # a module name of its own: tests make it blind to another PID namespace


def remove_all(env_dir: Path) -> None:
    """Removes every record file, for a new data file written whole and
    synced (a conversion's copy): it starts without one, as a new store does."""
    for name in _record_files(env_dir):
        (env_dir / name).unlink(missing_ok=True)
