"""Pinned blocks: the records that keep a block and its ancestors out of
eviction, kept by the local index's own write transactions.

A *pin* is made by a chain (:meth:`ucm_db.Store.pin`) at one block, the
chain's last stored block then (its *tip*); it pins that block and every
ancestor. A chain is named by its last key as given (its *chain id*: keys
are chained digests, so the last one names the whole chain, stored or
not). The index keeps, in ``info`` (nothing else scans these prefixes):

* ``pin/<key>``: a :class:`~ucm_db.index.entries.PinRecord` of every pinned
  block: namespace id, stored bytes, ``below`` (the blocks at or below it
  with a pin made at them) and ``own`` (one or more pins were made at it).
* ``pinby/<tip><chain id>``: one per pin a chain made (value: the namespace
  id): which chains hold the pin at ``tip``. A block with ``own`` and no
  ``pinby/`` record holds a *legacy* pin (made by ucm-db before these
  records); a chain pinning that very block takes it as its own. The
  ``pin/`` record is unchanged from that version, so its stores' pins
  keep working.
* ``pincount:<ns>``: the namespace's pinned blocks and stored bytes,
  checksummed like the other counters (:mod:`ucm_db.index.accounting`).
* ``pinsince:<ns>``: when the namespace's epoch last moved (wall clock ns,
  checksummed), written by :func:`release_namespace`, which every epoch
  move calls in its own transaction: a chain whose first block was stored
  before it is keyed at an older epoch (a chain's keys are all rooted at
  one epoch), is never served again, and is never pinned
  (:mod:`ucm_db.index.pinning`).

Invariants:
    * A block has a pin record exactly while ``below > 0``; ``below`` equals
      ``own`` plus the ``below`` of its pinned children. So a pinned block's
      ancestors are pinned, the pinned blocks of a chain are a prefix of
      it, and a chain *tail* (no children) is pinned only by its own pin:
      eviction, which takes tails only, skips a tail with a pin record and
      never needs to look below it (:mod:`ucm_db.index.writes`).
    * One pin per chain, released only by that chain: a block's ``own``
      stays while any ``pinby/`` record names it (or its legacy pin
      stands), so unpinning a conversation never takes the pin its system
      prompt made on its own (:func:`pin_chain`, :func:`unpin_chain`).
      Every ``pinby/`` record names a block with ``own`` in its namespace.
    * Every change runs inside the write transaction that pins, unpins or
      removes blocks, together with the counters (``Changes.add_pinned``,
      called before the record it counts is written or deleted, so a
      damaged counter recounted at that moment is not counted twice):
      the pinned counters equal the sums over the pin records at every
      commit, and a pin survives restarts, ``compact`` (its rewrite copies
      the ``info`` table) and engine conversion as the blocks do.
    * Removing a block removes its pin and ``pinby/`` records; removing a
      subtree first takes its pins out of its ancestors' ``below``
      (:func:`release_above`), so a delete, a quarantine or an invalidation
      never leaves an ancestor pinned for a pin that is gone.
    * Pinning and unpinning a block are idempotent (:func:`pin_at`,
      :func:`unpin_at`): a second pin at a block, or an unpin where none was
      made, changes nothing; so is a chain's pin (:func:`pin_chain`).
    * Every walk to the ancestors (:func:`_upward`) ends: each step's depth
      must be one less than the last, so it never meets a block twice. A
      parent link that breaks this (damaged metadata naming a descendant
      as parent, a parent cycle: a pin looped forever holding the writer
      lock) ends the walk there, as a block that is not stored does, and is
      logged; every walk stops at the same link, so the records stay
      consistent, and ``ucm-db verify`` reports the link (its depth
      check, :mod:`ucm_db.index.audit`) and ``--fix`` quarantines a cycle.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator, Sequence

from ucm_db.engines.base import Txn
from ucm_db.index import records
from ucm_db.index.accounting import PIN_COUNTS, PIN_COUNTS_PREFIX, Changes, recount_pins
from ucm_db.index.entries import PIN_PREFIX, BlockMeta, DamagedPin, PinRecord, meta_and_parent

logger = logging.getLogger("ucm_db")
INFO = "info"
#: Problems :func:`problems` lists one by one before it only counts them.
LISTED_PROBLEMS = 20
#: ``info`` name prefix of the chains' pins: ``pinby/<tip><chain id>``.
PIN_BY_PREFIX = b"pinby/"
#: ``info`` name prefix of when a namespace's epoch last moved (``pinsince:<ns>``).
PIN_SINCE_PREFIX = b"pinsince:"
PIN_SINCE = struct.Struct("<Q")


def is_pinned(txn: Txn, key: bytes) -> bool:
    """Whether ``key`` has a pin record (a damaged one counts: kept, not evicted)."""
    return txn.get(INFO, PIN_PREFIX + key) is not None


def read(txn: Txn, key: bytes) -> PinRecord | None:
    """``key``'s pin record; None where absent or damaged."""
    data = txn.get(INFO, PIN_PREFIX + key)
    if data is None:
        return None
    try:
        return PinRecord.unpack(data)
    except DamagedPin:
        return None


