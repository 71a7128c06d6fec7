"""``ucm-db compact``: evict to a target, drop dead records, shrink the files.

The steps and their safety beside live processes are
:func:`ucm_db.maintenance.compact`'s; this module renders the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import CliPath, ProgressBar, emit, human_bytes, json_option, warn
from ucm_db.tools.remote_cmds import parse_size_bytes


def render(r: dict[str, Any]) -> str:
    lines = [
        f"blocks        {r['blocks_before']} -> {r['blocks_after']} ({r['evicted_blocks']} evicted)",
        f"stored bytes  {human_bytes(r['stored_bytes_before'])} -> {human_bytes(r['stored_bytes_after'])}",
        f"file bytes    {human_bytes(r['file_bytes_before'])} -> {human_bytes(r['file_bytes_after'])} ({r['rewrite']})",
        f"dropped       {r['quarantine_records_dropped']} quarantine records, orphans "
        + ", ".join(f"{t} {n}" for t, n in r["orphans_dropped"].items()),
    ]
    if r.get("parentless_quarantined"):
        lines.append(f"quarantined   {r['parentless_quarantined']} blocks whose parent is missing (with descendants)")
    lines += [f"index problem: {p}" for p in r["index_problems"]]
    return "\n".join(lines)


@click.command("compact")
@click.argument("path", type=CliPath())
@click.option("--target-bytes", default=None, help="Evict LRU blocks until at most this many stored bytes remain (e.g. 50GB, 10GiB).")
@click.option("--require-exclusive", is_flag=True, help="Refuse (exit 2) instead of working beside processes that have the store open.")
@json_option
def compact_command(path: Path, target_bytes: str | None, require_exclusive: bool, as_json: bool) -> None:
    """Reclaim space: evict to --target-bytes, drop quarantine records and
    orphaned entries, and rewrite the LMDB file compactly (atomic switch).
    Beside live processes only the transactional steps run and the file
    rewrite is skipped with a warning naming them.

    \b
    Example:
        ucm-db compact /var/cache/ucm-db --target-bytes 50GB
    """
    target = None if target_bytes is None else parse_size_bytes(target_bytes)  # sizes as pin and gc take them
    with ProgressBar(not as_json, "evicting") as bar:
        report = maintenance.compact(path, target_bytes=target, require_exclusive=require_exclusive, progress=bar)
    if report["rewrite_skipped_because"]:
        warn(f"file not rewritten: {report['rewrite_skipped_because']}")
    emit(as_json, report, render)
    raise SystemExit(1 if report["index_problems"] else 0)
