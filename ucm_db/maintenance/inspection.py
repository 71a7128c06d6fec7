"""What a store holds: totals, namespaces, blocks, histograms, hottest chains.

Invariants:
    * Everything is read from a :class:`~ucm_db.store.view.StoreView`: the
      store is never written.
    * Walking parent links terminates on any metadata: a record naming itself
      or a descendant as parent is reported as a cycle, never followed twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ucm_db.format import STORE_FORMAT_VERSION, damaged_format_records
from ucm_db.store.view import StoreView, select_namespaces
from ucm_db.keys.units import readable_at
from ucm_db.index.local import BlockMeta

AGE_BUCKETS_S: list[tuple[float, str]] = [
    (60, "< 1 min"), (3600, "< 1 h"), (86400, "< 1 day"), (7 * 86400, "< 7 days"), (float("inf"), ">= 7 days"),
]
HIT_BUCKETS: list[tuple[float, str]] = [(0, "0"), (1, "1"), (3, "2-3"), (7, "4-7"), (15, "8-15"), (float("inf"), "16+")]
#: Quarantined keys listed by name in a report (the count is always whole).
LISTED_QUARANTINE = 20


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One stored block as maintenance sees it."""

    key: bytes
    namespace_id: bytes
    parent: bytes | None
    depth: int
    raw_bytes: int
    stored_bytes: int
    created_ns: int
    last_use_ns: int
    hits: int

    @classmethod
    def of(cls, key: bytes, meta: BlockMeta) -> BlockInfo:
        return cls(key, meta.namespace_id, meta.parent, meta.depth, meta.raw_bytes, meta.stored_bytes,
                   meta.created_ns, meta.access_ns, meta.hits)


def iter_blocks(view: StoreView, namespaces: set[bytes] | None = None) -> Iterator[BlockInfo]:
    """Every block (of ``namespaces``), in key order, from one snapshot."""
    for key, meta in sorted(view.tier.scan_metas(namespaces).items()):
        yield BlockInfo.of(key, meta)


def namespace_rows(view: StoreView, selected: set[bytes] | None, now_ns: int) -> list[dict[str, Any]]:
    """Per namespace: its description and counters (those holding blocks),
    pinned blocks and bytes among them."""
    descriptions = view.tier.namespace_descriptions()
    pinned = view.tier.pin_counts()
    rows = []
    for ns_id, (blocks, raw, stored, last_ns) in sorted(view.tier.namespace_counts().items()):
        if not blocks or (selected is not None and ns_id not in selected):
            continue
        d = descriptions.get(ns_id, {})
        rows.append({
            "id": ns_id.hex(), "model": d.get("model"), "kv_dtype": d.get("kv_dtype"), "block_size": d.get("block_size"),
            "rank": f"tp {d.get('tp_rank', 0)}/{d.get('tp_size', 1)} pp {d.get('pp_rank', 0)}/{d.get('pp_size', 1)}",
            "read_at": readable_at(d),  # TP-independent units or pre-unit per-rank blocks (docs/tp.md)
            "blocks": blocks, "raw_bytes": raw, "stored_bytes": stored,
            "pinned_blocks": pinned.get(ns_id, (0, 0))[0], "pinned_bytes": pinned.get(ns_id, (0, 0))[1],
            "last_use_ns": last_ns, "last_use_age_s": round(max(0, now_ns - last_ns) / 1e9, 1) if last_ns else None,
            "description": d,
        })
    return rows


def _bucket(value: float, buckets: list[tuple[float, str]], *, inclusive: bool) -> str:
    return next(label for bound, label in buckets if (value <= bound if inclusive else value < bound))


def histograms(metas: dict[bytes, BlockMeta], now_ns: int) -> dict[str, dict[str, int]]:
    ages = {label: 0 for _, label in AGE_BUCKETS_S}
    hits = {label: 0 for _, label in HIT_BUCKETS}
    for meta in metas.values():
        ages[_bucket(max(0, now_ns - meta.access_ns) / 1e9, AGE_BUCKETS_S, inclusive=False)] += 1
        hits[_bucket(meta.hits, HIT_BUCKETS, inclusive=True)] += 1
    return {"age_since_last_use": ages, "hits": hits}


def chain_roots(metas: dict[bytes, BlockMeta]) -> tuple[dict[bytes, bytes], set[bytes]]:
    """(first block of each block's chain, keys on a parent cycle).

    A block whose parent is not in ``metas`` is a chain root. A block on a
    cycle, or whose ancestors run into one, gets the first cycle member met
    as its root; the cycle's members are returned (a healthy store has none).
    """
    root_of: dict[bytes, bytes] = {}
    cyclic: set[bytes] = set()
    for start in metas:
        path: list[bytes] = []
        on_path: set[bytes] = set()
        key = start
        while key not in root_of:
            if key in on_path:  # the walk came back: key..end of path is a cycle
                cyclic.update(path[path.index(key):])
                root_of[key] = key
                break
            parent = metas[key].parent
            if parent is None or parent not in metas:
                root_of[key] = key
                break
            path.append(key)
            on_path.add(key)
            key = parent
        for k in path:
            root_of.setdefault(k, root_of[key])
    return root_of, cyclic


