"""The local block index: blocks, metadata, LRU order and accounting.

:class:`LocalTier` keeps encoded blocks in an :class:`~ucm_db.tiers.base.Engine`
together with everything needed to manage them, all updated in the same
transaction as the payload:

* ``heads``:    key -> the block's head (sealed header + frame table)
* ``blocks``:   key -> the block's body (stored frames). Blocks written
  before store format 3 hold head and body joined; :func:`body_of` tells
  them apart by length, so such blocks read without being rewritten.
* ``meta``:     key -> :class:`BlockMeta` (namespace, parent, depth, sizes,
  access time, hits)
* ``lru``:      access_ns (BE) | inverted depth (BE) | key -> b"" (eviction order)
* ``children``: parent | child -> b"" (cascading deletes)
* ``info``:     totals, per-namespace counters and descriptions, settings
* ``quarantine``: key -> JSON record of a block found corrupt
* ``uploads``:  key -> b"" (durable remote upload queue)

Invariants:
    * Prefix invariant: a stored block's parent is stored. Puts refuse a
      block whose parent is missing; deleting, evicting or quarantining a
      block removes its descendants in the same transaction. Presence along a
      chain is therefore monotone and lookup is a binary search.
    * Accounting: ``info/totals`` equals the sum over ``meta`` at every
      commit (checked by :meth:`LocalTier.check`).
    * Eviction order: least recently used first; on equal access time the
      deeper block first, so chain tails go before their ancestors.
    * Touching a block touches its ancestors.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ucm_db import codec
from ucm_db.crashpoints import crashpoint
from ucm_db.errors import MissingAncestorError, StoreFullError
from ucm_db.tiers.base import Buffer, Engine, Tier, TierCapabilities, Txn

T = TypeVar("T")
NO_PARENT = bytes(32)
_META = struct.Struct("<16s32sIQQQQI")
_TOTALS = struct.Struct("<7Q")
_NS_COUNTS = struct.Struct("<4Q")
_LRU_PREFIX = struct.Struct(">QI")
_MAX_DEPTH = 0xFFFFFFFF
TOTALS_KEY = b"totals"
NS_COUNTS_PREFIX = b"nscount:"
NS_DESC_PREFIX = b"nsdesc:"


@dataclass(slots=True)
class BlockMeta:
    """Per-block metadata kept beside the payload."""

    namespace_id: bytes
    parent: bytes | None
    depth: int
    raw_bytes: int
    stored_bytes: int
    created_ns: int
    access_ns: int
    hits: int

    def pack(self) -> bytes:
        return _META.pack(
            self.namespace_id, self.parent or NO_PARENT, self.depth, self.raw_bytes,
            self.stored_bytes, self.created_ns, self.access_ns, self.hits,
        )

    @classmethod
    def unpack(cls, data: Buffer) -> BlockMeta:
        ns, parent, depth, raw, stored, created, access, hits = _META.unpack(data)
        return cls(ns, None if parent == NO_PARENT else parent, depth, raw, stored, created, access, hits)


@dataclass(slots=True)
class Totals:
    """Store-wide counters (persisted in ``info/totals``)."""

    blocks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    evictions: int = 0
    quarantined: int = 0
    hits: int = 0
    misses: int = 0

    @classmethod
    def read(cls, txn: Txn) -> Totals:
        data = txn.get("info", TOTALS_KEY)
        return cls(*_TOTALS.unpack(data)) if data is not None else cls()

    def write(self, txn: Txn) -> None:
        txn.put("info", TOTALS_KEY, _TOTALS.pack(
            self.blocks, self.raw_bytes, self.stored_bytes, self.evictions, self.quarantined, self.hits, self.misses,
        ))


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block to put: key, parent (None for a chain root), head and body."""

    key: bytes
    parent: bytes | None
    head: Buffer
    body: Buffer
    raw_bytes: int
    namespace_id: bytes

    @classmethod
    def of_blob(cls, key: bytes, parent: bytes | None, blob: Buffer, raw_bytes: int, namespace_id: bytes) -> BlockEntry:
        """An entry from a joined blob, split without copying.

        Raises:
            CorruptBlockError: the blob's header is unreadable.
        """
        head, body = codec.split(blob)
        return cls(key, parent, head, body, raw_bytes, namespace_id)

    @property
    def stored_bytes(self) -> int:
        return len(self.head) + len(self.body)


