"""What an upload batch takes from the queue: every queued ancestor of its
blocks before them (:class:`BatchPlanner`), read as :data:`Item` values.

The upload queue is read in key order (:meth:`~ucm_db.index.local.LocalTier.pending_uploads`,
``BATCH_KEYS`` at a time), and keys are hashes: a queued block's queued
parent is rarely among them. Taking them as they came sent the deeper
blocks of a backlog before their ancestors, for as long as the backlog
lasted: objects under an absent parent, which ``gc`` must take for uploads
in flight (it held the namespace) and other nodes' lookups for a broken
chain. A plan adds the queued ancestors of the keys it is given, then takes
the shallowest blocks up to the batch's bounds: by depth, the blocks taken
hold every queued ancestor of theirs.

Invariants:
    * A batch never holds a block without its queued ancestors (a block
      uploaded by another process meanwhile may go again: objects are
      immutable, a repeat is harmless).
    * The walk reads only the local tier (two read transactions per level
      of ancestry); what a plan walked and left queued is remembered
      (:data:`MAX_LEFT` blocks at most) and not walked again by the next
      plans: the set left stays closed upward, since only its shallowest
      blocks are taken. So a deep backlog is walked about once, not once
      per batch. A plan whose blocks have a queued parent it did not take
      (an ancestor deleted and put again since it was remembered: queued
      anew) forgets what it remembered and walks again, once (audit:
      tests/remote/test_audit_uploads_plan_memory.py).
    * A plan's blocks are checked queued and stored just before it returns;
      a row whose block is gone is returned apart (the batch drops it).
    * Every blob read for an upload (:func:`read_items`: a batch's, an
      ancestor's re-upload) is verified against its key first (xxh3 over
      the blob, :func:`ucm_db.codec.verify`): a damaged one is quarantined
      locally, with its descendants and their queue rows, and neither it
      nor a descendant in the same read is sent (review:
      tests/test_review_engines_rocksdb_upload.py).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass

from ucm_db import codec
from ucm_db.errors import CorruptBlockError
from ucm_db.index.entries import BlockMeta
from ucm_db.index.local import LocalTier

logger = logging.getLogger("ucm_db")
#: Queued blocks a planner remembers between plans (past it, it forgets them all).
MAX_LEFT = 1 << 16

#: ``(key, parent, namespace id, depth, stored blob)``: what an upload sends.
Item = tuple[bytes, bytes | None, bytes, int, bytes]


@dataclass(frozen=True, slots=True)
class Repair:
    """What :meth:`ucm_db.remote.ancestry.AncestorRepair.before_batch`
    did: the batch's keys that wait for a later batch (an ancestor's check
    or upload failed) and why, and those never to upload (their parent
    chain meets a retracted block, or one another writer put back first);
    ``sent``: the ancestors it uploaded again (or found gone meanwhile)."""

    held_back: frozenset[bytes]
    errors: list[str]
    dropped: frozenset[bytes] = frozenset()
    sent: frozenset[bytes] = frozenset()
    #: Of ``held_back``, those below a block a provisional put holds (waiting for its settle, not a failure).
    waiting: frozenset[bytes] = frozenset()


class BatchPlanner:
    """Plans the upload batches of one uploader (one at a time)."""

    def __init__(self, local: LocalTier) -> None:
        self.local = local
        self._left: dict[bytes, tuple[int, int]] = {}  # queued, walked, not taken: key -> (depth, stored bytes)

    def plan(self, queued: Sequence[bytes], *, max_keys: int, max_bytes: int,
             ) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
        """``queued`` and their queued ancestors, shallowest first, up to
        ``max_keys`` blocks and ``max_bytes`` stored bytes (at least one);
        returns ``(keys to upload, keys no longer stored, created_ns of each
        block to upload)``: which rows the batch may remove."""
        return self._plan(queued, max_keys, max_bytes, again=False)

    def _plan(self, queued: Sequence[bytes], max_keys: int, max_bytes: int, *, again: bool,
              ) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
        candidates = dict(self._left)
        metas = self._walk([key for key in queued if key not in candidates], candidates)
        gone = [key for key, meta in metas.items() if meta is None]
        candidates.update({key: (meta.depth, meta.stored_bytes) for key, meta in metas.items() if meta is not None})
        while True:  # until a block still queued is taken, or none is left
            chosen = _shallowest(candidates, max_keys, max_bytes)
            for key in chosen:
                del candidates[key]
            still = self.local.uploads.queued(chosen)  # another process's write-through (or a delete) took some
            chosen = [key for key in chosen if key in still]
            if chosen or not candidates:
                break
        self._left = candidates if len(candidates) <= MAX_LEFT else {}
        now = self.local.metas(chosen)
        parents = {meta.parent for meta in now if meta is not None and meta.parent is not None}.difference(chosen)
        if not again and parents and self.local.uploads.queued(parents):  # queued again since remembered: walk anew
            self._left = {}
            return self._plan([*queued, *chosen], max_keys, max_bytes, again=True)
        gone += [key for key, meta in zip(chosen, now) if meta is None]
        stored_ns = {key: meta.created_ns for key, meta in zip(chosen, now) if meta is not None}
        return [key for key in chosen if key in stored_ns], gone, stored_ns

    def _walk(self, keys: list[bytes], known: dict[bytes, tuple[int, int]]) -> dict[bytes, BlockMeta | None]:
        """The metas of ``keys`` and of their queued ancestors, up to the
        first ancestor not queued or in ``known`` (those are not read)."""
        metas: dict[bytes, BlockMeta | None] = {}
        frontier = keys
        while frontier:
            metas.update(zip(frontier, self.local.metas(frontier)))
            parents = {m.parent for m in (metas[k] for k in frontier)
                       if m is not None and m.parent is not None and m.parent not in metas and m.parent not in known}
            frontier = sorted(self.local.uploads.queued(parents))
        return metas


def _shallowest(candidates: dict[bytes, tuple[int, int]], max_keys: int, max_bytes: int) -> list[bytes]:
    """The shallowest of ``candidates`` (key -> depth, stored bytes), up to
    ``max_keys`` blocks and ``max_bytes`` stored bytes (at least one)."""
    chosen: list[bytes] = []
    total_bytes = 0
    for _depth, key, stored_bytes in heapq.nsmallest(max_keys, ((d, k, b) for k, (d, b) in candidates.items())):
        if chosen and total_bytes + stored_bytes > max_bytes:
            break
        chosen.append(key)
        total_bytes += stored_bytes
    return chosen


def read_items(local: LocalTier, keys: Sequence[bytes]) -> list[Item | None]:
    """What an upload of each key sends; None for a block no longer stored,
    or damaged (:func:`checked`)."""
    metas = local.metas(keys)
    blobs = local.read_blobs(keys)
    return checked(local, [None if meta is None or blob is None else (key, meta.parent, meta.namespace_id, meta.depth, blob)
                           for key, meta, blob in zip(keys, metas, blobs)])


def checked(local: LocalTier, items: list[Item | None]) -> list[Item | None]:
    """``items`` with each damaged blob (its checksum or owning key fails
    :func:`ucm_db.codec.verify`) and its descendants among them read as None
    (module invariants): a damaged block is quarantined as a read does
    (:mod:`ucm_db.index.damage`: its subtree and their queue rows go with it),
    never uploaded. A failed quarantine (a full disk) is logged; the batch
    drops the row all the same, and a local read quarantines the block later."""
    damaged: set[bytes] = set()
    for i in sorted(range(len(items)), key=lambda i: _depth(items[i])):
        item = items[i]
        if item is None:
            continue
        key, parent = item[0], item[1]
        if parent is not None and parent in damaged:
            damaged.add(key)
            items[i] = None
            continue
        try:
            codec.verify(item[4], key)
        except CorruptBlockError as exc:
            damaged.add(key)
            items[i] = None
            quarantine(local, key, f"its upload's check failed: {exc}")
    return items


def quarantine(local: LocalTier, key: bytes, reason: str) -> None:
    """Quarantines ``key`` (with its descendants) as a read does; a failure is logged, not raised."""
    logger.warning("ucm-db: block %s is damaged (%s): not uploaded, quarantined", key.hex()[:16], reason)
    try:
        local.quarantine(key, reason, lambda head, body: not codec.readable(head, body, key))
    except Exception as exc:  # noqa: BLE001 - the block is not uploaded either way
        logger.warning("ucm-db: quarantining block %s failed: %s", key.hex()[:16], exc)


def _depth(item: Item | None) -> int:
    return -1 if item is None else item[3]


def under(work: Sequence[Item], absent: dict[bytes, BlockMeta], marked: Container[bytes]) -> frozenset[bytes]:
    """Keys of ``work`` whose parent chain (through ``absent``: ancestors
    found absent from the remote) meets a key of ``marked`` (a failed check
    or upload; a retracted block): batch roots over one, and their
    descendants in the batch (:mod:`ucm_db.remote.ancestry`)."""
    if not marked:
        return frozenset()
    in_batch = {item[0] for item in work}
    held: set[bytes] = set()
    for key, parent, *_ in work:
        if parent is None or parent in in_batch:
            continue
        chain: bytes | None = parent
        while chain is not None and chain not in marked and chain in absent:
            chain = absent[chain].parent
        if chain is not None and chain in marked:
            held.add(key)
    children: dict[bytes, list[bytes]] = {}
    for key, parent, *_ in work:
        if parent is not None:
            children.setdefault(parent, []).append(key)
    todo = list(held)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in held:
                held.add(child)
                todo.append(child)
    return frozenset(held)