def hottest_chains(metas: dict[bytes, BlockMeta], top: int) -> tuple[list[dict[str, Any]], set[bytes]]:
    """Chains (trees under one first block) by total hits, most first, and
    the keys found on parent cycles."""
    root_of, cyclic = chain_roots(metas)
    chains: dict[bytes, dict[str, Any]] = {}
    for key, meta in metas.items():
        c = chains.setdefault(root_of[key], {"blocks": 0, "hits": 0, "stored_bytes": 0, "longest_blocks": 0, "last_use_ns": 0})
        c["blocks"] += 1
        c["hits"] += meta.hits
        c["stored_bytes"] += meta.stored_bytes
        c["longest_blocks"] = max(c["longest_blocks"], meta.depth + 1)
        c["last_use_ns"] = max(c["last_use_ns"], meta.access_ns)
    ranked = sorted(chains.items(), key=lambda kv: (-kv[1]["hits"], -kv[1]["last_use_ns"]))[:top]
    return [{"first_block": k.hex(), "namespace": metas[k].namespace_id.hex(), **v} for k, v in ranked], cyclic


def pending_migration_names(view: StoreView) -> list[str]:
    """Names of the migrations that would bring the store to this code's format."""
    from ucm_db.errors import MigrationError
    from ucm_db.migrations import plan

    try:
        return [m.name for m in plan(view.format_version, STORE_FORMAT_VERSION, view.path)]
    except MigrationError:  # a newer store: reported through the format fields
        return []


def inspect_view(view: StoreView, *, namespaces: tuple[str, ...] = (), top: int = 0, now_ns: int | None = None) -> dict[str, Any]:
    """The inspect report of an open view, as a JSON-ready dict."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    selected = select_namespaces(view, namespaces)
    metas = view.tier.scan_metas(selected)
    totals = view.tier.totals()
    quarantine = sorted(view.tier.quarantine_records())
    capacity = _recorded_capacity(view)
    report: dict[str, Any] = {
        "path": str(view.path), "engine": view.engine_name, "format_version": view.format_version,
        "code_format_version": STORE_FORMAT_VERSION, "pending_migrations": pending_migration_names(view),
        "created": view.created, "settings": view.settings, "capacity_bytes": capacity,
        "blocks": totals.blocks, "raw_bytes": totals.raw_bytes, "stored_bytes": totals.stored_bytes,
        "compression_ratio": round(totals.raw_bytes / totals.stored_bytes, 4) if totals.stored_bytes else 1.0,
        "use_fraction": round(totals.stored_bytes / capacity, 4) if capacity else None,
        "file_bytes": view.engine.file_bytes(), "file_free_bytes": view.engine.free_page_bytes(), "hits": totals.hits, "misses": totals.misses,
        "evictions": totals.evictions, "quarantined_total": totals.quarantined,
        "pinned_bytes": sum(stored for _blocks, stored in view.tier.pin_counts().values()),
        "quarantine_records": len(quarantine),
        "quarantined_blocks": [k.hex() for k in quarantine[:LISTED_QUARANTINE]],
        "pending_uploads": len(view.tier.pending_uploads()),
        "remote": view.settings.get("remote"),
        "damaged_records": _damaged_records(view),
        "remote_codec": _remote_codec_record(view),
        "namespaces": namespace_rows(view, selected, now_ns),
        "histograms": histograms(metas, now_ns),
    }
    if selected is not None:
        report["selected_blocks"] = len(metas)
    if top:
        report["hottest_chains"], cyclic = hottest_chains(metas, top)
        report["parent_cycles"] = sorted(k.hex() for k in cyclic)
    return report


def _recorded_capacity(view: StoreView) -> int:
    """The recorded capacity; 0 (shown as unknown) when the record holds
    none or a value that is not a whole number (listed as damage)."""
    value = view.settings.get("capacity_bytes", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _damaged_records(view: StoreView) -> list[str]:
    """What the view found on opening, and every damaged info record
    ``verify`` reports (a checksum-valid settings record holding an invalid
    value included), once each."""
    found = list(view.damaged)
    for name, reason in view.tier.engine.read(damaged_format_records) + view.tier.damaged_records():
        if not any(f"'{name}'" in line and reason in line for line in found):
            found.append(f"info record {name!r} is damaged: {reason}")
    return found


def _remote_codec_record(view: StoreView) -> dict[str, Any] | None:
    """The remote codec the uploader last chose (``info/remote_codec``),
    None if it never uploaded; ``{"damaged": ...}`` if unreadable."""
    raw = view.tier.info_get(b"remote_codec")
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {"damaged": "not JSON"}
    return record if isinstance(record, dict) else {"damaged": "not a JSON object"}
