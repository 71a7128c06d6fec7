"""Provisional owners, and the sweep that takes back what a dead one stored.

A :class:`ProvisionalOwner` (``Store.provisional_owner()``) is a writer that
may take back blocks it committed (a ``kv_producer`` voiding a save over a
load that failed). Its puts tag such blocks (``Store.put_segments``'s
``provisional``), the put's transaction marks them
(:mod:`ucm_db.index.provisional`), and the owner settles a tag once the save
stands or its void deleted the blocks. An owner whose process died holds
tags nobody will settle nor void: :func:`sweep` deletes their blocks, with
their descendants (off the remote too, where the sweeping store has one),
then their markers. A provisional block reaches no remote before its tag
is settled (:mod:`ucm_db.index.provisional`).

Invariants:
    * Liveness is a POSIX record lock (``lockf``) on the owner's file in the
      store directory (``.ucm-db.owner.<id hex>``), taken before the owner
      makes its first tag and held for the owner's life. A record lock is
      the process's own: a forked child does not inherit it, and it is gone
      when the process dies, however it died (SIGKILL too). A process that
      takes the lock of an owner with markers (or finds no file) knows the
      owner is gone: markers are only written while their owner holds it.
    * A sweep never judges an owner of its own process (the lock would be
      granted to it: record locks do not conflict within a process, and
      closing the file would release the owner's lock); those are listed in
      this process (:data:`_OWN`, emptied in a forked child, which holds
      none of them), read after the markers (an owner is listed before it
      makes its first tag). A sweeper takes a shared lock through a
      read-only descriptor (another user's sweep too).
    * An owner works in the process that made it: in a forked child its
      tags and settles raise (they would be the parent's), its close only
      forgets it. An owner whose file was removed (a cleaner of old files)
      makes and locks it again at its next tag.
    * A sweep drops the markers it read, never one written since (a late
      put of a dead owner's commit process keeps its mark for the next).
    * The blocks go before their markers (two transactions): a sweep cut
      short leaves markers, and the next one deletes again (a no-op where
      they are gone).
    * Deleting too much is the safe side: a marked block evicted and stored
      again by someone else is deleted too (a lost block, never a wrong one).
    * Sweeps run when a store opens writable, and in its maintenance thread
      every :data:`SWEEP_INTERVAL_S` (one read of the marker prefix while
      there are none). A store open read-only never sweeps. With a remote,
      the delete records the blocks' retractions (never read back from the
      remote meanwhile); a sweep at open deletes their remote objects before
      the open returns, one in the maintenance thread leaves that to the
      uploader (the thread's syncs never wait on the network).
    * Where the store directory takes no record locks (some network file
      systems), no owner can be made (:class:`~ucm_db.errors.TierError`):
      the caller goes on without provisional puts; a sweep that cannot
      lock an owner's file leaves its markers.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ucm_db.config import StoreConfig
from ucm_db.engines.base import Engine
from ucm_db.errors import ConfigError, TierError, UcmDbError
from ucm_db.index import provisional as marks
from ucm_db.index.local import LocalTier


class _Activity(Protocol):
    def committed(self, stored_bytes: int) -> None: ...


class StoreState(Protocol):
    """What owners and sweeps use of :class:`ucm_db.store.state.StoreState`
    (a protocol: the state module builds on this one)."""

    path: Path
    engine: Engine
    tier: LocalTier
    wing: Any  # RemoteWing | None
    config: StoreConfig

    @property
    def activity(self) -> _Activity: ...

    def check_open(self) -> None: ...

    def refuse_read_only(self, operation: str) -> None: ...

    def enter(self) -> None: ...

    def leave(self) -> None: ...

logger = logging.getLogger(__name__)

#: Seconds between a maintenance thread's sweeps.
SWEEP_INTERVAL_S = 5.0
_OWNER_FILE_PREFIX = ".ucm-db.owner."
#: Owner ids whose lock this process holds (module invariants).
_OWN: set[bytes] = set()
_OWN_LOCK = threading.Lock()
#: Dead owners whose blocks a sweep could not delete, logged once each.
_LOGGED_STUCK: set[bytes] = set()


def _forget_owners_in_child() -> None:
    """A forked child holds none of the parent's owners' locks, nor
    :data:`_OWN_LOCK` should a parent's thread have held it at the fork."""
    global _OWN_LOCK
    _OWN_LOCK = threading.Lock()
    _OWN.clear()


