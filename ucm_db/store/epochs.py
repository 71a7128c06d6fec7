"""Namespace epochs: invalidating a model's blocks without deleting them, and
knowing each namespace's epoch or refusing it.

A namespace's *epoch* is a number recorded in the store (the checked info
record ``epoch:<namespace id>``, 8 bytes little-endian, with its checksum
sidecar, :mod:`ucm_db.index.records`). Key chains are rooted at it
(:meth:`ucm_db.Namespace.block_keys` ``epoch=``), so moving it on
(:func:`bump`) makes every block stored before a miss for every process
that reads the epoch again: after a weight update, an engine's
``reset_cache``, or ``ucm-db invalidate``. Nothing is deleted: the old
blocks are never found again and leave the store through normal LRU
eviction (or ``compact``).

The epoch travels with the blocks (issue 48): archives carry it in their
manifest (:mod:`ucm_db.maintenance.archive.epochs`), a remote in each
namespace manifest (:mod:`ucm_db.remote.manifests`); a store meeting a
higher one adopts it (:func:`adopt`), never a lower one.

States (:func:`state`):
    * a readable record: its value;
    * a damaged record (checksum or length): **unknown**;
    * no record, and no block of the namespace was ever put or imported
      here (no ``nsdesc:`` record of it): 0;
    * no record although blocks of it were put or imported here: **unknown**
      (the record was lost) once the store is *sealed* (``epochs:sealed``:
      every namespace described in it has a record, written by :func:`seal`
      the first time this code writes to the store, and :func:`adopt`
      registers each namespace before its first put or import); in a store
      not yet sealed, written only by ucm-db before epoch records were kept
      for every namespace, 0 (what that code meant by no record).

A promotion from a remote registers the namespace and records its
description as a put does (:class:`~ucm_db.remote.promotion.PromotionTarget`).
Blocks an older ucm-db promoted describe no namespace (no ``nsdesc:``): a
namespace held only through those reads a lost record as 0, and takes the
remote manifest's epoch at first contact (:mod:`ucm_db.store.epoch_gate`),
which is where those blocks came from.
A namespace an older ucm-db first put into a sealed store reads as lost
(refused until ``ucm-db invalidate``): the safe side.

An unknown epoch is never read as 0: :func:`read` raises
:class:`EpochUnknownError`, and the store refuses to serve the namespace
(:mod:`ucm_db.store.epoch_gate`) until ``ucm-db invalidate`` records a new
one.

Invariants:
    * Epochs only move forward: :func:`bump` and :func:`adopt` read and
      write the record in one write transaction, never write a lower value
      (but for a bump at the top of the epoch space, below), and make a
      raise durable (``Engine.sync``) whatever the store's durability: a
      power cut after a bump returned never brings old KV back.
      Two bumps at once (two engines, an engine and the CLI) give two
      different epochs.
    * Moving an epoch on (:func:`bump`, or :func:`adopt` raising it) releases
      the namespace's pins in the same transaction
      (:func:`ucm_db.index.pins.release_namespace`): its blocks are stale,
      never served again, and must be free to leave through eviction.
    * A bump of an unknown epoch records :func:`fresh_epoch`, and above
      the highest epoch the store ever recorded (:data:`HIGH_KEY`, raised
      in the transaction of every epoch write), so it never falls below the
      lost one (a review found a repaired epoch below an invalidated one,
      raised back to it by a re-import): ``2**40`` plus
      the wall clock in milliseconds, above any count a store reaches by
      bumps and above every fresh epoch recorded before it (while the clock
      does not step back), so the lost value is never reused. A bump of a
      namespace shared with a remote records one too where it cannot count
      with the fleet (:mod:`ucm_db.store.shared_epochs`).
    * An epoch met elsewhere is taken only below a ceiling (an archive
      carrying 2**64 - 1 made its namespace impossible to invalidate: every
      bump failed and the old blocks stayed served): below
      :data:`CARRIED_EPOCH_LIMIT` where nothing authenticates it (an
      archive imported without an auth key, a remote without one), below
      :data:`SIGNED_EPOCH_LIMIT` where a configured key signed it (as the
      remote tier adopts in full only what its key signed,
      :mod:`ucm_db.remote.manifests`, which holds the same two numbers).
      :func:`adopt` refuses more; the archive and the remote refuse it
      before anything is written or read through.
    * Every epoch a store records is below :data:`SIGNED_EPOCH_LIMIT`
      (2**63: the engines' private epochs start there), and a bump never
      records a lower one than before (:func:`next_epoch` refuses at the
      top rather than wrap: a lower one is raised back by the next import
      or remote contact carrying the old, and other nodes never move to
      it). A recorded epoch at or above the limit (an older ucm-db took one
      unbounded) is unknown, so the namespace is not served, and its
      invalidation records a fresh epoch as for a lost record: nothing
      carrying the old value is taken any more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import DamagedRecordError, TierError
from ucm_db.index import epoch_moves, pins, records
from ucm_db.index.accounting import NS_COUNTS_PREFIX, NS_DESC_PREFIX

#: Info record name prefix; the 16-byte namespace id follows.
EPOCH_PREFIX = b"epoch:"
#: Info record present once every namespace the store holds has an epoch record.
SEALED_KEY = b"epochs:sealed"
#: The highest epoch the store ever recorded (:func:`_high`): a lost epoch's
#: new one goes above it, so it never falls below the lost one.
HIGH_KEY = b"epochs:high"
#: The base of fresh epochs (a bump of an unknown epoch).
FRESH_EPOCH_BASE = 1 << 40
#: Epochs are unsigned 64-bit numbers (:meth:`ucm_db.Namespace.root_key`).
EPOCH_LIMIT = 1 << 64
#: Epochs taken from what nothing authenticates stay below this: above every
#: epoch a store reaches (counts of bumps; fresh epochs stay below it until
#: the clock reads year 10800), so a planted one moves an epoch on at most
#: this far, far from using up the epoch space.
CARRIED_EPOCH_LIMIT = 1 << 48
#: Epochs taken where a configured auth key signed them, and every epoch a
#: store records, stay below this: the engines' private epochs start here
#: (``connector/epochs.py``), which no store epoch reaches.
SIGNED_EPOCH_LIMIT = 1 << 63
_EPOCH_BYTES = 8
_NAMESPACE_ID_BYTES = 16
_INFO = "info"


class EpochSpaceError(TierError):
    """A bump would take an epoch to the engines' private range (module invariants)."""


