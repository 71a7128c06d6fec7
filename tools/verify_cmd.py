"""``ucm-db verify``: decode and checksum every stored block (or a sample).

The check and the repair are :func:`ucm_db.maintenance.verify`; this module
renders the report and sets the exit status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import EXIT_OK, EXIT_PROBLEMS, CliPath, ProgressBar, emit, json_option


def render(r: dict[str, Any]) -> str:
    lines = [f"checked {r['checked']} blocks ({r['raw_bytes']} raw bytes): {len(r['corrupt'])} corrupt"]
    lines += [f"  corrupt {c['key']}: {c['reason']}" for c in r["corrupt"]]
    lines += [f"  index: {p}" for p in r["index_problems"]]
    if r["quarantined_blocks"]:
        lines.append(f"quarantined {r['quarantined_blocks']} blocks (corrupt ones and their descendants)")
    elif r["corrupt"]:
        lines.append("run again with --fix to quarantine them (they are served as misses meanwhile)")
    if r.get("index_repaired"):
        done = sorted(r["index_repaired"].items())
        lines.append("repaired the index: " + ", ".join(f"{kind.replace('_', ' ')} {n}" for kind, n in done))
    if r.get("index_repaired", {}).get("descriptions_lost"):
        lines.append("namespace descriptions that could not be rebuilt were replaced by a placeholder: those namespaces "
                     "are listed undescribed until their next put records the description again")
    if r["totals_recomputed"]:
        lines.append("recomputed the store's totals from the block metadata")
    if r["feed_repaired"]:
        lines.append("repaired the change feed (event followers resync once)")
    if r.get("epochs_renewed"):
        lines.append(f"recorded a fresh epoch for {r['epochs_renewed']} namespaces whose epoch was lost "
                     "(their older blocks are never served again)")
    return "\n".join(lines)


@click.command("verify")
@click.argument("path", type=CliPath())
@click.option("--sample", type=click.IntRange(min=1), default=None, help="Check N blocks chosen at random instead of all.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed of --sample.")
@click.option("--fix", is_flag=True,
              help="Quarantine the corrupt blocks found, recompute wrong totals and repair the change feed (writes to the store).")
@json_option
def verify_command(path: Path, sample: int | None, seed: int, fix: bool, as_json: bool) -> None:
    """Decode and checksum every block (or a --sample) and report corrupt
    ones; exit status 1 if any. Read-only unless --fix.

    \b
    Example:
        ucm-db verify /var/cache/ucm-db
        ucm-db verify /var/cache/ucm-db --sample 1000 --fix
    """
    with ProgressBar(not as_json, "verifying") as bar:
        report = maintenance.verify(path, sample=sample, seed=seed, fix=fix, progress=bar, isolated=True)
    emit(as_json, report.to_dict(), render)
    # Found problems are reported by the exit status even when --fix handled them.
    raise SystemExit(EXIT_PROBLEMS if report.problems else EXIT_OK)