os.register_at_fork(after_in_child=_forget_owners_in_child)


def owner_file(store_path: Path, owner_id: bytes) -> Path:
    """The file whose record lock says ``owner_id`` is alive."""
    return store_path / f"{_OWNER_FILE_PREFIX}{owner_id.hex()}"


class ProvisionalOwner:
    """A writer whose puts may be taken back (module invariants): it makes
    tags for ``Store.put_segments``'s ``provisional`` and settles them.

    Thread-safe. ``close`` (or the process's end) lets a sweep delete the
    blocks of every tag not settled by then."""

    def __init__(self, state: StoreState) -> None:
        state.check_open()
        state.refuse_read_only("provisional_owner")
        self._state = state
        self.owner_id = secrets.token_bytes(marks.OWNER_ID_BYTES)
        self._path = owner_file(state.path, self.owner_id)
        self._lock = threading.Lock()
        self._seq = 0
        self._pid = os.getpid()
        self._fd: int | None = None
        self._hold_file()
        with _OWN_LOCK:
            _OWN.add(self.owner_id)

    def tag(self) -> bytes:
        """A new tag: owner id and the next sequence number.

        Raises:
            TierError: the owner is closed, or was made in another process
                (a forked child: its tags would be the parent's).
        """
        with self._lock:
            fd = self._held()
            if os.fstat(fd).st_nlink == 0:  # the file was removed (a cleaner): a sweep would take us for dead
                self._drop_file()
                self._hold_file()
            self._seq += 1
            return self.owner_id + self._seq.to_bytes(marks.SEQ_BYTES, "big")

    def settle(self, tags: Iterable[bytes]) -> None:
        """The saves of ``tags`` stand (or their void deleted them): drops
        their markers and queues the uploads they held, in one transaction."""
        tags = [bytes(tag) for tag in tags]
        if not tags:
            return
        with self._lock:
            self._held()
        state = self._state
        try:  # one operation of the store: a close waits for it (store/state.py)
            state.enter()
            state.check_open()
            queued = state.engine.write(lambda txn: marks.settle(txn, tags))[1]
            state.activity.committed(0)
            if queued and state.wing is not None:
                state.wing.wake_uploader()
        finally:
            state.leave()

    def close(self) -> None:
        """Ends the owner: tags not settled are a sweep's (idempotent). In a
        forked child it only forgets the owner (the parent's file and lock stay)."""
        with self._lock:
            if self._fd is None:
                return
            if self._pid != os.getpid():
                self._fd = None  # the descriptor is the parent's lock's file: left open, never unlinked here
                return
            with _OWN_LOCK:
                _OWN.discard(self.owner_id)
            self._drop_file()

    def _held(self) -> int:
        if self._fd is None:
            raise TierError("this provisional owner is closed", hint="make a new one with Store.provisional_owner()")
        if self._pid != os.getpid():
            raise TierError(f"this provisional owner was made in process {self._pid}, not this one (a forked child)",
                            hint="make an owner in each process with Store.provisional_owner()")
        return self._fd

    def _hold_file(self) -> None:
        """Creates the owner's file and takes its record lock."""
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise TierError(f"cannot create {self._path}: {exc}", hint="provisional puts need a writable store directory") from exc
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._drop_file()
            raise TierError(f"{self._path} takes no record lock ({exc})",
                            hint="provisional puts need a store directory on a file system with POSIX locks") from exc

    def _drop_file(self) -> None:
        try:
            self._path.unlink(missing_ok=True)
        except OSError:
            pass  # a sweep finds the file unlocked and removes it
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the record lock


