"""Where in the change feed each namespace's epoch last moved on, so that a
follower resuming from a saved seq learns of a move it did not see.

An epoch move (``bump_epoch``, ``ucm-db invalidate``, an engine's
``reset_cache``, a higher epoch adopted from a remote or an archive) writes
no feed record: the blocks of the older epoch stay stored, only never
served. A follower polling the store reads each namespace's epoch every
poll and resyncs when it moves (:mod:`ucm_db.maintenance.event_replay`),
but one that resumes from a saved ``since_seq`` after a move had no epoch
to compare with: it kept the older epoch's blocks for ever. So each move
records the feed's next seq at that moment (the checked info record
``epochs:moved:<namespace id>``, 8 bytes little-endian).

Invariants:
    * Written in the transaction that changes a namespace's recorded epoch
      to another value, or renews a lost one (absent while the store holds
      the namespace's blocks: ``verify --fix``, ``invalidate``); never for a
      namespace's first epoch (no follower holds its blocks from before it).
    * A follower resuming from ``since_seq`` S was told every record below
      S. A move recorded at P >= S may be later than all it was told: it
      resyncs (``AllBlocksCleared``, then the inventory). P < S: it was told
      records written after the move, so it followed across the move (and
      resynced then, having read the epoch each poll), or began after it.
    * A resync that was not needed costs an inventory, never a block: a
      move record that is damaged counts as a move at every seq until
      ``verify --fix`` records it again at the feed's position then
      (:mod:`ucm_db.index.feed_audit` names it). A store from before this
      record knows no move (the follower's old behaviour).
"""

from __future__ import annotations

from collections.abc import Container

from ucm_db.engines.base import Txn
from ucm_db.index import changefeed, records

MOVED_PREFIX = b"epochs:moved:"
_SEQ_BYTES = 8


def record(txn: Txn, namespace_id: bytes) -> None:
    """Records that the namespace's epoch moves on in ``txn``, at the
    feed's next seq (module invariants)."""
    next_seq = changefeed.position(txn)[0]
    records.put_checked(txn, MOVED_PREFIX + bytes(namespace_id), next_seq.to_bytes(_SEQ_BYTES, "little"))


def moved_since(txn: Txn, seq: int, namespaces: Container[bytes] | None) -> bool:
    """Whether an epoch of ``namespaces`` (every namespace: None) moved on
    at or after feed seq ``seq`` (a damaged record: yes)."""
    return any((namespaces is None or namespace_id in namespaces) and (at is None or at >= seq)
               for namespace_id, at in _moves(txn))


def problems(txn: Txn) -> list[str]:
    """One line per damaged move record (``verify``; read-only)."""
    return [f"epoch move record of namespace {namespace_id.hex()[:16]} is damaged: every follower resumed from a "
            "saved seq resyncs until `ucm-db verify --fix` records it again" for namespace_id in _damaged(txn)]


def repair(txn: Txn) -> int:
    """Records every damaged move again at the feed's next seq (a follower
    resumed before it resyncs once); returns how many."""
    damaged = _damaged(txn)
    for namespace_id in damaged:
        record(txn, namespace_id)
    return len(damaged)


def _damaged(txn: Txn) -> list[bytes]:
    return [namespace_id for namespace_id, at in _moves(txn) if at is None]


def _moves(txn: Txn) -> list[tuple[bytes, int | None]]:
    """``(namespace id, feed seq of its last move)`` of every move recorded
    (None: the record is damaged)."""
    return [(name[len(MOVED_PREFIX):], None if value is None else int.from_bytes(value, "little"))
            for name, value in records.scan_checked(txn, MOVED_PREFIX, size=_SEQ_BYTES)]
