"""The serving index's reads: presence, prefix counts, blocks, metadata and
counters of the local block index (the table layout and invariants are in
:mod:`ucm_db.index.local`).

:class:`IndexReader` needs only the engine: it is built alone over any
engine holding the index's tables.

Invariants:
    * Every method is one read transaction of the engine: it sees one
      snapshot and writes nothing.
    * A block stored under another namespace than the one asked for reads
      as absent; a damaged record reads as absent (presence) or is
      recounted from the metadata (counters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Optional, TypeVar

from ucm_db.errors import ConfigError
from ucm_db.index import damage, descriptions, namespace_guard, records
from ucm_db.index.accounting import NS_COUNTS, NS_COUNTS_PREFIX, NS_DESC_PREFIX, Totals, parse_description, recount
from ucm_db.engines.base import Buffer, Engine, Txn
from ucm_db.index.entries import META, BlockMeta, body_of, plausible_meta

#: A whole ``meta`` record's length (one of another length is damaged: a miss).
_META_BYTES = META.size
#: The quarantine reason of a payload read whose ``meta`` record is damaged.
DAMAGED_RECORD = "damaged metadata record"
#: Reason a read files for a block whose ``meta`` record is whole but whose payload is gone.
PAYLOAD_MISSING = "payload missing"

T = TypeVar("T")
#: ``take_chunk(start, stored, heads, metas) -> positions not used`` (:meth:`IndexReader.with_blocks`).
TakeChunk = Callable[[int, list[Any], list[Any], Optional[list[Any]]], Sequence[int]]
logger = logging.getLogger("ucm_db")


class IndexReader:
    """The reads of the local block index over ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.engine.read(lambda txn: [txn.get("meta", k) is not None for k in keys])

    def present_for_put(self, keys: Sequence[bytes], namespace_desc: tuple[bytes, bytes]) -> list[bool]:
        """Whether each key is stored, for a put into the namespace
        ``namespace_desc`` (its id and JSON description); a damaged record
        is not (the put replaces it).

        Raises:
            ForeignNamespaceError: a key is stored under another namespace
                (:mod:`ucm_db.index.namespace_guard`).
        """
        namespace_id = namespace_desc[0]

        def run(txn: Txn) -> list[bool]:
            present = []
            damaged = False
            for key in keys:
                meta = txn.get("meta", key)
                # A length and 16 bytes compared on the put's hot path. A damaged
                # record (wrong length; impossible sizes under other namespace
                # bytes) reads as absent, and so does every key after it (its
                # descendants): the put quarantines it with its descendants and
                # stores them all again.
                whole = meta is not None and len(meta) == META.size and not damaged
                if meta is not None and whole and meta[:16] != namespace_id:
                    if namespace_guard.is_foreign(meta, namespace_id):
                        namespace_guard.require_same(txn, meta, namespace_id, key, "block", description=namespace_desc[1])
                    whole = False
                damaged = damaged or (meta is not None and not whole)
                present.append(whole)
            return present
        return self.engine.read(run)

    def iterate(self) -> Iterator[bytes]:
        return iter(self.engine.read(lambda txn: [k for k, _ in txn.scan("meta")]))

    def read_blocks(self, keys: Sequence[bytes], visit: Callable[[int, memoryview, memoryview], T]) -> list[T | None]:
        """Runs ``visit(i, head, body)`` inside one read transaction for each
        key present; ``None`` where absent. The views are valid only during
        visit. A block whose head is missing is visited with an empty head
        (the codec then finds it corrupt)."""
        def run(blocks: list[tuple[memoryview, memoryview] | None]) -> list[T | None]:
            return [None if b is None else visit(i, b[0], b[1]) for i, b in enumerate(blocks)]
        return self.with_blocks(keys, run)

    def with_blocks(
        self, keys: Sequence[bytes], fn: Callable[[list[tuple[memoryview, memoryview] | None]], T],
        *, namespace_id: bytes | None = None, take: Callable[[int, memoryview, memoryview], bool] | None = None,
        take_chunk: TakeChunk | None = None, chunk_keys: int = 128, damaged: list[tuple[bytes, str]] | None = None,
    ) -> T:
        """Calls ``fn`` with every key's ``(head, body)`` (None where absent,
        or, given ``namespace_id``, stored under another namespace) inside
        one read transaction, and returns its result.

        The views stay valid until ``fn`` returns, from any thread: ``fn`` may
        hand them to worker threads (parallel decode without copying the
        stored bytes out first) as long as it waits for them.

        With ``take``, each block present is first offered to
        ``take(i, head, body)`` as it is read; one it returns True for was
        used up there (its views are not kept) and is None in ``fn``'s list.

        With ``take_chunk`` (a batch's load path: no Python call per block),
        the keys are read ``chunk_keys`` at a time and each chunk's raw
        values are offered first: ``take_chunk(start, stored, heads, metas)``
        gets the chunk's ``blocks``, ``heads`` and (given ``namespace_id``,
        else None) ``meta`` values, None where absent, and returns the
        positions in the chunk it did not use up; only those go on as above
        (namespace check, ``take``, ``fn``'s list), and the chunk's views
        are dropped before the next chunk is read.

        Given ``namespace_id`` and ``damaged`` (a read's corrupt blocks), each
        payload whose ``meta`` record is damaged (wrong length or impossible
        sizes: a miss, like one of another namespace) is appended as ``(key,
        DAMAGED_RECORD)``, and each block of the namespace whose payload is
        gone as ``(key, PAYLOAD_MISSING)``: the caller quarantines them (the
        prefix invariant is broken under them: a lookup may count past the
        hole).
        """
        def offer(txn: Txn, i: int, key: bytes, stored: Buffer | None, blocks: list[tuple[memoryview, memoryview] | None]) -> None:
            if stored is None:
                if damaged is not None and namespace_id is not None:
                    meta = txn.get("meta", key)  # a miss's one extra read: a record whose payload was lost is damage
                    if meta is not None:
                        plausible = plausible_meta(meta)
                        if not plausible or in_namespace(meta, namespace_id):
                            damaged.append((key, PAYLOAD_MISSING if plausible else DAMAGED_RECORD))
                return
            if namespace_id is not None:
                meta = txn.get("meta", key)
                if meta is None:
                    return
                plausible = plausible_meta(meta)
                if not plausible or not in_namespace(meta, namespace_id):
                    if damaged is not None and not plausible:
                        damaged.append((key, DAMAGED_RECORD))
                    return
            head = memoryview(txn.get("heads", key) or b"")
            body = body_of(head, memoryview(stored))
            if take is None or not take(i, head, body):
                blocks[i] = (head, body)

        def offer_chunk(txn: Txn, start: int, blocks: list[tuple[memoryview, memoryview] | None]) -> None:
            # The chunk's views are this call's locals: gone before the next
            # chunk is read, so a large read leaves the collector no work.
            assert take_chunk is not None
            chunk = keys[start : start + chunk_keys]
            stored = txn.get_many("blocks", chunk)
            left = take_chunk(start, stored, txn.get_many("heads", chunk),
                              None if namespace_id is None else txn.get_many("meta", chunk))
            for j in left:
                offer(txn, start + j, chunk[j], stored[j], blocks)

        def run(txn: Txn) -> T:
            blocks: list[tuple[memoryview, memoryview] | None] = [None] * len(keys)
            if take_chunk is None:
                for i, key in enumerate(keys):
                    offer(txn, i, key, txn.get("blocks", key), blocks)
                return fn(blocks)
            for start in range(0, len(keys), chunk_keys):
                offer_chunk(txn, start, blocks)
            return fn(blocks)
        return self.engine.read(run)

    def read_blobs(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Blocks as joined blobs (head + body), for remote objects and archives."""
        return self.read_blocks(keys, lambda _i, head, body: b"".join([head, body]))

    def count_prefix(self, keys: Sequence[bytes], *, namespace_id: bytes | None = None) -> int:
        """Number of leading keys present (given ``namespace_id``: present
        under that namespace): a binary search (prefix invariant). Given
        ``namespace_id``, the first key is read too (one more read): a
        chain that older code let continue under another namespace is then
        0 for that namespace, not over-claimed."""
        def run(txn: Txn) -> int:
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) // 2
                if in_namespace(txn.get("meta", keys[mid]), namespace_id):
                    lo = mid + 1
                else:
                    hi = mid
            if lo > 1 and namespace_id is not None and not in_namespace(txn.get("meta", keys[0]), namespace_id):
                return 0  # lo == 1: keys[0] was the search's last hit
            return lo
        return self.engine.read(run)

    def with_snapshot(self, fn: Callable[[SnapshotPresence], T], *, namespace_id: bytes | None = None) -> T:
        """Calls ``fn(presence)`` inside one read transaction and returns its
        result: many chains answered from one snapshot
        (:class:`SnapshotPresence`, valid only during the call)."""
        return self.engine.read(lambda txn: fn(SnapshotPresence(txn, namespace_id)))

    def metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        return self.engine.read(lambda txn: [_meta_or_none(txn.get("meta", k)) for k in keys])

    def totals(self) -> Totals:
        """The store's totals (recounted from the metadata if the record
        is damaged; ``verify --fix`` rewrites it)."""
        return self.engine.read(Totals.read_or_recompute)

    def namespace_counts(self) -> dict[bytes, tuple[int, int, int, int]]:
        """(blocks, raw bytes, stored bytes, last use ns) per namespace id;
        recounted from the metadata if any record is damaged."""
        def run(txn: Txn) -> dict[bytes, tuple[int, int, int, int]]:
            out: dict[bytes, tuple[int, int, int, int]] = {}
            for name, value in records.scan_checked(txn, NS_COUNTS_PREFIX, size=NS_COUNTS.size):
                if value is None:
                    logger.warning("ucm-db: info record %r is damaged; recounting namespaces from the metadata", name)
                    return {ns: tuple(c) for ns, c in recount(txn)[1].items()}  # type: ignore[misc]
                out[name[len(NS_COUNTS_PREFIX):]] = NS_COUNTS.unpack(value)
            return out
        return self.engine.read(run)

    def namespace_descriptions(self) -> dict[bytes, dict[str, Any]]:
        """The recorded description of each namespace id; a damaged one
        reads as ``{"damaged": reason}``."""
        def run(txn: Txn) -> dict[bytes, dict[str, Any]]:
            out: dict[bytes, dict[str, Any]] = {}
            for name, value in records.scan_checked(txn, NS_DESC_PREFIX):
                if not descriptions.is_placeholder(value):  # a description verify --fix could not rebuild: undescribed
                    out[name[len(NS_DESC_PREFIX):]] = parse_description(value)
            return out
        return self.engine.read(run)

    def info_get(self, name: bytes) -> bytes | None:
        return self.engine.read(lambda txn: _bytes_or_none(txn.get("info", name)))


class SnapshotPresence:
    """Presence in one read transaction, under ``namespace_id`` if given
    (:meth:`IndexReader.with_snapshot`)."""

    __slots__ = ("_txn", "_namespace_id")

    def __init__(self, txn: Txn, namespace_id: bytes | None) -> None:
        self._txn = txn
        self._namespace_id = namespace_id

    def count(self, keys: Sequence[bytes]) -> int:
        """:meth:`IndexReader.count_prefix` in this snapshot (:func:`count_in`)."""
        return count_in(self._txn, keys, self._namespace_id)

    def present(self, keys: Sequence[bytes], *, derived: bool = False) -> list[bool]:
        """Whether each key is stored (one batch of reads). ``derived``:
        the keys were made by ucm-db itself (e.g. ``unit_keys_of``: 32-byte
        bytes by construction), so they are not checked one by one; a
        caller's keys always are."""
        if not derived:
            for key in keys:
                if type(key) is not bytes or len(key) != 32:
                    require_key(key)
        namespace_id = self._namespace_id
        metas = self._txn.get_many("meta", keys)
        if namespace_id is None:
            return [meta is not None for meta in metas]
        return [meta is not None and len(meta) == _META_BYTES and meta[:16] == namespace_id for meta in metas]

    def lookup(self, _namespace: object, keys: Sequence[bytes]) -> int:
        """:meth:`count`, as :func:`ucm_db.keys.units.stored_prefix` asks a store."""
        return count_in(self._txn, keys, self._namespace_id)