def _parent_of(txn: Txn, key: bytes) -> tuple[BlockMeta | None, bytes | None]:
    """``key``'s metadata and its parent (:func:`~ucm_db.index.entries.meta_and_parent`)."""
    return meta_and_parent(txn.get("meta", key))


def _upward(txn: Txn, key: bytes | None, below_depth: int | None = None) -> Iterator[tuple[bytes, BlockMeta | None]]:
    """``key`` and its ancestors with their metadata, child first: to the
    root, to a block not stored or damaged (yielded with None, last), or to
    a parent whose depth is not one less than its child's (not yielded;
    ``below_depth``: the depth of ``key``'s child, if the walk starts
    above one). Never a block twice (module invariants)."""
    current, depth = key, below_depth
    while current is not None:
        meta, parent = _parent_of(txn, current)
        if meta is not None and depth is not None and meta.depth != depth - 1:
            logger.warning("ucm-db: block %s (depth %d) is named as parent by a block of depth %d (a parent cycle or "
                           "damaged metadata): pins stop below it; run `ucm-db verify --fix`", current.hex()[:16], meta.depth, depth)
            return
        yield current, meta
        if meta is None:
            return
        current, depth = parent, meta.depth


def pin_at(txn: Txn, changes: Changes, key: bytes) -> int:
    """Makes a pin at the stored block ``key``, pinning it and its
    ancestors; returns how many blocks became pinned (0: a pin was made
    there already)."""
    record = read(txn, key)
    if record is not None and record.own:
        return 0
    newly = 0
    for current, meta in _upward(txn, key):
        if meta is None:
            break  # the prefix invariant says stored; a damaged record is quarantined by whoever reads it
        record = read(txn, current)
        if record is None:
            record = PinRecord(meta.namespace_id, meta.stored_bytes, 0, False)
            changes.add_pinned(record, +1)  # before the record is written (see _decrement)
            newly += 1
        record.below += 1
        record.own = record.own or current == key
        txn.put(INFO, PIN_PREFIX + current, record.pack())
    return newly


def unpin_at(txn: Txn, changes: Changes, key: bytes) -> int:
    """Takes back the pin made at ``key`` (if any); returns how many blocks
    stopped being pinned."""
    record = read(txn, key)
    if record is None or not record.own:
        return 0
    record.own = False
    txn.put(INFO, PIN_PREFIX + key, record.pack())
    return _decrement(txn, changes, key, 1)


def _decrement(txn: Txn, changes: Changes, start: bytes | None, count: int, below_depth: int | None = None) -> int:
    """Takes ``count`` pins out of ``start`` and its ancestors (``start``
    the parent of a block of ``below_depth``, if given); a block left with
    none loses its record. Returns blocks unpinned."""
    unpinned = 0
    for current, _meta in _upward(txn, start, below_depth):
        record = read(txn, current)
        if record is None:
            break  # above a block without a record nothing counts these pins
        record.below -= count
        if record.below <= 0:
            changes.add_pinned(record, -1)  # before the record changes: a recount it sets off must still see it
            txn.delete(INFO, PIN_PREFIX + current)
            unpinned += 1
        else:
            txn.put(INFO, PIN_PREFIX + current, record.pack())
    return unpinned


def release_above(txn: Txn, changes: Changes, key: bytes) -> None:
    """Before ``key``'s subtree is removed: takes the pins in it out of
    ``key``'s ancestors (one read where ``key`` is not pinned)."""
    record = read(txn, key)
    if record is None:
        return
    meta, parent = _parent_of(txn, key)
    _decrement(txn, changes, parent, record.below, None if meta is None else meta.depth)


def holders(txn: Txn, tip: bytes) -> list[bytes]:
    """Chain ids of the pins made at ``tip`` (empty where none, or only a
    legacy pin)."""
    prefix = PIN_BY_PREFIX + tip
    return [bytes(name)[len(prefix):] for name, _ in txn.scan(INFO, prefix)]


def chain_pin_in(txn: Txn, keys: Sequence[bytes], chain_id: bytes) -> bytes | None:
    """The block of ``keys`` (a chain's pinned prefix) where the chain
    ``chain_id`` made its pin, deepest first; None where it made none."""
    for key in reversed(keys):
        if txn.get(INFO, PIN_BY_PREFIX + key + chain_id) is not None:
            return key
    return None