class EpochUnknownError(DamagedRecordError):
    """A namespace's epoch cannot be established (its record is damaged, or
    lost while the store holds its blocks): the namespace is not served."""

    default_hint = "run `ucm-db invalidate PATH --namespace ID` to record a new epoch"


@dataclass(frozen=True, slots=True)
class EpochState:
    """A namespace's epoch as the store knows it.

    Attributes:
        epoch: the epoch; None when unknown.
        problem: why it is unknown (None when known).
        recorded: whether the store has a readable record of it.
    """

    epoch: int | None
    problem: str | None = None
    recorded: bool = False

    @property
    def known(self) -> bool:
        return self.epoch is not None


def is_epoch(value: object) -> bool:
    """Whether ``value`` is a valid epoch (an int in ``[0, 2**64)``, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < EPOCH_LIMIT


def _name(namespace_id: bytes) -> bytes:
    if len(namespace_id) != _NAMESPACE_ID_BYTES:
        raise ValueError(f"namespace id must be {_NAMESPACE_ID_BYTES} bytes, got {len(namespace_id)}")
    return EPOCH_PREFIX + bytes(namespace_id)


def _put(txn: Txn, namespace_id: bytes, epoch: int, *, lost: bool = False) -> None:
    """Records the namespace's epoch; ``lost``: its record was lost (absent
    though the store holds its blocks), so this replaces an epoch too."""
    high = _high(txn)  # before this write: the record it replaces counts
    before = txn.get(_INFO, _name(namespace_id))
    if lost or (before is not None and bytes(before) != epoch.to_bytes(_EPOCH_BYTES, "little")):
        epoch_moves.record(txn, namespace_id)  # a resumed event follower resyncs (epoch_moves.py)
    records.put_checked(txn, _name(namespace_id), epoch.to_bytes(_EPOCH_BYTES, "little"))
    # A damaged high-water record stays damaged: never lowered by a rewrite.
    if high is not None and epoch < SIGNED_EPOCH_LIMIT and (epoch > high or txn.get(_INFO, HIGH_KEY) is None):
        records.put_checked(txn, HIGH_KEY, max(high, epoch).to_bytes(_EPOCH_BYTES, "little"))


def _high(txn: Txn) -> int | None:
    """The highest epoch this store ever recorded for any namespace
    (:data:`HIGH_KEY`; a store from before that record: its highest readable
    epoch record); None when the record is damaged."""
    try:
        value = records.get_checked(txn, HIGH_KEY, size=_EPOCH_BYTES)
    except records.DamagedRecord:
        return None
    if value is not None:
        return int.from_bytes(bytes(value), "little")
    highest = 0
    for name, _ in txn.scan(_INFO, EPOCH_PREFIX):
        try:
            raw = records.get_checked(txn, bytes(name), size=_EPOCH_BYTES)
        except records.DamagedRecord:
            continue
        value_read = int.from_bytes(bytes(raw), "little") if raw is not None else 0
        if value_read < SIGNED_EPOCH_LIMIT:  # one at or above is unknown, never taken again (module invariants)
            highest = max(highest, value_read)
    return highest


def held(txn: Txn, namespace_id: bytes) -> bool:
    """Whether blocks of the namespace were put or imported here (it has a
    description, written with its first put and never deleted: ``verify
    --fix`` reseals a damaged one or leaves a placeholder,
    :mod:`ucm_db.index.descriptions`). Its counter record does not count: an
    older ucm-db's promotions left counters without a description, whose
    namespace reads a lost epoch as 0 (module docstring)."""
    return txn.get(_INFO, NS_DESC_PREFIX + namespace_id) is not None


def sealed(txn: Txn) -> bool:
    """Whether every namespace the store holds has an epoch record (a
    damaged marker counts as present: the safe side)."""
    return txn.get(_INFO, SEALED_KEY) is not None


def state(txn: Txn, namespace_id: bytes) -> EpochState:
    """The namespace's epoch state (module docstring)."""
    try:
        value = records.get_checked(txn, _name(namespace_id), size=_EPOCH_BYTES)
    except records.DamagedRecord as exc:
        return EpochState(None, f"its epoch record is damaged ({exc.reason})")
    if value is not None:
        epoch = int.from_bytes(bytes(value), "little")
        if epoch >= SIGNED_EPOCH_LIMIT:  # taken unbounded by an older ucm-db (module invariants)
            return EpochState(None, f"its epoch {epoch} is at or above 2**63, the engines' private epochs (taken from an "
                                    "archive or remote by an older ucm-db)")
        return EpochState(epoch, recorded=True)
    if held(txn, namespace_id) and sealed(txn):
        return EpochState(None, "its epoch record is missing although the store holds its blocks (lost)")
    return EpochState(0)