def count_in(txn: Txn, keys: Sequence[bytes], namespace_id: bytes | None) -> int:
    """Leading ``keys`` present (under ``namespace_id``, if given) in
    ``txn``: :meth:`IndexReader.count_prefix`'s answer, the last key and the
    first read before the binary search (a chain stored whole, or not at
    all, costs two reads). Only the keys read are checked: a malformed one
    is a ConfigError."""
    get = txn.get
    n = len(keys)
    # A list's own item read: BlockKeys' __getitem__ (slices that keep their
    # parent) is Python code, a third of a probe's cost.
    key_at: Callable[[int], bytes] = partial(list.__getitem__, keys) if isinstance(keys, list) else keys.__getitem__

    def present(i: int) -> bool:
        key = key_at(i)
        if type(key) is not bytes or len(key) != 32:
            require_key(key)
        meta = get("meta", key)
        return meta is not None and len(meta) == _META_BYTES and (namespace_id is None or meta[:16] == namespace_id)

    if n == 0 or not present(0):
        return 0
    if n == 1 or present(n - 1):
        return n
    lo, hi = 1, n - 1  # keys[0] present, keys[n - 1] not: the count is in [1, n - 1]
    while lo < hi:
        mid = (lo + hi) // 2
        if present(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def require_key(key: object) -> None:
    """Refuses anything but a 32-byte bytes-like key (a ConfigError)."""
    if isinstance(key, (bytearray, memoryview)) and len(key) == 32:
        return
    got = f"one of {len(key)} bytes" if isinstance(key, (bytes, bytearray, memoryview)) else f"a {type(key).__name__}"
    raise ConfigError(f"block keys are 32-byte bytes objects, got {got}", hint="use Namespace.block_keys")


def in_namespace(meta: Buffer | None, namespace_id: bytes | None) -> bool:
    """Whether a ``meta`` record exists, has a record's length (one that
    has not is damaged: a miss) and, given ``namespace_id``, names that
    namespace (its first 16 bytes)."""
    if meta is None or len(meta) != _META_BYTES:
        return False
    return namespace_id is None or bytes(meta[:16]) == namespace_id


def _meta_or_none(data: Buffer | None) -> BlockMeta | None:
    return damage.meta_or_none(data)


def _bytes_or_none(data: Buffer | None) -> bytes | None:
    return None if data is None else bytes(data)
