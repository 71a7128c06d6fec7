"""``ucm-db inspect``: what a store holds, how full it is and how it is used.

Everything is read in one read transaction of a :func:`store_view`, so the
figures are one consistent snapshot and nothing is written to the store.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from ucm_db.errors import ConfigError
from ucm_db.migrations import plan
from ucm_db.store import STORE_FORMAT_VERSION
from ucm_db.tiers.base import Txn
from ucm_db.tiers.local import BlockMeta, Totals

from ucm_db.tools.cli_common import StoreView, emit, human_bytes, json_option, store_view, table

AGE_BUCKETS_S: list[tuple[float, str]] = [
    (60, "< 1 min"), (3600, "< 1 h"), (86400, "< 1 day"), (7 * 86400, "< 7 days"), (float("inf"), ">= 7 days"),
]
HIT_BUCKETS: list[tuple[float, str]] = [(0, "0"), (1, "1"), (3, "2-3"), (7, "4-7"), (15, "8-15"), (float("inf"), "16+")]


def select_namespaces(view: StoreView, wanted: tuple[str, ...]) -> set[bytes] | None:
    """Namespace ids matching ``wanted`` (id hex prefixes or model names);
    None means all."""
    if not wanted:
        return None
    descriptions = view.tier.namespace_descriptions()
    chosen: set[bytes] = set()
    for item in wanted:
        found = {ns for ns, d in descriptions.items() if ns.hex().startswith(item.lower()) or d.get("model") == item}
        if not found:
            known = ", ".join(f"{ns.hex()} ({d.get('model')})" for ns, d in descriptions.items()) or "none"
            raise ConfigError(f"no namespace matches {item!r}", hint=f"pass an id prefix or model name; the store has: {known}")
        chosen |= found
    return chosen


def _bucket(value: float, buckets: list[tuple[float, str]], *, inclusive: bool) -> str:
    return next(label for bound, label in buckets if (value <= bound if inclusive else value < bound))


def scan_blocks(txn: Txn, selected: set[bytes] | None) -> dict[bytes, BlockMeta]:
    """Metadata of every block (of the selected namespaces)."""
    metas = {}
    for key, data in txn.scan("meta"):
        meta = BlockMeta.unpack(data)
        if selected is None or meta.namespace_id in selected:
            metas[key] = meta
    return metas


def histograms(metas: dict[bytes, BlockMeta], now_ns: int) -> dict[str, dict[str, int]]:
    ages = {label: 0 for _, label in AGE_BUCKETS_S}
    hits = {label: 0 for _, label in HIT_BUCKETS}
    for meta in metas.values():
        ages[_bucket(max(0, now_ns - meta.access_ns) / 1e9, AGE_BUCKETS_S, inclusive=False)] += 1
        hits[_bucket(meta.hits, HIT_BUCKETS, inclusive=True)] += 1
    return {"age_since_last_use": ages, "hits": hits}


def hottest_chains(metas: dict[bytes, BlockMeta], top: int) -> list[dict[str, Any]]:
    """Chains (trees under one first block) by total hits, most first."""
    root_of: dict[bytes, bytes] = {}

    def root(key: bytes) -> bytes:
        path = []
        while key not in root_of:
            parent = metas[key].parent
            if parent is None or parent not in metas:
                root_of[key] = key
                break
            path.append(key)
            key = parent
        for k in path:
            root_of[k] = root_of[key]
        return root_of[key]

    chains: dict[bytes, dict[str, Any]] = {}
    for key, meta in metas.items():
        c = chains.setdefault(root(key), {"blocks": 0, "hits": 0, "stored_bytes": 0, "longest_blocks": 0, "last_use_ns": 0})
        c["blocks"] += 1
        c["hits"] += meta.hits
        c["stored_bytes"] += meta.stored_bytes
        c["longest_blocks"] = max(c["longest_blocks"], meta.depth + 1)
        c["last_use_ns"] = max(c["last_use_ns"], meta.access_ns)
    ranked = sorted(chains.items(), key=lambda kv: (-kv[1]["hits"], -kv[1]["last_use_ns"]))[:top]
    return [{"first_block": k.hex(), "namespace": metas[k].namespace_id.hex(), **v} for k, v in ranked]


def gather(view: StoreView, *, namespaces: tuple[str, ...] = (), top: int = 0, now_ns: int | None = None) -> dict[str, Any]:
    """The inspect report as a dict (see :func:`render` for the human form)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    selected = select_namespaces(view, namespaces)

    def read(txn: Txn) -> dict[str, Any]:
        metas = scan_blocks(txn, selected)
        return {
            "totals": Totals.read(txn),
            "metas": metas,
            "quarantine": [k for k, _ in txn.scan("quarantine")],
            "uploads": sum(1 for _ in txn.scan("uploads")),
        }

    snap = view.engine.read(read)
    totals: Totals = snap["totals"]
    capacity = int(view.settings.get("capacity_bytes", 0))
    try:
        pending = [m.name for m in plan(view.format_version, STORE_FORMAT_VERSION, view.path)]
    except Exception:  # noqa: BLE001 - a newer store: reported via format fields
        pending = []
    report: dict[str, Any] = {
        "path": str(view.path), "engine": view.engine_name, "format_version": view.format_version,
        "code_format_version": STORE_FORMAT_VERSION, "pending_migrations": pending,
        "created": view.created, "settings": view.settings, "capacity_bytes": capacity,
        "blocks": totals.blocks, "raw_bytes": totals.raw_bytes, "stored_bytes": totals.stored_bytes,
        "compression_ratio": round(totals.raw_bytes / totals.stored_bytes, 4) if totals.stored_bytes else 1.0,
        "use_fraction": round(totals.stored_bytes / capacity, 4) if capacity else None,
        "file_bytes": view.engine.file_bytes(), "hits": totals.hits, "misses": totals.misses,
        "evictions": totals.evictions, "quarantined_total": totals.quarantined,
        "quarantine_records": len(snap["quarantine"]),
        "quarantined_blocks": [k.hex() for k in snap["quarantine"][:20]],
        "pending_uploads": snap["uploads"],
        "remote": view.settings.get("remote"),
        "namespaces": namespace_rows(view, selected, now_ns),
        "histograms": histograms(snap["metas"], now_ns),
    }
    if selected is not None:
        report["selected_blocks"] = len(snap["metas"])
    if top:
        report["hottest_chains"] = hottest_chains(snap["metas"], top)
    return report