def chain_pin_above(txn: Txn, key: bytes, chain_id: bytes) -> bytes | None:
    """The ancestor of stored ``key`` (a slice's first block) where the chain
    ``chain_id`` made its pin; None where none did (a walk to the root:
    only a chain given as a slice pays it)."""
    _, parent = _parent_of(txn, key)
    for ancestor, _meta in _upward(txn, parent):
        if txn.get(INFO, PIN_BY_PREFIX + ancestor + chain_id) is not None:
            return ancestor
    return None


def legacy_pin_in(txn: Txn, keys: Sequence[bytes]) -> bytes | None:
    """The deepest block of ``keys`` holding a legacy pin; None where none."""
    for key in reversed(keys):
        record = read(txn, key)
        if record is not None and record.own and not holders(txn, key):
            return key
    return None


def pin_chain(txn: Txn, changes: Changes, tip: bytes, chain_id: bytes, namespace_id: bytes) -> int:
    """Makes chain ``chain_id``'s pin at its stored block ``tip`` (see
    :func:`pin_at`); returns how many blocks became pinned (0: that pin is
    made already, or another pin holds them). A legacy pin at ``tip``
    becomes this chain's (most likely the same chain, pinned again)."""
    name = PIN_BY_PREFIX + tip + chain_id
    if txn.get(INFO, name) is not None:
        return 0
    txn.put(INFO, name, namespace_id)
    return pin_at(txn, changes, tip)


def unpin_chain(txn: Txn, changes: Changes, tip: bytes, chain_id: bytes | None) -> int:
    """Takes back chain ``chain_id``'s pin at ``tip`` (None: the legacy pin
    there); the block's own pin goes only when no other chain's pin is
    made there. Returns how many blocks stopped being pinned."""
    if chain_id is not None:
        txn.delete(INFO, PIN_BY_PREFIX + tip + chain_id)
    if holders(txn, tip):
        return 0
    return unpin_at(txn, changes, tip)


def root_stored_ns(txn: Txn, key: bytes) -> int | None:
    """When the first block of ``key``'s chain (its root, or the highest
    stored ancestor) was stored; None where ``key`` is not stored."""
    created = None
    for _current, meta in _upward(txn, key):
        if meta is not None:
            created = meta.created_ns
    return created


def drop(txn: Txn, changes: Changes, key: bytes) -> None:
    """As ``key`` itself is removed: its pin and ``pinby/`` records go (one
    read where it has no pin record)."""
    data = txn.get(INFO, PIN_PREFIX + key)
    if data is None:
        return
    try:
        # Counted before the delete: the view dies with the value, and a
        # recount the counter sets off must still see the record.
        changes.add_pinned(PinRecord.unpack(data), -1)
    except DamagedPin:
        pass  # never counted as whole: nothing to take back
    txn.delete(INFO, PIN_PREFIX + key)
    for name, _ in list(txn.scan(INFO, PIN_BY_PREFIX + key)):
        txn.delete(INFO, bytes(name))


def release_namespace(txn: Txn, namespace_id: bytes) -> int:
    """In the transaction that moves a namespace's epoch on (every move
    calls it): deletes every pin record of the namespace, its ``pinby/``
    records and its counter (blocks keyed at an older epoch are never
    served, so nothing holds them out of eviction), and records the move's
    time (``pinsince:``: no chain stored before it is pinned again).
    Returns pinned blocks released."""
    doomed = [bytes(name) for name, value in txn.scan(INFO, PIN_PREFIX) if bytes(value[:16]) == namespace_id]
    doomed_by = [bytes(name) for name, value in txn.scan(INFO, PIN_BY_PREFIX) if bytes(value) == namespace_id]
    for name in doomed + doomed_by:
        txn.delete(INFO, name)
    records.delete_checked(txn, PIN_COUNTS_PREFIX + namespace_id)
    records.put_checked(txn, PIN_SINCE_PREFIX + namespace_id, PIN_SINCE.pack(time.time_ns()))
    return len(doomed)


def pin_counts(txn: Txn) -> dict[bytes, tuple[int, int]]:
    """Pinned (blocks, stored bytes) per namespace; recounted from the pin
    records if a counter record is damaged."""
    out: dict[bytes, tuple[int, int]] = {}
    for name, value in records.scan_checked(txn, PIN_COUNTS_PREFIX, size=PIN_COUNTS.size):
        if value is None:
            return {ns: (c[0], c[1]) for ns, c in recount_pins(txn).items()}
        blocks, stored = PIN_COUNTS.unpack(value)
        out[name[len(PIN_COUNTS_PREFIX):]] = (blocks, stored)
    return out


def pinned_bytes(txn: Txn, changes: Changes | None = None) -> int:
    """Stored bytes pinned in all namespaces, as ``txn`` (and ``changes``,
    its counters not yet written) has them."""
    counts = {ns: stored for ns, (_blocks, stored) in pin_counts(txn).items()}
    if changes is not None:
        counts.update({ns: c[1] for ns, c in changes.pin_counts.items()})
    return sum(counts.values())


