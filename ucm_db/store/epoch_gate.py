"""The namespaces' epochs as one process of a store serves them: the gate
every lookup, read, put, warm and bump passes, and first contact with the
store's remote (:mod:`ucm_db.store.epochs` holds the records).

Invariants:
    * A namespace whose epoch is unknown (a damaged record, or one lost
      while the store holds its blocks) is not served: lookups count 0,
      reads miss, puts and ``epoch()`` raise
      :class:`~ucm_db.store.epochs.EpochUnknownError`. It is logged once
      per namespace and store object (an error line naming the fix), again
      only after a bump established it and it was lost anew.
    * ``epoch()`` reads the record again unless the store's last commit
      is the one its last read saw (``commits``: LMDB's ids, the last one
      read without a call into LMDB, :mod:`ucm_db.engines.lmdb.commit_ids`;
      a bump anywhere is a commit), or when the remote's floor moved, or
      :data:`QUICK_RECHECK_S` passed; otherwise it answers from memory
      (a read transaction cost a serving engine's scheduler a median 75
      us, most of it winning the GIL back), so a record damaged on disk
      without a commit is found within that time. An engine without
      commit ids, or a namespace with anything pending on the remote,
      reads every time.
    * Reads never write: lookups and reads only read the state (one read
      transaction) and, at first contact, the remote's manifest; what they
      learn there is held in memory until ``epoch()`` or a put records it.
      A promotion of remote blocks is a put here: it registers the
      namespace (:meth:`EpochGate.before_put`) before the blocks and their
      namespace's description enter the local tier
      (:class:`~ucm_db.remote.promotion.PromotionTarget`).
    * A put reads the state inside its own write transaction
      (:meth:`EpochGate.check_put`): no read transaction of its own, and no
      window in which a record damaged or lost meanwhile passes as known.
    * First contact with a remote (per namespace and process, before
      anything of it is read through from the remote): the manifest's epoch
      is read and the namespace's epoch becomes ``max(local, remote)``
      (recorded by ``epoch()`` or the first put of a writable store, held
      in memory by a read-only one). Until it answers nothing of the
      namespace is read through from the remote. A read slower than the
      call's deadline goes on (:mod:`ucm_db.remote.first_contact`) and a
      later call takes its answer; one that fails (remote down) or runs past
      :data:`~ucm_db.remote.first_contact.PENDING_LIMIT_S` is retried at
      most every :data:`RETRY_S`.
    * Keys rooted at an epoch this object handed out (``epoch()``, a bump)
      below the one first contact then found on the remote are stale: once
      ``epoch()`` has been asked, nothing of the namespace is read through
      while the remote's epoch is above the last answer, until ``epoch()``
      is asked again (a first contact that ended between a step's
      ``epoch()`` and its lookup, or a retry that fell due there, served
      the KV of before another node's invalidation).
    * A bump with a remote reads the remote afresh (never the epoch first
      contact cached: a node bumping after another node's bump took its
      number, and served that node's blocks of before its own bump) and
      claims its epoch there above every epoch the fleet took, the
      manifest's and those signed by a key rotated out (up to
      :data:`~ucm_db.remote.manifests.UNVERIFIED_EPOCH_LIMIT`) included
      (:mod:`ucm_db.remote.epoch_claims`), before recording it: two bumps
      never share an epoch. One that cannot reach the remote in a bulk
      step's deadline, or is made without a remote on a namespace shared
      with one, records a fresh epoch, which no node can have counted to
      (:mod:`ucm_db.store.shared_epochs`), told to the remote later.
    * A writable store tells the remote its epoch when it is higher than
      the manifest's (after a bump, ``ucm-db invalidate`` run beside it, or
      at first contact) from ``epoch()`` and puts, once per new epoch and
      process; a failure is logged and retried after :data:`RETRY_S`.
      A running store learns another node's bump of the same remote at its
      next start (first contact), or from ``ucm-db invalidate`` on its own
      store. A manifest whose epoch cannot be established (malformed, or not
      signed by a configured key) counts as a failed first contact; a bump
      here rewrites it. Such a failure is kept (:meth:`EpochGate.remote_problem`)
      for the callers that refuse rather than go on locally (``warm``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import EpochSupersededError, RemotePendingError
from ucm_db.keys import Namespace
from ucm_db.store import epochs, shared_epochs
from ucm_db.store.epochs import EpochState

#: Seconds between attempts to read (or write) a remote's epoch after a failure.
RETRY_S = 5.0
#: Longest an epoch is answered from memory while the store saw no commit (:meth:`EpochGate.epoch`).
QUICK_RECHECK_S = 1.0

_log = logging.getLogger("ucm_db")


class CommitClock(Protocol):
    """What the gate needs of :class:`ucm_db.engines.lmdb.CommitIds`."""

    def last(self) -> int | None: ...

    def seen_by(self, txn: Txn) -> int | None: ...


class RemoteEpochs(Protocol):
    """What the gate needs of :class:`ucm_db.remote.wing.RemoteWing`."""

    @property
    def bulk_deadline_s(self) -> float: ...

    def namespace_epoch(self, namespace_id: bytes, wait_s: float | None = None) -> int | None: ...

    def publish_epoch(self, namespace_id: bytes, epoch: int, description: dict[str, Any],
                      taken_unix_s: float | None = None) -> None: ...

    def claim_epoch(self, namespace_id: bytes, choose: Callable[[int], int], description: dict[str, Any]) -> int: ...


#: How long a namespace found with a known epoch is served without reading its record again.
SERVES_RECHECK_S = 1.0


class EpochGate:
    """One store object's view of its namespaces' epochs (module invariants)."""

    def __init__(self, engine: Engine, path: Path, *, read_only: bool, remote: RemoteEpochs | None,
                 commits: CommitClock | None = None) -> None:
        self._engine = engine
        self._commits = commits  # the engine's commit ids (module invariants); None: read every time
        self._path = path
        self._read_only = read_only
        self._remote = remote
        self._floors: dict[bytes, int] = {}  # epochs met on the remote
        self._settled: set[bytes] = set()  # first contact with the remote made
        self._told: dict[bytes, int] = {}  # the epoch the remote was seen with or told
        self._retry_at: dict[bytes, float] = {}
        self._registered: dict[bytes, int] = {}  # namespaces recorded by this process, with the floor they took
        self._reported: set[bytes] = set()
        self._remote_warned: set[bytes] = set()
        self._serves_until: dict[bytes, float] = {}  # known epochs, until when (serves)
        self._handed: dict[bytes, int] = {}  # the epoch epoch() or bump() last answered (callers root keys at it)
        self._unverified: dict[bytes, int] = {}  # epochs a manifest carries that no configured key signed (bump goes above)
        self._failures: dict[bytes, str] = {}  # why first contact failed last (cleared when it succeeds)
        self._quick: dict[bytes, tuple[int, int, float]] = {}  # epoch() answered at: commit id, floor, until when

    # -- the doors ----------------------------------------------------------------
    def epoch(self, namespace: Namespace, wait_s: float | None = None) -> int:
        """The namespace's epoch (first contact with the remote made, a
        higher remote epoch recorded, first contact waited for at most
        ``wait_s``: the lookup deadline by default, as the connector's
        scheduler asks every step); raises EpochUnknownError. Answered from
        memory while the store saw no commit since the last answer (module
        invariants)."""
        ns_id = namespace.id
        quick, commits = self._quick.get(ns_id), self._commits
        if (quick is not None and commits is not None and quick[:2] == (commits.last(), self._floors.get(ns_id, 0))
                and time.monotonic() < quick[2] and ns_id in self._handed):
            return self._handed[ns_id]
        self._settle(ns_id, wait_s)
        found, seen = self._engine.read(lambda txn: (epochs.state(txn, ns_id), None if commits is None else commits.seen_by(txn)))
        epoch = self._known(ns_id, found)
        floor = self._floors.get(ns_id, 0)
        if floor > epoch and not self._read_only:
            epoch = self._record(ns_id, floor)
        epoch = max(epoch, floor)
        self._tell(namespace, epoch)
        epoch = max(epoch, self._floors.get(ns_id, 0))  # a tell superseded moved it on (_tell)
        self._handed[ns_id] = epoch
        if seen is not None and (self._remote is None or (ns_id in self._settled and self._told.get(ns_id, 0) >= epoch)):
            self._quick[ns_id] = (seen, self._floors.get(ns_id, 0), time.monotonic() + QUICK_RECHECK_S)
        return epoch

    def serves(self, namespace: Namespace) -> bool:
        """Whether lookups and reads of the namespace may be answered (its
        epoch is known); one read transaction, never a write. A known epoch
        is taken as known for :data:`SERVES_RECHECK_S` (a lookup is about
        25 us: a read transaction each would add half); the answer says only
        that the record is readable, not which epoch the caller's keys are
        rooted at, so a record damaged meanwhile is found by the next check."""
        ns_id = namespace.id
        now = time.monotonic()
        if self._serves_until.get(ns_id, 0.0) > now:
            return True
        found = self._state(ns_id)
        if found.epoch is None:
            self._serves_until.pop(ns_id, None)
            self._report(ns_id, found.problem)
            return False
        self._serves_until[ns_id] = now + SERVES_RECHECK_S
        return True

    def remote_ok(self, namespace: Namespace, wait_s: float | None = None) -> bool:
        """Whether the namespace may be read through from the remote (first
        contact made, waited for at most ``wait_s``: the caller's deadline;
        module invariants)."""
        ns_id = namespace.id
        self._settle(ns_id, wait_s)
        floor = self._floors.get(ns_id, 0)
        return ns_id in self._settled and self._handed.get(ns_id, floor) >= floor  # stale keys: never read through

    def before_put(self, namespace: Namespace) -> None:
        """Registers the namespace before its first block here (its record,
        at a remote's higher epoch); raises EpochUnknownError. A namespace
        registered already costs no transaction here: the put's own write
        transaction checks its state (:meth:`check_put`)."""
        ns_id = namespace.id
        self._settle(ns_id)
        floor = self._floors.get(ns_id, 0)
        if self._registered.get(ns_id, -1) >= floor:
            return
        self._tell(namespace, self._record(ns_id, floor))

    def check_put(self, txn: Txn, namespace_id: bytes) -> None:
        """Inside a put's write transaction (after :meth:`before_put`):
        raises EpochUnknownError unless the namespace's epoch is known, so
        the put is refused, nothing written, whatever happened to the record
        since (damage, a loss). It reads the record only: a put keyed at an
        epoch another process has moved on from is stored like any other
        (never served: readers key at the new epoch), as before."""
        self._known(namespace_id, epochs.state(txn, namespace_id))

    def adopt(self, namespace_id: bytes, carried: int | None) -> EpochState:
        """Records an epoch met elsewhere (an archive's) where higher
        (:func:`ucm_db.store.epochs.adopt`); an unknown epoch is logged."""
        found = epochs.adopt(self._engine, namespace_id, carried)
        if found.epoch is None:
            self._report(namespace_id, found.problem)
        else:
            self._registered[namespace_id] = max(self._registered.get(namespace_id, 0), carried or 0)
        return found

    def remote_problem(self, namespace: Namespace) -> str:
        """Why the namespace may not be read through from the remote now
        (after :meth:`remote_ok` said no), for an error naming it."""
        ns_id = namespace.id
        if ns_id in self._failures:
            return f"its epoch on the remote cannot be read: {self._failures[ns_id]}"
        if ns_id in self._settled:
            return "its epoch on the remote is above the one this call was keyed at"
        return "its epoch on the remote is not known yet: the remote's manifest did not answer in time (still being read)"

    def on_remote(self, namespace: Namespace, epoch: int) -> bool:
        """Whether the remote was told ``epoch`` of the namespace (or a
        higher one) by this object (a bump's claim, a tell)."""
        return self._told.get(namespace.id, -1) >= epoch

    def bump(self, namespace: Namespace) -> int:
        """Moves the namespace's epoch on: with a remote, claimed there
        above the fleet's epoch (module invariants); returns the new epoch
        (durable)."""
        ns_id = namespace.id
        self._quick.pop(ns_id, None)
        floor = max(self._floors.get(ns_id, 0), self._unverified.get(ns_id, 0))
        if self._remote is None:  # shared with a remote before: a fresh epoch, above any count the fleet reached
            epoch = epochs.bump(self._engine, ns_id, floor, fresh=shared_epochs.is_shared(self._engine, ns_id))
        else:
            epoch = self._bump_through(namespace, floor)
        self._reported.discard(ns_id)
        self._registered[ns_id] = max(self._registered.get(ns_id, 0), self._floors.get(ns_id, 0))
        self._handed[ns_id] = epoch
        return epoch

    def _bump_through(self, namespace: Namespace, floor: int) -> int:
        """A bump claimed on the remote; a fresh epoch where it cannot be."""
        assert self._remote is not None
        ns_id = namespace.id
        for _ in range(3):  # another process of this store may move the epoch past a claim: claim above it
            current, high = shared_epochs.basis(self._engine, ns_id)
            choose = partial(shared_epochs.claimable, current, high, floor)
            choose(0)  # at the top of the epoch space or with no epoch known above a lost one: raised here
            try:
                claimed = self._remote.claim_epoch(ns_id, choose, namespace.to_dict())
            except epochs.EpochSpaceError:
                raise  # no epoch left above the fleet's: never one below it instead
            except Exception as exc:  # noqa: BLE001 - any remote failure: an epoch no node can have taken
                return self._bump_unreached(namespace, floor, f"{type(exc).__name__}: {exc}")
            if shared_epochs.record_claimed(self._engine, ns_id, claimed):
                self._floors[ns_id] = self._told[ns_id] = claimed
                self._settled.add(ns_id)
                for known in (self._unverified, self._retry_at, self._failures):
                    known.pop(ns_id, None)
                return claimed
            floor = max(floor, claimed)
        return self._bump_unreached(namespace, floor, "this store's epoch kept moving past the claims")

    def _bump_unreached(self, namespace: Namespace, floor: int, why: str) -> int:
        ns_id = namespace.id
        epoch = epochs.bump(self._engine, ns_id, floor, fresh=True)
        shared_epochs.mark(self._engine, ns_id)
        self._retry_at[ns_id] = time.monotonic() + RETRY_S
        _log.warning("ucm-db: the remote did not take a new epoch of namespace %s (%s); it moved to the fresh epoch %d, "
                     "which no other node can have counted to, and the remote is told it at the next contact",
                     ns_id.hex(), why, epoch)
        return epoch

    # -- parts --------------------------------------------------------------------
    def _state(self, ns_id: bytes) -> EpochState:
        return self._engine.read(lambda txn: epochs.state(txn, ns_id))

    def _known(self, ns_id: bytes, found: EpochState) -> int:
        if found.epoch is None:
            self._report(ns_id, found.problem)
            raise epochs.unknown_error(ns_id, found.problem, str(self._path))
        return found.epoch

    def _record(self, ns_id: bytes, floor: int) -> int:
        found = epochs.adopt(self._engine, ns_id, floor or None)
        epoch = self._known(ns_id, found)
        if self._remote is not None:
            shared_epochs.mark(self._engine, ns_id)  # bumps without the remote then take fresh epochs
        self._registered[ns_id] = floor
        return epoch

    def _report(self, ns_id: bytes, problem: str | None) -> None:
        if ns_id in self._reported:
            return
        self._reported.add(ns_id)
        _log.error("ucm-db: store %s: %s", self._path, epochs.unknown_error(ns_id, problem, str(self._path)))

    def _settle(self, ns_id: bytes, wait_s: float | None = None) -> None:
        """First contact with the remote: reads its epoch of the namespace
        (a read still running when ``wait_s`` is up is left to a later call)."""
        if self._remote is None or ns_id in self._settled or time.monotonic() < self._retry_at.get(ns_id, 0.0):
            return
        try:
            carried = self._remote.namespace_epoch(ns_id, wait_s)
        except RemotePendingError:
            return  # a slow first request (an object store's session set-up), not a failure
        except Exception as exc:  # noqa: BLE001 - any remote failure: retried later, nothing read through meanwhile
            self._retry_at[ns_id] = time.monotonic() + RETRY_S
            self._failures[ns_id] = f"{type(exc).__name__}: {exc}"
            unverified = getattr(exc, "unverified_epoch", None)  # a manifest signed by no configured key
            if unverified is not None:
                self._unverified[ns_id] = max(self._unverified.get(ns_id, 0), unverified)
            if ns_id not in self._remote_warned:
                self._remote_warned.add(ns_id)
                _log.warning("ucm-db: cannot read the remote's epoch of namespace %s (%s: %s); nothing of it is read "
                             "through from the remote until it can (retried every %.0f s)", ns_id.hex(), type(exc).__name__,
                             exc, RETRY_S)
            return
        if carried is not None:
            self._floors[ns_id] = max(self._floors.get(ns_id, 0), carried)
            if not self._read_only:  # the remote holds it: a bump without the remote must not count (shared_epochs)
                shared_epochs.mark(self._engine, ns_id)
        self._told[ns_id] = max(self._told.get(ns_id, 0), carried or 0)
        self._settled.add(ns_id)
        self._failures.pop(ns_id, None)

    def _tell(self, namespace: Namespace, epoch: int) -> None:
        """Tells the remote a higher epoch than it has (module invariants)."""
        ns_id = namespace.id
        if (self._remote is None or self._read_only or ns_id not in self._settled
                or self._told.get(ns_id, 0) >= epoch or time.monotonic() < self._retry_at.get(ns_id, 0.0)):
            return
        taken_unix_s = (epoch - epochs.FRESH_EPOCH_BASE) / 1000 if epochs.FRESH_EPOCH_BASE <= epoch < epochs.CARRIED_EPOCH_LIMIT else None
        try:
            self._remote.publish_epoch(ns_id, epoch, namespace.to_dict(), taken_unix_s)
        except EpochSupersededError as exc:  # another node invalidated after it was taken: never undo that
            _log.warning("ucm-db: %s; claiming a new epoch there instead", exc)
            self._bump_through(namespace, epoch)
            return
        except Exception as exc:  # noqa: BLE001 - any remote failure: retried later
            self._retry_at[ns_id] = time.monotonic() + RETRY_S
            _log.warning("ucm-db: cannot record epoch %d of namespace %s on the remote (%s: %s); retried in %.0f s",
                         epoch, ns_id.hex(), type(exc).__name__, exc, RETRY_S)
            return
        self._told[ns_id] = epoch
        shared_epochs.mark(self._engine, ns_id)  # told: a bump without the remote must not count (shared_epochs)