def namespace_rows(view: StoreView, selected: set[bytes] | None, now_ns: int) -> list[dict[str, Any]]:
    descriptions = view.tier.namespace_descriptions()
    rows = []
    for ns_id, (blocks, raw, stored, last_ns) in sorted(view.tier.namespace_counts().items()):
        if not blocks or (selected is not None and ns_id not in selected):
            continue
        d = descriptions.get(ns_id, {})
        rows.append({
            "id": ns_id.hex(), "model": d.get("model"), "kv_dtype": d.get("kv_dtype"), "block_size": d.get("block_size"),
            "rank": f"tp {d.get('tp_rank', 0)}/{d.get('tp_size', 1)} pp {d.get('pp_rank', 0)}/{d.get('pp_size', 1)}",
            "blocks": blocks, "raw_bytes": raw, "stored_bytes": stored,
            "last_use_ns": last_ns, "last_use_age_s": round(max(0, now_ns - last_ns) / 1e9, 1) if last_ns else None,
            "description": d,
        })
    return rows


def render(r: dict[str, Any]) -> str:
    """The human report."""
    fmt = f"{r['format_version']}" + ("" if not r["pending_migrations"] else f" (pending: {', '.join(r['pending_migrations'])}; run `ucm-db migrate {r['path']}`)")
    created = r["created"] or {}
    use = f"{r['use_fraction'] * 100:.1f}%" if r["use_fraction"] is not None else "?"
    lines = [
        f"store          {r['path']}",
        f"engine         {r['engine']}   format {fmt}   created by ucm-db {created.get('ucm_db_version') or 'unknown'}",
        "settings       " + ", ".join(f"{k}={v}" for k, v in sorted(r["settings"].items())),
        f"capacity       {human_bytes(r['capacity_bytes'])}, used {human_bytes(r['stored_bytes'])} ({use}); files {human_bytes(r['file_bytes'])}",
        f"blocks         {r['blocks']}   raw {human_bytes(r['raw_bytes'])} -> stored {human_bytes(r['stored_bytes'])} (ratio {r['compression_ratio']:.2f}x)",
        f"activity       hits {r['hits']}, misses {r['misses']}, evictions {r['evictions']}",
        f"quarantine     {r['quarantine_records']} records ({r['quarantined_total']} blocks quarantined ever)",
        f"uploads        {r['pending_uploads']} pending   remote {r['remote'] or 'not recorded in the store'}",
        "",
    ]
    rows = [[n["id"][:16], n["model"], n["kv_dtype"], n["block_size"], n["rank"], n["blocks"], human_bytes(n["stored_bytes"]),
             f"{n['last_use_age_s']:.0f} s ago" if n["last_use_age_s"] is not None else "-"] for n in r["namespaces"]]
    lines.append(table(["namespace", "model", "dtype", "block", "rank", "blocks", "stored", "last use"], rows))
    for name, hist in r["histograms"].items():
        lines.append(f"\n{name.replace('_', ' ')}:")
        lines.extend(f"  {label:<10} {count}" for label, count in hist.items())
    if "hottest_chains" in r:
        lines.append("\nhottest chains:")
        rows = [[c["first_block"][:16], c["namespace"][:16], c["hits"], c["blocks"], c["longest_blocks"], human_bytes(c["stored_bytes"])]
                for c in r["hottest_chains"]]
        lines.append(table(["first block", "namespace", "hits", "blocks", "longest", "stored"], rows))
    return "\n".join(lines)


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable.")
@click.option("--top", type=click.IntRange(min=0), default=0, help="Also list the N hottest chains.")
@json_option
def inspect_command(path: Path, namespaces: tuple[str, ...], top: int, as_json: bool) -> None:
    """Show what a store holds: format, engine, settings, capacity and use,
    blocks and compression, namespaces, age and hit histograms, quarantine,
    pending uploads. Read-only: safe beside a running server.

    \b
    Example:
        ucm-db inspect /var/cache/ucm-db --top 5
        ucm-db inspect /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B --json
    """
    with store_view(path) as view:
        report = gather(view, namespaces=namespaces, top=top)
    emit(as_json, report, render)