def provisional_tags(provisional: Mapping[bytes, bytes] | None) -> dict[bytes, bytes] | None:
    """``put_segments``' ``provisional`` checked: bytes keys, tags of
    :data:`~ucm_db.index.provisional.TAG_BYTES` (ConfigError, nothing written)."""
    if not provisional:
        return None
    if not isinstance(provisional, Mapping):
        raise ConfigError(f"provisional takes a mapping of key to tag, got {type(provisional).__name__}",
                          hint="pass {key: owner.tag()} for the keys a later step may take back")
    tags: dict[bytes, bytes] = {}
    for key, tag in provisional.items():
        if not isinstance(key, bytes) or not isinstance(tag, bytes) or len(tag) != marks.TAG_BYTES:
            raise ConfigError(f"provisional maps a key to {tag!r}, not a tag of {marks.TAG_BYTES} bytes",
                              hint="make tags with Store.provisional_owner().tag()")
        tags[key] = tag
    return tags


def _owner_gone(store_path: Path, owner_id: bytes) -> tuple[bool, int | None]:
    """Whether ``owner_id``'s process is gone, and a descriptor holding its
    lock (close it after the sweep); (False, None) while it lives or where
    its file takes no lock."""
    path = owner_file(store_path, owner_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # read access: a shared lock, which the owner's excludes
    except FileNotFoundError:
        return True, None
    except OSError:
        return False, None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            logger.warning("ucm-db store %s: cannot lock %s (%s): its provisional blocks stay", store_path, path, exc)
        return False, None
    return True, fd


def sweep(state: StoreState, *, retract_now: bool = True) -> int:
    """Deletes the provisional blocks of owners whose process is gone, with
    their descendants, then their markers; returns the blocks removed. With
    a remote their retractions are recorded in the delete's transaction
    (never read back from the remote here); ``retract_now`` also deletes
    the remote objects before returning, within a bulk deadline (not from
    the maintenance thread, whose syncs must not wait on the network: the
    uploader deletes them there)."""
    if state.config.read_only:
        return 0
    marked = state.engine.read(marks.owners)  # before this process's owners: an owner joins _OWN before its first mark
    with _OWN_LOCK:
        own = set(_OWN)
    candidates = [owner for owner in marked if owner not in own]
    removed = 0
    for owner_id in candidates:
        gone, fd = _owner_gone(state.path, owner_id)
        if not gone:
            continue
        try:
            removed += _take_back(state, owner_id, retract_now)
            owner_file(state.path, owner_id).unlink(missing_ok=True)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def sweep_opened(state: StoreState) -> None:
    """:func:`sweep` as a store opens: a failure is logged, the open goes on."""
    try:
        sweep(state)
    except (UcmDbError, OSError) as exc:
        logger.warning("ucm-db store %s: sweeping dead writers' provisional blocks failed (retried by the maintenance "
                       "thread): %s", state.path, exc)


def _take_back(state: StoreState, owner_id: bytes, retract_now: bool) -> int:
    """Deletes a gone owner's marked blocks (and descendants), then its markers."""
    wing = state.wing
    removed = 0
    by_namespace, names = state.engine.read(lambda txn: marks.marked(txn, owner_id))
    for namespace_id, keys in by_namespace.items():
        try:
            removed += state.tier.delete(keys, namespace_id=namespace_id, retract=wing is not None)
        except UcmDbError as exc:  # a descendant under another namespace: left to verify / invalidate
            if owner_id not in _LOGGED_STUCK:
                _LOGGED_STUCK.add(owner_id)
                logger.error("ucm-db store %s: a dead writer's provisional blocks could not be deleted (`ucm-db "
                             "invalidate` the namespace to drop them): %s", state.path, exc)
            return removed
    state.engine.write(lambda txn: marks.drop(txn, names))  # those read: a put landing since keeps its own
    state.activity.committed(0)
    if wing is not None and removed and retract_now:
        wing.retract()  # never raises: what it leaves, the uploader deletes
    if removed:
        logger.warning("ucm-db store %s: deleted %d blocks a writer that died had stored provisionally (saves it could "
                       "no longer take back)", state.path, removed)
    return removed
