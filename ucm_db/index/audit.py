"""The local index's consistency check in sequential scans.

:meth:`LocalTier.check` and :meth:`LocalTier.drop_orphans` both ask how the
index tables agree with ``meta``. Asked one key at a time, that is five
random B-tree reads per block: on a store of 1M blocks about a minute of
Python, most of ``ucm-db compact``. :func:`audit` answers from one read
transaction of sorted scans instead:

* ``meta``, ``blocks`` and ``heads`` share their keys, so one merged walk
  over the three finds missing payloads and heads, wrong sizes and orphans.
* ``children`` is sorted by parent: walked beside ``meta`` it shows every
  child link whose parent is stored or not, and the depth each link's
  parent gives its child (its own plus one).
* The ``lru`` and ``children`` entries each block implies, and each
  block's depth as its parent's link gives it, are compared with the tables
  as order-free fingerprints (count and a sum of 64-bit hashes). Only where
  a fingerprint differs are the entries looked up one by one
  (:func:`lru_problems`, :func:`_parent_problems`), so a healthy store
  never pays for it.

Invariants:
    * ``audit(txn).problems`` names the same problems, in the same words, as
      checking every block by key would: payload or head missing, wrong
      size, parent missing, child link missing, a depth that is not its
      parent's plus one (every parent cycle has one: depths cannot fall by
      one at each step around a loop) or, for a first block, not 0, no LRU entry, ``blocks``/``heads``
      orphans, a damaged metadata record (whose sizes are then not summed). :func:`namespace_problems` compares the
      per-namespace sums with the counter records. A ``blocks`` entry left stuck by a quarantine
      (:mod:`ucm_db.index.damage`) is not an orphan.
    * ``audit(txn).suspect`` holds every table that may have entries whose
      block has no metadata (``uploads`` always: it is not walked here).
    * Memory is O(1) in the store's size beyond the problems found.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from ucm_db.index import records
from ucm_db.index.accounting import NS_COUNTS, NS_COUNTS_PREFIX
from ucm_db.engines.base import Buffer, Txn
from ucm_db.index.damage import is_stuck, meta_or_none
from ucm_db.codec import MAX_RAW_BYTES
from ucm_db.index.entries import MAX_STORED_BYTES, META, NO_PARENT, BlockMeta, DamagedMeta, lru_key

_MASK = (1 << 64) - 1
#: A block whose depth is not its parent's plus one: a parent cycle (each
#: has one) or altered metadata; pin walks stop there (:mod:`ucm_db.index.pins`).
DEPTH_PROBLEM = "depth is not its parent's plus one (a parent cycle or altered metadata)"
#: A first block (no parent) whose depth is not 0: altered metadata (``verify --fix`` rewrites it).
ROOT_DEPTH_PROBLEM = "depth of a first block is not 0 (altered metadata)"
_hash = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """An order-free summary of a set of keys (count, sum of 64-bit hashes
    mod 2**64): equal sets give equal fingerprints; different ones almost
    never do."""

    count: int
    hash_sum: int


@dataclass
class Audit:
    """What :func:`audit` found."""

    problems: list[str] = field(default_factory=list)
    suspect: set[str] = field(default_factory=lambda: {"uploads"})
    blocks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    #: (blocks, raw bytes, stored bytes) per namespace id, from the whole records.
    per_namespace: dict[bytes, list[int]] = field(default_factory=dict)


def audit(txn: Txn) -> Audit:
    """Checks the index against ``meta`` inside ``txn`` (module docstring)."""
    found = Audit()
    lru_expected = children_expected = children_count = depth_expected = 0
    links = _LinkWalk(txn.scan("children"))
    per_namespace = found.per_namespace
    for key, data, stored, head in _three_way(txn.scan("meta"), txn.scan("blocks"), txn.scan("heads")):
        if data is None:
            for table, value in (("blocks", stored), ("heads", head)):
                if value is not None and not (table == "blocks" and is_stuck(txn, key)):
                    found.problems.append(f"{table} entry {key.hex()[:16]} has no metadata (orphan)")
                    found.suspect.add(table)
            continue
        fields = META.unpack(data) if len(data) == META.size else None  # a tuple: 1M blocks
        if fields is not None and (fields[3] > MAX_RAW_BYTES or fields[4] > MAX_STORED_BYTES):
            fields = None
        links.up_to(key, None if fields is None else fields[2])
        if fields is None:
            found.problems.append(f"block {key.hex()[:16]}: {_damage(data)}")
            continue
        namespace_id, parent, depth, raw, size, _created, access_ns, _hits = fields
        found.blocks += 1
        found.raw_bytes += raw
        found.stored_bytes += size
        counts = per_namespace.setdefault(namespace_id, [0, 0, 0])
        counts[0] += 1
        counts[1] += raw
        counts[2] += size
        if stored is None or head is None:
            found.problems.append(f"block {key.hex()[:16]}: payload or head missing")
        elif size not in (len(stored), len(stored) + len(head)):
            found.problems.append(f"block {key.hex()[:16]}: payload of wrong size")
        lru_expected += _hash(lru_key(access_ns, depth, key))
        if parent == NO_PARENT and depth:
            found.problems.append(f"block {key.hex()[:16]}: {ROOT_DEPTH_PROBLEM} (depth {depth})")
        elif parent != NO_PARENT:
            children_expected += _hash(parent + key)
            depth_expected += _hash(parent + key + depth.to_bytes(8, "little"))
            children_count += 1
    links.up_to(None, None)
    depths_ok = links.depth_sum & _MASK == depth_expected & _MASK
    if links.fingerprint() == Fingerprint(children_count, children_expected & _MASK):
        # Every block's link is there, so the walk saw every block's parent.
        found.problems += [f"block {k.hex()[:16]}: parent missing (prefix invariant broken)" for k in sorted(links.orphaned)]
        children_ok = not links.orphaned
        if not depths_ok:
            found.problems += _parent_problems(txn, links=False)
    else:
        found.problems += _parent_problems(txn)
        children_ok = False
    if _fingerprint(k for k, _ in txn.scan("lru")) != Fingerprint(found.blocks, lru_expected & _MASK):
        found.suspect.add("lru")
        found.problems += lru_problems(txn)
    if not children_ok:
        found.suspect.add("children")
    return found


def namespace_problems(txn: Txn, found: Audit) -> list[str]:
    """Namespaces whose (whole) counter record disagrees with the sums
    ``found`` in the metadata: a block whose namespace id was altered shows
    here."""
    per_namespace = found.per_namespace
    problems = []
    recorded: dict[bytes, list[int]] = {}
    for name, value in records.scan_checked(txn, NS_COUNTS_PREFIX, size=NS_COUNTS.size):
        if value is not None:  # a damaged record is reported on its own
            recorded[name[len(NS_COUNTS_PREFIX):]] = list(NS_COUNTS.unpack(value)[:3])
        else:
            recorded[name[len(NS_COUNTS_PREFIX):]] = per_namespace.get(name[len(NS_COUNTS_PREFIX):], [0, 0, 0])
    for namespace_id in sorted(set(recorded) | set(per_namespace)):
        sums = per_namespace.get(namespace_id, [0, 0, 0])
        if recorded.get(namespace_id, [0, 0, 0]) != sums:
            problems.append(f"namespace counters of {namespace_id.hex()[:16]} disagree with metadata "
                            f"({recorded.get(namespace_id, [0, 0, 0])} recorded, {sums} found)")
    return problems


def _damage(data: Buffer) -> DamagedMeta:
    """Why ``data`` is a damaged record (it is one)."""
    try:
        BlockMeta.unpack(data)
    except DamagedMeta as exc:
        return exc
    raise AssertionError("not a damaged record")


def _fingerprint(keys: Iterator[bytes]) -> Fingerprint:
    count = total = 0
    for key in keys:
        count += 1
        total += _hash(key)
    return Fingerprint(count, total & _MASK)


class _LinkWalk:
    """Walks ``children`` (sorted by parent) beside the sorted ``meta`` keys:
    a link whose parent sorts before the current block key and was not a
    block key itself names a missing parent. ``depth_sum`` sums, over the
    links of whole parents, the hash of the link and the depth the parent
    gives its child."""

    def __init__(self, links: Iterator[tuple[bytes, Buffer]]) -> None:
        self._links = links
        self._current = next(links, None)
        self._count = self._sum = self.depth_sum = 0
        self.orphaned: list[bytes] = []  # children whose parent is missing

    def up_to(self, key: bytes | None, depth: int | None) -> None:
        """Consumes the links whose parent is ``<= key`` (all, for None);
        ``depth`` is ``key``'s (None where its record is damaged)."""
        while self._current is not None and (key is None or self._current[0][:32] <= key):
            link = self._current[0]
            self._count += 1
            self._sum += _hash(link)
            if link[:32] != key:
                self.orphaned.append(link[32:])
            elif depth is not None:
                self.depth_sum += _hash(link + (depth + 1).to_bytes(8, "little"))
            self._current = next(self._links, None)

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self._count, self._sum & _MASK)