@dataclass(slots=True)
class PutResult:
    stored: int = 0
    already_present: int = 0
    evicted: int = 0


@dataclass(slots=True)
class PendingActivity:
    """Reader activity folded into the next write (touches, hits, misses)."""

    touched: dict[bytes, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def empty(self) -> bool:
        return not self.touched and not self.hits and not self.misses


def lru_key(access_ns: int, depth: int, key: bytes) -> bytes:
    return _LRU_PREFIX.pack(access_ns, _MAX_DEPTH - depth) + key


class _Changes:
    """Counter deltas accumulated inside one write transaction."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn
        self.totals = Totals.read(txn)
        self.ns_counts: dict[bytes, list[int]] = {}

    def ns(self, namespace_id: bytes) -> list[int]:
        counts = self.ns_counts.get(namespace_id)
        if counts is None:
            data = self.txn.get("info", NS_COUNTS_PREFIX + namespace_id)
            counts = list(_NS_COUNTS.unpack(data)) if data is not None else [0, 0, 0, 0]
            self.ns_counts[namespace_id] = counts
        return counts

    def add(self, meta: BlockMeta, sign: int) -> None:
        self.totals.blocks += sign
        self.totals.raw_bytes += sign * meta.raw_bytes
        self.totals.stored_bytes += sign * meta.stored_bytes
        counts = self.ns(meta.namespace_id)
        counts[0] += sign
        counts[1] += sign * meta.raw_bytes
        counts[2] += sign * meta.stored_bytes
        if sign > 0:
            counts[3] = max(counts[3], meta.access_ns)

    def commit(self) -> None:
        self.totals.write(self.txn)
        for namespace_id, counts in self.ns_counts.items():
            self.txn.put("info", NS_COUNTS_PREFIX + namespace_id, _NS_COUNTS.pack(*counts))


class LocalTier(Tier):
    """Block index over a transactional engine (see module invariants)."""

    def __init__(self, engine: Engine, *, capacity_bytes: int) -> None:
        self.engine = engine
        self.capacity_bytes = capacity_bytes

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(
            persistent=self.engine.persistent, transactional=True,
            multi_process=self.engine.multi_process, sorted_iteration=True,
        )

    # -- Tier interface ----------------------------------------------------
    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.read_blobs(keys)

    def put_batch(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Stores raw (key, blob) pairs as chain roots of an anonymous namespace.

        Tier-level puts know no parents; the store uses :meth:`put_blocks`.
        """
        entries = [BlockEntry(k, None, b"", blob, len(blob), bytes(16)) for k, blob in items]
        self.put_blocks(entries)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.engine.read(lambda txn: [txn.get("meta", k) is not None for k in keys])

    def delete(self, keys: Sequence[bytes]) -> int:
        def run(txn: Txn) -> int:
            changes = _Changes(txn)
            removed = sum(self._remove_tree(txn, changes, k) for k in keys if txn.get("meta", k) is not None)
            changes.commit()
            return removed
        return self.engine.write(run)

    def iterate(self) -> Iterator[bytes]:
        return iter(self.engine.read(lambda txn: [k for k, _ in txn.scan("meta")]))

    def close(self) -> None:
        self.engine.close()

    # -- reads ---------------------------------------------------------------
    def read_blocks(self, keys: Sequence[bytes], visit: Callable[[int, memoryview, memoryview], T]) -> list[T | None]:
        """Runs ``visit(i, head, body)`` inside one read transaction for each
        key present; ``None`` where absent. The views are valid only during
        visit. A block whose head is missing is visited with an empty head
        (the codec then finds it corrupt)."""
        def run(blocks: list[tuple[memoryview, memoryview] | None]) -> list[T | None]:
            return [None if b is None else visit(i, b[0], b[1]) for i, b in enumerate(blocks)]
        return self.with_blocks(keys, run)

    def with_blocks(self, keys: Sequence[bytes], fn: Callable[[list[tuple[memoryview, memoryview] | None]], T]) -> T:
        """Calls ``fn`` with every key's ``(head, body)`` (None where absent)
        inside one read transaction, and returns its result.

        The views stay valid until ``fn`` returns, from any thread: ``fn`` may
        hand them to worker threads (parallel decode without copying the
        stored bytes out first) as long as it waits for them.
        """
        def run(txn: Txn) -> T:
            blocks: list[tuple[memoryview, memoryview] | None] = []
            for key in keys:
                stored = txn.get("blocks", key)
                if stored is None:
                    blocks.append(None)
                    continue
                head = memoryview(txn.get("heads", key) or b"")
                blocks.append((head, body_of(head, memoryview(stored))))
            return fn(blocks)
        return self.engine.read(run)

    def read_blobs(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Blocks as joined blobs (head + body), for remote objects and archives."""
        return self.read_blocks(keys, lambda _i, head, body: b"".join([head, body]))

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys present: a binary search (prefix invariant)."""
        def run(txn: Txn) -> int:
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) // 2
                if txn.get("meta", keys[mid]) is not None:
                    lo = mid + 1
                else:
                    hi = mid
            return lo
        return self.engine.read(run)

    def metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        return self.engine.read(lambda txn: [_meta_or_none(txn.get("meta", k)) for k in keys])

    def totals(self) -> Totals:
        return self.engine.read(Totals.read)

    def namespace_counts(self) -> dict[bytes, tuple[int, int, int, int]]:
        def run(txn: Txn) -> dict[bytes, tuple[int, int, int, int]]:
            return {k[len(NS_COUNTS_PREFIX):]: _NS_COUNTS.unpack(v) for k, v in txn.scan("info", NS_COUNTS_PREFIX)}
        return self.engine.read(run)

    def namespace_descriptions(self) -> dict[bytes, dict[str, Any]]:
        def run(txn: Txn) -> dict[bytes, dict[str, Any]]:
            return {k[len(NS_DESC_PREFIX):]: json.loads(bytes(v)) for k, v in txn.scan("info", NS_DESC_PREFIX)}
        return self.engine.read(run)

    def info_get(self, name: bytes) -> bytes | None:
        return self.engine.read(lambda txn: _bytes_or_none(txn.get("info", name)))

    def info_put(self, name: bytes, value: bytes) -> None:
        self.engine.write(lambda txn: txn.put("info", name, value))

    # -- writes ----------------------------------------------------------------
    def put_blocks(
        self,
        entries: Sequence[BlockEntry],
        *,
        namespace_desc: tuple[bytes, bytes] | None = None,
        enqueue_upload: bool = False,
        activity: PendingActivity | None = None,
    ) -> PutResult:
        """Atomically stores a batch, then evicts LRU blocks over capacity.

        Raises:
            MissingAncestorError: a block's parent is neither stored nor
                earlier in the batch (nothing is written).
            StoreFullError: the batch alone exceeds the capacity.
        """
        def run(txn: Txn) -> PutResult:
            changes = _Changes(txn)
            result = PutResult()
            now = time.time_ns()
            in_batch: set[bytes] = set()
            depths: dict[bytes, int] = {}
            if namespace_desc is not None and txn.get("info", NS_DESC_PREFIX + namespace_desc[0]) is None:
                txn.put("info", NS_DESC_PREFIX + namespace_desc[0], namespace_desc[1])
            for entry in entries:
                in_batch.add(entry.key)
                existing = txn.get("meta", entry.key)
                if existing is not None:
                    result.already_present += 1
                    depths[entry.key] = BlockMeta.unpack(existing).depth
                    continue
                depth = self._depth_of_parent(txn, entry, depths) + 1
                depths[entry.key] = depth
                meta = BlockMeta(entry.namespace_id, entry.parent, depth, entry.raw_bytes, entry.stored_bytes, now, now, 0)
                txn.put("heads", entry.key, entry.head)
                txn.put("blocks", entry.key, entry.body)
                crashpoint("local.after_payload_write")
                txn.put("meta", entry.key, meta.pack())
                txn.put("lru", lru_key(now, depth, entry.key), b"")
                if entry.parent is not None:
                    txn.put("children", entry.parent + entry.key, b"")
                if enqueue_upload:
                    txn.put("uploads", entry.key, entry.namespace_id)
                changes.add(meta, +1)
                result.stored += 1
            if activity is not None:
                self._apply_activity(txn, changes, activity)
            result.evicted = self._evict_over_capacity(txn, changes, protected=in_batch)
            changes.commit()
            crashpoint("local.before_commit")
            return result
        return self.engine.write(run)

    def _depth_of_parent(self, txn: Txn, entry: BlockEntry, depths: dict[bytes, int]) -> int:
        if entry.parent is None:
            return -1
        if entry.parent in depths:
            return depths[entry.parent]
        parent_meta = txn.get("meta", entry.parent)
        if parent_meta is None:
            raise MissingAncestorError(
                f"block {entry.key.hex()[:16]} has parent {entry.parent.hex()[:16]}, which is not stored"
            )
        return BlockMeta.unpack(parent_meta).depth

    def _evict_over_capacity(self, txn: Txn, changes: _Changes, *, protected: set[bytes]) -> int:
        evicted = 0
        while changes.totals.stored_bytes > self.capacity_bytes:
            victim = None
            for lru, _ in txn.scan("lru"):
                key = lru[_LRU_PREFIX.size:]
                if key not in protected:
                    victim = key
                    break
            if victim is None:
                raise StoreFullError(
                    f"batch needs {changes.totals.stored_bytes} bytes but capacity_bytes is {self.capacity_bytes}"
                )
            count = self._remove_tree(txn, changes, victim)
            evicted += count
            changes.totals.evictions += count
        return evicted

    def _remove_tree(self, txn: Txn, changes: _Changes, key: bytes) -> int:
        """Removes ``key`` and all its descendants; returns blocks removed."""
        stack = [key]
        removed = 0
        while stack:
            current = stack.pop()
            stack.extend(child[32:] for child, _ in list(txn.scan("children", current)))
            removed += self._remove_one(txn, changes, current)
        return removed

    def _remove_one(self, txn: Txn, changes: _Changes, key: bytes) -> int:
        data = txn.get("meta", key)
        if data is None:
            return 0
        meta = BlockMeta.unpack(data)
        txn.delete("meta", key)
        txn.delete("blocks", key)
        txn.delete("heads", key)
        txn.delete("lru", lru_key(meta.access_ns, meta.depth, key))
        txn.delete("uploads", key)
        for child, _ in list(txn.scan("children", key)):
            txn.delete("children", child)
        if meta.parent is not None:
            txn.delete("children", meta.parent + key)
        changes.add(meta, -1)
        return 1

    def apply_activity(self, activity: PendingActivity) -> None:
        """Writes pending touches and hit/miss counts in one transaction."""
        if activity.empty():
            return
        def run(txn: Txn) -> None:
            changes = _Changes(txn)
            self._apply_activity(txn, changes, activity)
            changes.commit()
        self.engine.write(run)

    def _apply_activity(self, txn: Txn, changes: _Changes, activity: PendingActivity) -> None:
        changes.totals.hits += activity.hits
        changes.totals.misses += activity.misses
        visited: set[bytes] = set()
        for key, access_ns in activity.touched.items():
            hit = True
            current: bytes | None = key
            while current is not None and current not in visited:
                visited.add(current)
                data = txn.get("meta", current)
                if data is None:
                    break
                meta = BlockMeta.unpack(data)
                if meta.access_ns < access_ns:
                    txn.delete("lru", lru_key(meta.access_ns, meta.depth, current))
                    txn.put("lru", lru_key(access_ns, meta.depth, current), b"")
                    meta.access_ns = access_ns
                meta.hits += int(hit)
                hit = False
                txn.put("meta", current, meta.pack())
                counts = changes.ns(meta.namespace_id)
                counts[3] = max(counts[3], access_ns)
                current = meta.parent

    def quarantine(self, key: bytes, reason: str, still_corrupt: Callable[[memoryview, memoryview], bool]) -> bool:
        """Moves a corrupt block (and its descendants) out of the store.

        ``still_corrupt(head, body)`` re-checks the block inside the write
        transaction, so a block another process has meanwhile replaced is
        left alone.
        """
        def run(txn: Txn) -> bool:
            stored = txn.get("blocks", key)
            data = txn.get("meta", key)
            if data is not None and stored is not None:
                head = memoryview(txn.get("heads", key) or b"")
                if not still_corrupt(head, body_of(head, memoryview(stored))):
                    return False
            meta = _meta_or_none(data)
            record = {
                "reason": reason, "time_ns": time.time_ns(),
                "namespace": meta.namespace_id.hex() if meta else None,
                "stored_bytes": meta.stored_bytes if meta else None,
            }
            changes = _Changes(txn)
            self._remove_tree(txn, changes, key)
            txn.put("quarantine", key, json.dumps(record).encode())
            changes.totals.quarantined += 1
            changes.commit()
            return True
        return self.engine.write(run)

    def quarantine_records(self) -> dict[bytes, dict[str, Any]]:
        return self.engine.read(lambda txn: {k: json.loads(bytes(v)) for k, v in txn.scan("quarantine")})

    # -- upload queue ------------------------------------------------------------
    def pending_uploads(self, limit: int | None = None) -> list[bytes]:
        def run(txn: Txn) -> list[bytes]:
            out = []
            for key, _ in txn.scan("uploads"):
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
            return out
        return self.engine.read(run)

    def mark_uploaded(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self.engine.write(lambda txn: [txn.delete("uploads", k) for k in keys])

    # -- checks ----------------------------------------------------------------
    def check(self) -> list[str]:
        """Consistency problems of the index (empty list when healthy)."""
        def run(txn: Txn) -> list[str]:
            problems: list[str] = []
            totals = Totals.read(txn)
            count = raw = stored = 0
            for key, data in txn.scan("meta"):
                meta = BlockMeta.unpack(data)
                count += 1
                raw += meta.raw_bytes
                stored += meta.stored_bytes
                stored_len = _len_or_none(txn.get("blocks", key))
                head_len = _len_or_none(txn.get("heads", key))
                if stored_len is None or head_len is None:
                    problems.append(f"block {key.hex()[:16]}: payload or head missing")
                elif meta.stored_bytes not in (stored_len, stored_len + head_len):
                    problems.append(f"block {key.hex()[:16]}: payload of wrong size")
                if meta.parent is not None and txn.get("meta", meta.parent) is None:
                    problems.append(f"block {key.hex()[:16]}: parent missing (prefix invariant broken)")
                if txn.get("lru", lru_key(meta.access_ns, meta.depth, key)) is None:
                    problems.append(f"block {key.hex()[:16]}: no LRU entry")
            for table in ("blocks", "heads"):
                for key, _ in txn.scan(table):
                    if txn.get("meta", key) is None:
                        problems.append(f"{table} entry {key.hex()[:16]} has no metadata (orphan)")
            if (count, raw, stored) != (totals.blocks, totals.raw_bytes, totals.stored_bytes):
                problems.append(f"totals {totals} disagree with metadata ({count}, {raw}, {stored})")
            return problems
        return self.engine.read(run)


def body_of(head: memoryview, stored: memoryview) -> memoryview:
    """The body within a ``blocks`` value: the value itself, or (a block
    written before format 3) what follows the head in it."""
    n = len(head)
    if n and len(stored) > n and stored[:n] == head:
        return stored[n:]
    return stored


def _len_or_none(data: Buffer | None) -> int | None:
    return None if data is None else len(data)


def _meta_or_none(data: Buffer | None) -> BlockMeta | None:
    return None if data is None else BlockMeta.unpack(data)


def _bytes_or_none(data: Buffer | None) -> bytes | None:
    return None if data is None else bytes(data)
