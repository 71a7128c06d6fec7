"""``ucm-db inspect``: what a store holds, how full it is and how it is used.

The figures come from :func:`ucm_db.maintenance.inspect`, which reads the
store without writing to it; this module renders them.
"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import EXIT_OK, EXIT_PROBLEMS, CliPath, emit, human_bytes, json_option, table


#: Free fraction of the data file above which inspect suggests ``compact``.
COMPACT_HINT_FREE_FRACTION = 0.5


def _free_pages(r: dict[str, Any]) -> str:
    free, total = r.get("file_free_bytes"), r["file_bytes"]
    if free is None or not total:
        return ""
    text = f" ({human_bytes(free)} free pages, {free / total:.0%})"
    if free / total >= COMPACT_HINT_FREE_FRACTION:
        text += f": `ucm-db compact {r['path']}` returns them (a long free list slows puts of large blocks)"
    return text


def _epoch(row: dict[str, Any]) -> str:
    epoch = row.get("epoch", 0)
    return "unknown" if epoch is None else str(epoch)


#: Description fields shown as the namespace's identity, in this order.
_IDENTITY_FIELDS = ("model", "kv_dtype", "block_size", "layout", "kv_heads", "head_size", "layers", "use_mla")


def identity_words(description: dict[str, Any]) -> str:
    """A namespace's identity in plain words: the model (a content digest
    for the connector's namespaces), KV dtype, block size, layout, and the
    inputs that change the KV which the connector records in ``extra``
    (dtype, quantization, hf_overrides, RoPE, max_model_len ...)."""
    parts = [f"{name}={description[name]}" for name in _IDENTITY_FIELDS if description.get(name) not in (None, "", 0)]
    extra = description.get("extra")
    if extra:
        try:
            decoded = json.loads(extra) if isinstance(extra, str) else extra
        except ValueError:
            decoded = extra
        if isinstance(decoded, dict):
            parts += [f"{key}={json.dumps(value, sort_keys=True, separators=(',', ':'))}" for key, value in sorted(decoded.items())]
        else:
            parts.append(f"extra={extra}")
    return "; ".join(parts)


def render(r: dict[str, Any]) -> str:
    """The human report."""
    fmt = f"{r['format_version']}" + ("" if not r["pending_migrations"] else f" (pending: {', '.join(r['pending_migrations'])}; run `ucm-db migrate {r['path']}`)")
    created = r["created"] or {}
    use = f"{r['use_fraction'] * 100:.1f}%" if r["use_fraction"] is not None else "?"
    lines = [
        f"store          {r['path']}",
        f"engine         {r['engine']}   format {fmt}   created by ucm-db {created.get('ucm_db_version') or 'unknown'}",
        "settings       " + ", ".join(f"{k}={v}" for k, v in sorted(r["settings"].items())),
        f"capacity       {human_bytes(r['capacity_bytes'])}, used {human_bytes(r['stored_bytes'])} ({use}); files {human_bytes(r['file_bytes'])}"
        + _free_pages(r),
        f"blocks         {r['blocks']}   raw {human_bytes(r['raw_bytes'])} -> stored {human_bytes(r['stored_bytes'])} (ratio {r['compression_ratio']:.2f}x)",
        f"activity       hits {r['hits']}, misses {r['misses']}, evictions {r['evictions']}",
        f"pinned         {human_bytes(r.get('pinned_bytes', 0))} (never evicted; `ucm-db unpin` releases)",
        f"quarantine     {r['quarantine_records']} records ({r['quarantined_total']} blocks quarantined ever)",
        f"uploads        {r['pending_uploads']} pending   remote {r['remote'] or 'not recorded in the store'}"
        + (f"   remote codec {r['remote_codec'].get('codec')} ({r['remote_codec'].get('setting')})" if r.get("remote_codec") else ""),
        "",
    ]
    rows = [[n["id"][:16], n["model"], n["kv_dtype"], n["block_size"], n["rank"], n["read_at"], _epoch(n), n["blocks"],
             human_bytes(n["stored_bytes"]), human_bytes(n.get("pinned_bytes", 0)),
             f"{n['last_use_age_s']:.0f} s ago" if n["last_use_age_s"] is not None else "-"]
            for n in r["namespaces"]]
    lines.append(table(["namespace", "model", "dtype", "block", "rank", "read at", "epoch", "blocks", "stored", "pinned", "last use"], rows))
    identities = [(n["id"][:16], identity_words(n.get("description") or {})) for n in r["namespaces"]]
    if any(words for _, words in identities):
        lines.append("\nwhat each namespace's keys name (besides the tokens and the epoch):")
        lines.extend(f"  {ns_id}  {words}" for ns_id, words in identities if words)
    for name, hist in r["histograms"].items():
        lines.append(f"\n{name.replace('_', ' ')}:")
        lines.extend(f"  {label:<10} {count}" for label, count in hist.items())
    if "hottest_chains" in r:
        lines.append("\nhottest chains:")
        rows = [[c["first_block"][:16], c["namespace"][:16], c["hits"], c["blocks"], c["longest_blocks"], human_bytes(c["stored_bytes"])]
                for c in r["hottest_chains"]]
        lines.append(table(["first block", "namespace", "hits", "blocks", "longest", "stored"], rows))
    if r.get("damaged_records"):
        lines.append("\ndamaged records (run `ucm-db verify` for a full report):")
        lines.extend(f"  {d}" for d in r["damaged_records"])
    if r.get("epoch_problems"):
        lines.append("\nnamespaces not served (their epoch cannot be established; never read as 0):")
        lines.extend(f"  {p}" for p in r["epoch_problems"])
    if r.get("parent_cycles"):
        lines.append(f"\nparent cycles: {len(r['parent_cycles'])} blocks name themselves or a descendant as parent "
                     "(damaged metadata; `ucm-db verify --fix` quarantines them): "
                     + ", ".join(k[:16] for k in r["parent_cycles"][:8]))
    return "\n".join(lines)


@click.command("inspect")
@click.argument("path", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable.")
@click.option("--top", type=click.IntRange(min=0), default=0, help="Also list the N hottest chains.")
@json_option
def inspect_command(path: Path, namespaces: tuple[str, ...], top: int, as_json: bool) -> None:
    """Show what a store holds: format, engine, settings, capacity and use,
    blocks and compression, pinned bytes (per namespace too), namespaces,
    age and hit histograms, quarantine, pending uploads. Read-only: safe beside a running server. Exit status
    1 when a namespace's epoch cannot be established (a damaged or lost
    epoch record: the namespace is not served until `ucm-db invalidate`) or
    a format record (version, settings, creation) is damaged (`ucm-db verify
    --fix` repairs what it can tell).

    \b
    Example:
        ucm-db inspect /var/cache/ucm-db --top 5
        ucm-db inspect /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B --json
    """
    report = maintenance.inspect(path, namespaces=namespaces, top=top, isolated=True)
    emit(as_json, report, render)
    raise SystemExit(EXIT_PROBLEMS if report.get("epoch_problems") or report.get("damaged_records") else EXIT_OK)