def unknown_error(namespace_id: bytes, problem: str | None, where: str = "PATH") -> EpochUnknownError:
    """The error of a namespace whose epoch is unknown."""
    return EpochUnknownError(
        f"the epoch of namespace {namespace_id.hex()} cannot be established: {problem}; it is not served "
        "(lookups miss, puts are refused) and never read as epoch 0",
        hint=f"run `ucm-db invalidate {where} --namespace {namespace_id.hex()}` to record a new epoch (or `ucm-db "
             f"verify --fix {where}`, which renews every unknown epoch, described or not)",
    )


def read(engine: Engine, namespace_id: bytes) -> int:
    """The namespace's epoch: one read transaction.

    Raises:
        EpochUnknownError: the epoch is unknown (damaged or lost record).
    """
    found = engine.read(lambda txn: state(txn, namespace_id))
    if found.epoch is None:
        raise unknown_error(namespace_id, found.problem)
    return found.epoch


def fresh_epoch() -> int:
    """An epoch above every count and every earlier fresh epoch (module invariants)."""
    return FRESH_EPOCH_BASE + time.time_ns() // 1_000_000


def _namespaces_held(txn: Txn, prefixes: tuple[bytes, ...] = (NS_DESC_PREFIX,)) -> Iterator[bytes]:
    for prefix in prefixes:
        for name, _ in txn.scan(_INFO, prefix):
            namespace_id = bytes(name)[len(prefix):]
            if len(namespace_id) == _NAMESPACE_ID_BYTES:
                yield namespace_id


def seal(txn: Txn) -> int:
    """Seals the store (once in its life): every namespace it holds without
    an epoch record gets epoch 0 (what ucm-db before sealed stores meant by
    no record), then the marker. Returns records written."""
    if sealed(txn):
        return 0
    written = 0
    for namespace_id in sorted(set(_namespaces_held(txn))):
        if txn.get(_INFO, _name(namespace_id)) is None:
            _put(txn, namespace_id, 0)
            written += 1
    records.put_checked(txn, SEALED_KEY, b"1")
    return written


def carried_limit(signed: bool) -> int:
    """The ceiling (exclusive) of an epoch taken from elsewhere, signed by
    a configured auth key or not (module invariants)."""
    return SIGNED_EPOCH_LIMIT if signed else CARRIED_EPOCH_LIMIT


def adopt(engine: Engine, namespace_id: bytes, carried: int | None = None) -> EpochState:
    """Seals the store, registers the namespace (a record of its epoch, 0
    for a namespace new here) and raises its epoch to ``carried`` where that
    is higher (an epoch met on a remote or in an archive; None: not known,
    nothing raised). Never lowers. An unknown epoch stays unknown (the
    carried one may be older than the lost one): the state says so.
    ``carried`` must be below :data:`SIGNED_EPOCH_LIMIT` (ValueError: the
    callers refuse more first, with the fix)."""
    if carried is not None and not (is_epoch(carried) and carried < SIGNED_EPOCH_LIMIT):
        raise ValueError(f"a carried epoch is an integer in [0, 2**63), got {str(carried)[:40]!r}")

    def run(txn: Txn) -> tuple[EpochState, bool]:
        seal(txn)
        found = state(txn, namespace_id)
        if found.epoch is None:
            return found, False
        epoch = max(found.epoch, carried or 0)
        if epoch != found.epoch or not found.recorded:
            _put(txn, namespace_id, epoch)
        if epoch > found.epoch:
            pins.release_namespace(txn, namespace_id)  # stale is stale (module invariants)
        return EpochState(epoch, recorded=True), epoch > found.epoch

    found, raised = engine.write(run)
    if raised:
        engine.sync()
    return found