def _parent_problems(txn: Txn, *, links: bool = True) -> list[str]:
    """Blocks whose parent is not stored, or whose child link is missing
    (with ``links``), and blocks whose depth is not their parent's plus one,
    looked up one by one."""
    problems = []
    for key, data in txn.scan("meta"):
        meta = meta_or_none(data)
        if meta is None or meta.parent is None:
            continue
        parent_data = txn.get("meta", meta.parent)
        if parent_data is None:
            if links:
                problems.append(f"block {key.hex()[:16]}: parent missing (prefix invariant broken)")
            continue
        if links and txn.get("children", meta.parent + key) is None:
            problems.append(f"block {key.hex()[:16]}: child link from its parent missing")
        parent = meta_or_none(parent_data)
        if parent is not None and meta.depth != parent.depth + 1:
            problems.append(f"block {key.hex()[:16]}: {DEPTH_PROBLEM} (depth {meta.depth}, its parent's {parent.depth})")
    return problems


def lru_problems(txn: Txn) -> list[str]:
    """Blocks without their LRU entry, looked up one by one."""
    problems = []
    for key, data in txn.scan("meta"):
        meta = meta_or_none(data)
        if meta is not None and txn.get("lru", lru_key(meta.access_ns, meta.depth, key)) is None:
            problems.append(f"block {key.hex()[:16]}: no LRU entry")
    return problems


def _three_way(
    metas: Iterator[tuple[bytes, Buffer]], blocks: Iterator[tuple[bytes, Buffer]], heads: Iterator[tuple[bytes, Buffer]],
) -> Iterator[tuple[bytes, Buffer | None, Buffer | None, Buffer | None]]:
    """Merges three sorted ``(key, value)`` streams: each key once with the
    three values (None where a stream lacks the key). The common case, one
    key in all three, takes one comparison."""
    streams = (metas, blocks, heads)
    items = [next(s, None) for s in streams]
    while True:
        m, b, h = items
        if m is not None and b is not None and h is not None and m[0] == b[0] == h[0]:
            yield m[0], m[1], b[1], h[1]
            items = [next(metas, None), next(blocks, None), next(heads, None)]
            continue
        present = [item[0] for item in items if item is not None]
        if not present:
            return
        key = min(present)
        row: list[Buffer | None] = []
        for i, item in enumerate(items):
            if item is not None and item[0] == key:
                row.append(item[1])
                items[i] = next(streams[i], None)
            else:
                row.append(None)
        yield key, row[0], row[1], row[2]