def own_pins(txn: Txn) -> Iterator[tuple[bytes, PinRecord]]:
    """(key, record) of every whole pin record with a pin made at it."""
    for name, value in txn.scan(INFO, PIN_PREFIX):
        try:
            record = PinRecord.unpack(value)
        except DamagedPin:
            continue
        if record.own:
            yield bytes(name)[len(PIN_PREFIX):], record


def rebuild(txn: Txn) -> int:
    """Rewrites every pin record and pinned counter from the pins made at
    stored blocks of their own namespace (``verify --fix``, ``compact``,
    after :func:`problems` found any); returns the pins kept."""
    tips = {key: record.namespace_id for key, record in own_pins(txn)
            if (meta := _parent_of(txn, key)[0]) is not None and meta.namespace_id == record.namespace_id}
    for name, value in list(txn.scan(INFO, PIN_BY_PREFIX)):  # a chain's pin stays where its block's does
        if len(name) != len(PIN_BY_PREFIX) + 64 or tips.get(bytes(name)[len(PIN_BY_PREFIX):-32]) != bytes(value):
            txn.delete(INFO, bytes(name))
    for name, _ in list(txn.scan(INFO, PIN_PREFIX)):
        txn.delete(INFO, bytes(name))
    for name, _ in list(txn.scan(INFO, PIN_COUNTS_PREFIX)):
        records.delete_checked(txn, bytes(name))
    changes = Changes(txn)
    for key in tips:
        pin_at(txn, changes, key)
    changes.commit()
    return len(tips)


def problems(txn: Txn) -> list[str]:
    """Where the pin records disagree with the blocks or with each other
    (empty when sound). Each line starts ``info record``: ``verify --fix``
    and ``compact`` then rebuild them (:func:`rebuild`)."""
    found: list[str] = []
    pinned: dict[bytes, PinRecord] = {}
    for name, data in txn.scan(INFO, PIN_PREFIX):
        key = bytes(name)[len(PIN_PREFIX):]
        try:
            pinned[key] = PinRecord.unpack(data)
        except DamagedPin as exc:
            found.append(f"info record 'pin/{key.hex()[:16]}' is damaged: {exc}")
    expected: dict[bytes, int] = {}
    for key, record in pinned.items():
        meta = _parent_of(txn, key)[0]
        if meta is None:
            found.append(f"info record 'pin/{key.hex()[:16]}' names a block that is not stored")
        elif (meta.namespace_id, meta.stored_bytes) != (record.namespace_id, record.stored_bytes):
            found.append(f"info record 'pin/{key.hex()[:16]}' disagrees with the block's metadata")
        for current, _meta in _upward(txn, key) if record.own else ():
            expected[current] = expected.get(current, 0) + 1
    found += _chain_pin_problems(txn, pinned)
    for key in sorted(set(pinned) | set(expected)):
        below = pinned[key].below if key in pinned else 0
        if below != expected.get(key, 0):
            found.append(f"info record 'pin/{key.hex()[:16]}' counts {below} pins at or below it, "
                         f"the pins made say {expected.get(key, 0)}")
    recounted = recount_pins(txn)
    for name, value in records.scan_checked(txn, PIN_COUNTS_PREFIX, size=PIN_COUNTS.size):
        namespace_id = name[len(PIN_COUNTS_PREFIX):]
        counted = recounted.pop(namespace_id, [0, 0])
        if value is not None and list(PIN_COUNTS.unpack(value)) != counted:
            found.append(f"info record 'pincount:{namespace_id.hex()}' disagrees with the pin records")
    found += [f"info record 'pincount:{ns.hex()}' is missing for {c[0]} pinned blocks" for ns, c in recounted.items()]
    if len(found) > LISTED_PROBLEMS:
        found = found[:LISTED_PROBLEMS] + [f"info record 'pin/...': {len(found) - LISTED_PROBLEMS} more pin problems"]
    return found


def _chain_pin_problems(txn: Txn, pinned: dict[bytes, PinRecord]) -> list[str]:
    """``pinby/`` records naming no block with a pin made at it (``pinned``:
    the whole pin records) in their namespace."""
    found = []
    for name, namespace_id in txn.scan(INFO, PIN_BY_PREFIX):
        tip = bytes(name)[len(PIN_BY_PREFIX):-32]
        held = pinned.get(tip)
        if len(name) != len(PIN_BY_PREFIX) + 64 or held is None or not held.own or bytes(namespace_id) != held.namespace_id:
            found.append(f"info record 'pinby/{tip.hex()[:16]}' names no pin made at a block of its namespace")
    return found
