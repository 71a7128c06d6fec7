"""Checking every stored block, and repairing what the check finds.

The check decodes and checksums each block (or a random sample, drawn
without listing the store) under its key and compares its size with its
metadata, then (for a full check) runs the index's consistency check.
Repair quarantines the corrupt blocks through the store's own door
(:meth:`ucm_db.Store.quarantine`, which re-checks each block inside its write
transaction and takes its descendants with it), quarantines blocks on parent
cycles, blocks whose parent is missing and blocks whose namespace id differs
from their parent's (damaged metadata: lookup would claim them), re-adds
missing LRU entries and child links, and recomputes the totals when they
disagree with the metadata (a damaged record's sizes are never summed:
:meth:`~ucm_db.index.entries.BlockMeta.unpack` refuses sizes no block can
have). The full check also checks the change feed (issue 46: a damaged
head, malformed records, records and event fields of blocks not stored,
:func:`~ucm_db.index.feed_audit.problems`); repair rebuilds its head and
drops those records (:func:`~ucm_db.index.feed_audit.repair`). Repair also
deletes index entries without metadata (a payload on a page the engine
cannot free is filed as stuck instead, for compact's rewrite) and damaged
quarantine records, reseals a damaged namespace description that still
rebuilds its namespace and replaces any other by a placeholder
(:mod:`ucm_db.index.descriptions`: never deleted, so a lost epoch record
stays unknown and is renewed), rewrites a damaged creation record from the
whole format version (marked as rewritten), and rewrites depths that are
not the parent's plus one (top down, moving LRU entries, with the children
of each block rewritten: :mod:`ucm_db.index.depths`), then rebuilds the pin
records where a pin made across a wrong depth left them short: so a
second check finds the store clean.

Invariants:
    * :func:`verify_view` only reads; :func:`repair` writes through a
      :class:`~ucm_db.Store` opened on the store (never under a live
      compact or migrate: the store's lock orders them).
    * A block evicted while the check runs is not reported.
    * A block quarantined for its metadata (parent missing, namespace
      altered) is judged again inside the quarantine's transaction: one a
      live writer healed since the check (it stored the missing parent
      again) is intact and reachable, and stays.
    * Every repair step judges each entry inside its own write transaction,
      of at most about ``MAINTENANCE_CHUNK_KEYS`` blocks for the link and
      depth restores, so a repair beside live writers holds them up briefly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db import codec
from ucm_db.engines.base import Txn
from ucm_db.errors import CorruptBlockError
from ucm_db.format import CREATED_KEY, INFO_TABLE, creation_record, damaged_format_records, format_record_problems
from ucm_db.maintenance.inspection import chain_roots
from ucm_db.store import epochs
from ucm_db.store.view import ProgressFn, StoreView
from ucm_db.index import damage, depths, descriptions, feed_audit, pins
from ucm_db.index.audit import DEPTH_PROBLEM, ROOT_DEPTH_PROBLEM
from ucm_db.index.damage import stored_meta
from ucm_db.index.entries import BlockMeta, body_of
from ucm_db.index.local import LocalTier
from ucm_db.index.partitions import partitions
from ucm_db.index.reads import PAYLOAD_MISSING
from ucm_db.index.upkeep import MAINTENANCE_CHUNK_KEYS

#: Blocks checked per read transaction (keeps LMDB read snapshots short).
CHUNK_BLOCKS = 256
_VANISHED = "metadata vanished"
#: Reason given for a block whose metadata names itself or a descendant as parent.
PARENT_CYCLE = "parent cycle: the metadata names the block itself or a descendant as its parent"
#: Reason given for a block whose parent is not stored (the prefix invariant is broken).
PARENT_MISSING = "parent missing: the block's parent is not stored (prefix invariant broken)"
#: Reason given for a block whose namespace id is not its parent's (an altered record).
NAMESPACE_ALTERED = "namespace id differs from its parent's (altered metadata)"
#: Reasons a repair quarantines without re-checking the payload (the metadata is at fault).
_METADATA_REASONS = (PARENT_CYCLE, PARENT_MISSING, NAMESPACE_ALTERED)
#: Index problems :meth:`LocalTier.restore_links <ucm_db.index.upkeep.IndexUpkeep.restore_links>` repairs.
_LINK_PROBLEMS = (": no LRU entry", ": child link from its parent missing")
#: How the namespace epoch problems start (:func:`ucm_db.store.epochs.problems`).
EPOCH_PROBLEM = "namespace epoch: "
#: How the change feed's problems start (:func:`~ucm_db.index.feed_audit.problems`).
_FEED_PROBLEM = "change feed: "
#: Index problems of entries without metadata, and of damaged records repair drops or rewrites.
_ORPHAN_PROBLEM = "has no metadata (orphan)"
_QUARANTINE_PROBLEM = "quarantine record "
_RECORD_PROBLEM = "info record "


@dataclass
class VerifyReport:
    """What a check found, and what a repair did about it."""

    checked: int = 0
    raw_bytes: int = 0
    corrupt: dict[bytes, str] = field(default_factory=dict)
    index_problems: list[str] = field(default_factory=list)
    quarantined_blocks: int = 0
    totals_recomputed: bool = False
    feed_repaired: bool = False
    epochs_renewed: int = 0
    #: Index entries repair dropped or rewrote, by kind (orphans, depths, links, records).
    index_repaired: dict[str, int] = field(default_factory=dict)

    @property
    def problems(self) -> bool:
        return bool(self.corrupt or self.index_problems)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerifyReport:
        """The inverse of :meth:`to_dict`."""
        return cls(int(data["checked"]), int(data["raw_bytes"]), {bytes.fromhex(c["key"]): c["reason"] for c in data["corrupt"]},
                   list(data["index_problems"]), int(data["quarantined_blocks"]), bool(data["totals_recomputed"]),
                   bool(data["feed_repaired"]), int(data.get("epochs_renewed", 0)), dict(data.get("index_repaired", {})))

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked, "raw_bytes": self.raw_bytes,
            "corrupt": [{"key": k.hex(), "reason": r} for k, r in sorted(self.corrupt.items())],
            "index_problems": self.index_problems, "quarantined_blocks": self.quarantined_blocks,
            "totals_recomputed": self.totals_recomputed, "feed_repaired": self.feed_repaired,
            "epochs_renewed": self.epochs_renewed, "index_repaired": self.index_repaired,
        }


def check_block(key: bytes, meta_data: Any, head_data: Any, stored: Any) -> tuple[int, str | None]:
    """(raw bytes, None) for a good block, (0, reason) for a bad one."""
    if meta_data is None:
        return 0, _VANISHED
    if stored is None:
        return 0, PAYLOAD_MISSING
    if head_data is None:
        return 0, "head missing"
    try:
        meta = BlockMeta.unpack(meta_data)
    except Exception as exc:  # noqa: BLE001 - any undecodable record is a finding, not a crash
        return 0, f"metadata record unreadable: {exc}"
    head = memoryview(head_data)
    body = body_of(head, memoryview(stored))
    if len(head) + len(body) != meta.stored_bytes:
        return 0, f"block is {len(head) + len(body)} bytes, metadata says {meta.stored_bytes}"
    try:
        return len(codec.decode_parts(head, body, key)), None
    except CorruptBlockError as exc:
        return 0, str(exc)


def verify_view(view: StoreView, *, sample: int | None = None, seed: int = 0, progress: ProgressFn | None = None) -> VerifyReport:
    """Checks the blocks of an open view (all, or ``sample`` at random)."""
    # A sample is drawn by random probes (O(sample) reads), never by listing
    # every key first: on a store of a million blocks the listing was most of
    # the run (issue 13, scale).
    keys = list(view.tier.iterate()) if sample is None else view.tier.sample_keys(sample, seed=seed)
    report = VerifyReport(index_problems=list(view.damaged))
    for start in range(0, len(keys), CHUNK_BLOCKS):
        chunk = keys[start : start + CHUNK_BLOCKS]
        for key, (raw, reason) in zip(chunk, view.tier.visit_stored(chunk, check_block)):
            report.checked += 1
            report.raw_bytes += raw
            if reason is not None and reason != _VANISHED:
                report.corrupt[key] = reason
        if progress is not None:
            progress(start + len(chunk), len(keys))
    if sample is None:
        report.index_problems += format_record_problems(view.tier.engine) + view.tier.check()
        report.index_problems += view.tier.engine.read(feed_audit.problems)
        report.index_problems += view.tier.engine.read(damage.quarantine_problems)
        report.index_problems += [EPOCH_PROBLEM + line for line in epochs.problems(view.tier.engine)]
        metas = view.tier.scan_metas()
        _, cyclic = chain_roots(metas)
        for key in sorted(cyclic):
            report.corrupt[key] = PARENT_CYCLE
        for key, reason in sorted(lineage_problems(metas, set(keys)).items()):
            report.corrupt.setdefault(key, reason)
    return report


def lineage_problems(metas: dict[bytes, BlockMeta], stored: set[bytes]) -> dict[bytes, str]:
    """Blocks whose parent is not stored, or whose namespace id is not their
    parent's: lookup would claim them, or a chain of another namespace.
    ``metas`` holds the whole records, ``stored`` every key with a record (a
    child of a damaged record is not named: it goes with its parent)."""
    found: dict[bytes, str] = {}
    for key, meta in metas.items():
        if meta.parent is None:
            continue
        parent = metas.get(meta.parent)
        if parent is None:
            if meta.parent not in stored:
                found[key] = PARENT_MISSING
        elif parent.namespace_id != meta.namespace_id:
            found[key] = NAMESPACE_ALTERED
    return found


def counters_damaged(problems: list[str]) -> bool:
    """Whether the index check found totals that disagree with the metadata,
    or damaged counter records (both fixed by recounting)."""
    return any(p.startswith(("totals ", "info record ", "namespace counters ")) or "metadata record damaged" in p
               for p in problems)


def feed_damaged(problems: list[str]) -> bool:
    """Whether the check found problems of the change feed."""
    return any(p.startswith(_FEED_PROBLEM) for p in problems)


def links_missing(problems: list[str]) -> bool:
    """Whether the index check found blocks without their LRU entry or child link."""
    return any(p.endswith(_LINK_PROBLEMS) for p in problems)


def repair(path: Path, report: VerifyReport) -> VerifyReport:
    """Quarantines the corrupt blocks of ``report``, repairs the index and
    the records it names (module docstring), recounts damaged or
    disagreeing totals and repairs the change feed, through a Store opened
    on ``path``; fills in what was done."""
    from ucm_db.store import open as open_store

    with open_store(path) as store:
        tier = store._tier
        # Counted by the quarantines' own transactions: a writer's puts and
        # evictions meanwhile are not this repair's.
        before = tier.damage.quarantined_blocks
        for key, reason in report.corrupt.items():
            if reason in _METADATA_REASONS:
                tier.quarantine(key, f"ucm-db verify: {reason}", _always, still_damaged=still_damaged(reason))
            else:
                store.quarantine(key, f"ucm-db verify: {reason}")
        report.quarantined_blocks = tier.damage.quarantined_blocks - before
        report.index_repaired = repair_index(tier, report.index_problems)
        if counters_damaged(report.index_problems):
            tier.recompute_totals()
            report.totals_recomputed = True
        if any(line.startswith(EPOCH_PROBLEM) for line in report.index_problems):
            # A fresh epoch, above every one used: the lost epoch's blocks are never served again.
            report.epochs_renewed = len(epochs.repair(tier.engine))
        if feed_damaged(report.index_problems):
            # After the quarantines: their removals are logged before the feed is judged again.
            report.feed_repaired = tier.engine.write(lambda txn: feed_audit.repair(txn, tier.feed_max_records)) > 0
    return report


def repair_index(tier: LocalTier, problems: list[str]) -> dict[str, int]:
    """Repairs what ``problems`` name of the index, each step only where named
    (after the quarantines, before any recount): damaged quarantine records,
    entries without metadata, depths, then LRU entries and child links (a
    link is restored only under a depth that agrees). Returns counts by kind."""
    done: dict[str, int] = {}
    if any(p.startswith(_QUARANTINE_PROBLEM) for p in problems):
        done["quarantine_records_dropped"] = tier.engine.write(damage.drop_damaged_quarantine_records)
    if any(p.endswith(_ORPHAN_PROBLEM) for p in problems):
        done["orphans_dropped"], done["orphans_stuck"] = tier.damage.drop_orphan_payloads()
    if any(DEPTH_PROBLEM in p or ROOT_DEPTH_PROBLEM in p for p in problems):
        done["depths_restored"] = restore_depths(tier)
        if done["depths_restored"]:  # a pin made across a wrong depth stopped below it (pins.py): its records fall short
            done["pins_rebuilt"] = tier.engine.write(lambda txn: pins.rebuild(txn) if pins.problems(txn) else 0)
    if links_missing(problems) or "depths_restored" in done:
        done.update(restore_links(tier))
    if any(p.startswith(_RECORD_PROBLEM) for p in problems):  # each record judged again: only damaged ones change
        done["records_rewritten"], done["descriptions_lost"] = tier.engine.write(_rewrite_damaged_records)
    return {kind: count for kind, count in done.items() if count}


def still_damaged(reason: str) -> damage.MetaRecheck:
    """The in-transaction judgement for a block quarantined for ``reason``
    (one of the metadata reasons): a parent stored again since the check
    (by a live writer) heals a missing parent; a cycle never heals."""
    if reason == PARENT_MISSING:
        return lambda txn, meta: meta.parent is not None and txn.get("meta", meta.parent) is None
    if reason == NAMESPACE_ALTERED:
        def altered(txn: Txn, meta: BlockMeta) -> bool:
            parent = None if meta.parent is None else stored_meta(txn, meta.parent)
            return meta.parent is not None and (parent is None or parent.namespace_id != meta.namespace_id)
        return altered
    return lambda _txn, _meta: True


def _always(_head: memoryview, _body: memoryview) -> bool:
    return True


def restore_links(tier: LocalTier) -> dict[str, int]:
    """Re-adds missing LRU entries and child links
    (:func:`~ucm_db.index.damage.restore_links_in`), one write transaction
    per partition of at most about ``MAINTENANCE_CHUNK_KEYS`` blocks: one
    transaction over a million blocks held live writers up for ~10 s."""
    added = {"lru": 0, "children": 0}
    for prefix in partitions(tier.engine, "meta", MAINTENANCE_CHUNK_KEYS):
        for kind, count in tier.engine.write(lambda txn: damage.restore_links_in(txn, prefix)).items():
            added[kind] += count
    return added


def restore_depths(tier: LocalTier) -> int:
    """Rewrites every depth that is not the parent's plus one (a first
    block's: 0), parents first, each judged again in its write transaction,
    and the children of each block rewritten after it (a live writer's
    child put since the scan has the old depth plus one:
    :func:`~ucm_db.index.depths.restore_in`), at most about
    ``MAINTENANCE_CHUNK_KEYS`` judged per transaction; returns how many."""
    metas = tier.scan_metas()
    wrong = [key for _depth, key in sorted((depth, key) for key, depth in expected_depths(metas).items()
                                           if metas[key].depth != depth)]
    rewritten: set[bytes] = set()
    pending: list[bytes] = []
    start = 0
    while pending or start < len(wrong):
        taken = max(0, MAINTENANCE_CHUNK_KEYS - len(pending))
        batch, start = pending + wrong[start:start + taken], start + taken
        done, pending = tier.engine.write(lambda txn: depths.restore_in(txn, batch, MAINTENANCE_CHUNK_KEYS, rewritten))
        rewritten.update(done)
    return len(rewritten)


def expected_depths(metas: dict[bytes, BlockMeta]) -> dict[bytes, int]:
    """The depth each block of ``metas`` (whole records) should have: 0 for a
    first block, its parent's plus one below; blocks under a missing parent
    or on a parent cycle are left out (a repair quarantines them)."""
    depth_of: dict[bytes, int] = {}
    for start in metas:
        path: list[bytes] = []
        on_path: set[bytes] = set()
        key = start
        while key not in depth_of:
            meta = metas.get(key)
            if meta is None or key in on_path:  # parent missing or a cycle: nothing on this path is known
                break
            if meta.parent is None:
                depth_of[key] = 0
                break
            path.append(key)
            on_path.add(key)
            key = meta.parent
        if key in depth_of:
            for k in reversed(path):
                depth_of[k] = depth_of[key] + 1
                key = k
    return depth_of


def _rewrite_damaged_records(txn: Txn) -> tuple[int, int]:
    """Reseals or replaces the damaged namespace descriptions, never deleting
    one (:func:`ucm_db.index.descriptions.repair`: a description is how the
    store knows it holds the namespace, so a lost epoch record stays
    unknown), and rewrites a damaged creation record (marked as rewritten:
    when the store was made is not known). Returns (records rewritten,
    descriptions replaced by the placeholder)."""
    resealed, replaced = descriptions.repair(txn)
    rewritten = resealed + replaced
    if any(name == CREATED_KEY.decode() for name, _ in damaged_format_records(txn)):
        txn.put(INFO_TABLE, CREATED_KEY, rewritten_creation_record())
        rewritten += 1
    return rewritten, replaced


def rewritten_creation_record() -> bytes:
    """The ``info/created`` record ``--fix`` writes for a damaged one: the
    format version (which repair requires whole) and who rewrote it when,
    no creation time or creating version (a made-up one would show in
    ``inspect``)."""
    record = json.loads(creation_record())
    rewritten = {"by": "ucm-db verify --fix (the record was damaged)", "time_ns": record.pop("created_ns"),
                 "ucm_db_version": record.pop("ucm_db_version")}
    return json.dumps({**record, "rewritten": rewritten}, sort_keys=True).encode()