def next_epoch(current: int | None, floor: int = 0, high: int | None = 0, *, fresh: bool = False) -> int:
    """The epoch a bump records: one above ``current`` and ``floor``, or,
    where ``current`` is unknown, a :func:`fresh_epoch` above ``floor`` and
    ``high`` (the store's high-water epoch, :func:`_high`: above the lost
    one); ``fresh``: at least a fresh epoch in any case (a bump of a
    namespace shared with a remote made without it, :mod:`ucm_db.store.shared_epochs`).

    Raises:
        EpochSpaceError: that would reach :data:`SIGNED_EPOCH_LIMIT`; never
            a lower epoch instead (module invariants).
        EpochUnknownError: ``current`` is unknown and the high-water record
            is damaged too (``high`` None): no new epoch is known to be above the lost one.
    """
    if current is None and high is None:
        raise EpochUnknownError(
            "a new epoch cannot be chosen: the store's epoch high-water record is damaged as well as this "
            "namespace's epoch record, so no epoch is known to be above the lost one",
            hint="move the store aside (or remove its directory) and start a new one",
        )
    epoch = max(fresh_epoch(), floor + 1, (high or 0) + 1) if current is None else max(current, floor) + 1
    if fresh:
        epoch = max(epoch, fresh_epoch())
    if epoch >= SIGNED_EPOCH_LIMIT:
        raise EpochSpaceError(
            f"the epoch cannot move on from {max(current or 0, floor)}: the next would reach 2**63, the engines' private "
            "epochs (only an epoch a configured auth key signed, in an archive or on the remote, comes so close)",
            hint="find who signed it; to serve this namespace again move the store aside (or remove its directory) and "
                 "start a new one",
        )
    return epoch


def bump(engine: Engine, namespace_id: bytes, floor: int = 0, *, fresh: bool = False) -> int:
    """Moves the namespace's epoch on, above ``floor`` too (an epoch met on
    a remote, below :data:`SIGNED_EPOCH_LIMIT`: ValueError otherwise); an
    unknown epoch, or any with ``fresh``, becomes a :func:`fresh_epoch`;
    EpochSpaceError at the top (:func:`next_epoch`). Returns the new epoch
    (durable)."""
    if not (is_epoch(floor) and floor < SIGNED_EPOCH_LIMIT):
        raise ValueError(f"a bump's floor is an integer in [0, 2**63), got {str(floor)[:40]!r}")

    def run(txn: Txn) -> int:
        seal(txn)
        found = state(txn, namespace_id)
        epoch = next_epoch(found.epoch, floor, _high(txn) if found.epoch is None else 0, fresh=fresh)
        _put(txn, namespace_id, epoch, lost=found.epoch is None)
        pins.release_namespace(txn, namespace_id)  # stale is stale (module invariants)
        return epoch

    epoch = engine.write(run)
    engine.sync()
    return epoch


def all_states(engine: Engine) -> dict[bytes, EpochState]:
    """Every namespace the store describes, counts or has an epoch record
    of, with its state (one read transaction)."""
    def run(txn: Txn) -> dict[bytes, EpochState]:
        ids = set(_namespaces_held(txn, (NS_DESC_PREFIX, NS_COUNTS_PREFIX)))
        for name, _ in txn.scan(_INFO, EPOCH_PREFIX):
            namespace_id = bytes(name)[len(EPOCH_PREFIX):]
            if len(namespace_id) == _NAMESPACE_ID_BYTES:
                ids.add(namespace_id)
        return {namespace_id: state(txn, namespace_id) for namespace_id in sorted(ids)}
    return engine.read(run)


def problems(engine: Engine) -> list[str]:
    """One line per namespace whose epoch cannot be established (what
    ``ucm-db verify`` and ``inspect`` report; read-only). Each names the fix."""
    return [f"{unknown_error(namespace_id, found.problem)}" for namespace_id, found in all_states(engine).items()
            if found.epoch is None]


def repair(engine: Engine) -> dict[bytes, int]:
    """Records a fresh epoch (:func:`bump`) for every namespace whose epoch
    is unknown (``verify --fix``); returns the new epoch of each. Blocks of
    the lost epoch are never served again."""
    return {namespace_id: bump(engine, namespace_id)
            for namespace_id, found in all_states(engine).items() if found.epoch is None}
