"""``ucm-db invalidate``: stop serving a model's stored KV (after a weight update).

Moves each chosen namespace's epoch on through
:func:`ucm_db.maintenance.invalidate`: engines find none of its old blocks
from their next lookup on, and the blocks age out through LRU eviction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import CliPath, emit, json_option


def render(report: dict[str, Any]) -> str:
    return "\n".join(
        f"namespace {row['namespace']} ({row['model']}): epoch {row['epoch']}; its older blocks are no longer served"
        for row in report["invalidated"]
    )


@click.command("invalidate")
@click.argument("path", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, required=True,
              help="Namespace id prefix or model name (repeatable); `ucm-db inspect` lists them. An empty one is refused (exit 2).")
@json_option
def invalidate_command(path: Path, namespaces: tuple[str, ...], as_json: bool) -> None:
    """Invalidate a model's stored KV blocks (e.g. after its weights
    changed): its namespace's epoch moves on, so running and future engines
    of that model never serve a block stored before. Nothing is deleted:
    the old blocks leave through LRU eviction (or `ucm-db compact
    --target-bytes`). A namespace whose epoch record was damaged or lost
    gets a fresh epoch, never a reused one. An empty --namespace (e.g. an
    unset "$MODEL") is a usage error (exit 2), never "every namespace".

    \b
    Example:
        ucm-db invalidate /var/cache/ucm-db --namespace 3f2a9c
    """
    emit(as_json, {"invalidated": maintenance.invalidate(path, namespaces)}, render)
