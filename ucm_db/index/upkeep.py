"""The local block index's maintenance primitives: checks, recounts, repairs
and the bulk walks :mod:`ucm_db.maintenance` runs (each one transaction, or
one per bounded chunk). :class:`IndexUpkeep` needs only the engine
(``compact``'s eviction is the writer's: :meth:`IndexWriter.evict_lru
<ucm_db.index.writes.IndexWriter.evict_lru>`).

Invariants:
    * Nothing else outside :mod:`ucm_db.index` edits the index's tables:
      maintenance goes through these methods.
    * A bulk deletion scans at most about ``chunk_keys`` entries per write
      transaction, and judges and deletes an entry in the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ucm_db.index import accounting, partitions as chunked, damage, audit as index_audit, pins, records
from ucm_db.index.accounting import NS_COUNTS, NS_COUNTS_PREFIX, Totals, damaged_records, recount
from ucm_db.engines.base import Buffer, Engine, Txn
from ucm_db.index.entries import BlockMeta, lru_key

T = TypeVar("T")
#: Entries a maintenance write transaction scans at most: a compact beside
#: live writers holds their lock for milliseconds at a time, not for the walk.
MAINTENANCE_CHUNK_KEYS = 4096


class IndexUpkeep:
    """Checks and maintenance primitives of the local block index over ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def check(self) -> list[str]:
        """Consistency problems of the index (empty list when healthy), from
        one snapshot in sorted scans (:mod:`ucm_db.index.audit`)."""
        return self.engine.read(lambda txn: _problems(txn, index_audit.audit(txn)))

    def damaged_records(self) -> list[tuple[str, str]]:
        """(name, reason) of every damaged info record (empty when healthy)."""
        return self.engine.read(damaged_records)

    def recompute_totals(self) -> Totals:
        """Rewrites the totals and per-namespace counters from the block
        metadata (keeping the event counters if their record is whole), and
        the pin records and pinned counters from the pins made at stored
        blocks (:func:`ucm_db.index.pins.rebuild`); returns the new totals."""
        def run(txn: Txn) -> Totals:
            totals, per_namespace = recount(txn)
            try:
                old = Totals.read(txn)
                totals.evictions, totals.quarantined, totals.hits, totals.misses = (
                    old.evictions, old.quarantined, old.hits, old.misses,
                )
            except records.DamagedRecord:
                pass
            for name, _ in list(txn.scan("info", NS_COUNTS_PREFIX)):
                records.delete_checked(txn, bytes(name))
            totals.write(txn)
            for namespace_id, counts in per_namespace.items():
                records.put_checked(txn, NS_COUNTS_PREFIX + namespace_id, NS_COUNTS.pack(*counts))
            if pins.problems(txn):
                pins.rebuild(txn)
            return totals
        return self.engine.write(run)

    def restore_links(self) -> dict[str, int]:
        """Re-adds missing LRU entries and child links in one write
        transaction (:func:`ucm_db.index.damage.restore_links_in`); returns
        how many of each were added."""
        return self.engine.write(damage.restore_links_in)

    def seal_records(self) -> int:
        """Adds checksums to the settings, counter and description records
        written by older code (see :mod:`ucm_db.index.records`); returns how
        many."""
        return self.engine.write(accounting.seal_records)  # counters recounted before sealing (issue 26 item 18)

    def scan_metas(self, namespaces: set[bytes] | None = None) -> dict[bytes, BlockMeta]:
        """Metadata of every block (of ``namespaces``, None = all), from one snapshot."""
        def run(txn: Txn) -> dict[bytes, BlockMeta]:
            metas = ((bytes(k), damage.meta_or_none(v)) for k, v in txn.scan("meta"))  # damaged records left out
            return {k: m for k, m in metas if m is not None and (namespaces is None or m.namespace_id in namespaces)}
        return self.engine.read(run)

    def visit_stored(
        self, keys: Sequence[bytes], visit: Callable[[bytes, Buffer | None, Buffer | None, Buffer | None], T],
    ) -> list[T]:
        """``visit(key, meta record, head, stored value)`` for each key inside
        one read transaction (None for what is missing); the buffers are valid
        only during the call."""
        return self.engine.read(lambda txn: [visit(k, txn.get("meta", k), txn.get("heads", k), txn.get("blocks", k)) for k in keys])

    def sample_keys(self, count: int, *, seed: int = 0) -> list[bytes]:
        """About ``count`` distinct stored keys chosen at random by ``seed``,
        sorted, in O(count) reads whatever the store's size (random prefix
        probes, :func:`ucm_db.index.partitions.sample_keys`)."""
        total_keys = self.engine.read(Totals.read_or_recompute).blocks
        return chunked.sample_keys(self.engine, "meta", count, total_keys=total_keys, seed=seed)

    def drop_quarantine_records(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> int:
        """Deletes every quarantine record but those of stuck payloads
        (:mod:`ucm_db.index.damage`: the rewrite drops them), at most about
        ``chunk_keys`` per write transaction; returns how many went."""
        return self._drop_where("quarantine", lambda txn, key: not damage.is_stuck(txn, key), chunk_keys)

    def drop_orphans(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> dict[str, int]:
        """Deletes index entries whose block has no metadata; returns counts
        per table.

        A read-only audit in sorted scans (:func:`ucm_db.index.audit.audit`)
        first tells which tables may hold such entries; only those are
        walked again entry by entry, each write transaction scanning at most
        about ``chunk_keys`` entries of one table
        (:func:`ucm_db.index.partitions.partitions`). So a large store neither
        holds the writer lock for long nor builds a big transaction, and an
        entry is judged and deleted in the same transaction."""
        return self._drop_suspect(self.engine.read(lambda txn: index_audit.audit(txn).suspect), chunk_keys)

    def drop_orphans_and_check(self, *, chunk_keys: int = MAINTENANCE_CHUNK_KEYS) -> tuple[dict[str, int], list[str]]:
        """:meth:`drop_orphans`, then :meth:`check`: the counts dropped per
        table and the index's problems afterwards. One audit serves both when
        nothing was dropped (the usual case), which halves the work of a
        compact on a large store."""
        def audit(txn: Txn) -> tuple[set[str], list[str]]:
            found = index_audit.audit(txn)
            return found.suspect, _problems(txn, found)

        suspect, problems = self.engine.read(audit)
        dropped = self._drop_suspect(suspect, chunk_keys)
        return dropped, (self.check() if any(dropped.values()) else problems)

    def _drop_suspect(self, suspect: set[str], chunk_keys: int) -> dict[str, int]:
        return {table: self._drop_where(table, _ORPHAN[table], chunk_keys) if table in suspect else 0 for table in _ORPHAN}

    def _drop_where(self, table: str, dead: Callable[[Txn, bytes], bool], chunk_keys: int) -> int:
        """Deletes the entries of ``table`` that ``dead(txn, key)`` picks, one
        write transaction per partition of at most about ``chunk_keys`` keys."""
        def run(txn: Txn, prefix: bytes) -> int:
            doomed = [k for k, _ in txn.scan(table, prefix) if dead(txn, k)]
            for key in doomed:
                txn.delete(table, key)
            return len(doomed)
        return sum(self.engine.write(lambda txn: run(txn, p)) for p in chunked.partitions(self.engine, table, chunk_keys))


def _problems(txn: Txn, found: index_audit.Audit) -> list[str]:
    """The problems :meth:`LocalTier.check` reports, given the audit of ``txn``."""
    problems: list[str] = [f"info record {name!r} is damaged: {reason}" for name, reason in damaged_records(txn)]
    try:
        totals = Totals.read(txn)
    except records.DamagedRecord:
        totals = Totals(-1, -1, -1)
    problems += found.problems + index_audit.namespace_problems(txn, found)
    problems += [p for p in pins.problems(txn) if p not in problems]
    if (found.blocks, found.raw_bytes, found.stored_bytes) != (totals.blocks, totals.raw_bytes, totals.stored_bytes):
        problems.append(f"totals {totals} disagree with metadata ({found.blocks}, {found.raw_bytes}, {found.stored_bytes})")
    return problems


def _stored(txn: Txn, key: bytes) -> bool:
    return txn.get("meta", key) is not None


def _lru_dead(txn: Txn, lru: bytes) -> bool:
    meta = damage.stored_meta(txn, lru[-32:])
    if meta is None:
        return True
    return lru_key(meta.access_ns, meta.depth, lru[-32:]) != lru


#: Per index table, whether an entry is orphaned (its block has no metadata).
_ORPHAN: dict[str, Callable[[Txn, bytes], bool]] = {
    "blocks": lambda txn, k: not _stored(txn, k) and not damage.is_stuck(txn, k),
    "heads": lambda txn, k: not _stored(txn, k),
    "uploads": lambda txn, k: not _stored(txn, k),
    "children": lambda txn, k: not (_stored(txn, k[:32]) and _stored(txn, k[32:])),
    "lru": _lru_dead,
}
