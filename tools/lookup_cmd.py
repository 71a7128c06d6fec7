"""``ucm-db lookup``: how much of each prompt a store holds, as a router
asks it (:func:`ucm_db.maintenance.lookup`, :meth:`ucm_db.Store.lookup_many`).

The store is opened read-only and nothing is written or touched: a probe is
not a use (no LRU recency, no hit counts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import ConfigError, maintenance

from ucm_db.tools.cli_common import emit, json_option
from ucm_db.tools.pin_cmds import units_text
from ucm_db.tools.prompt_files import read_prompts, store_prompts_arguments


def parse_partition(text: str | None) -> list[int] | None:
    """``"14,14"`` -> ``[14, 14]`` (layers per pipeline stage), each at least
    1. Checked here whatever the namespace: a namespace of whole blocks has
    no use for a partition, and ignored a malformed one without a word."""
    if text is None:
        return None
    hint = "e.g. --layer-partition 14,14 for 28 layers over two pipeline stages"
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--layer-partition {text!r} is not a comma-separated list of layer counts", hint=hint) from exc
    if any(count < 1 for count in counts):
        raise ConfigError(f"--layer-partition {text!r}: each pipeline stage has at least 1 layer", hint=hint)
    return counts


def render(r: dict[str, Any]) -> str:
    lines = [f"namespace {r['namespace']} ({r['model']}), epoch {r['epoch']}, block size {r['block_size']}, {units_text(r)}"]
    for i, p in enumerate(r["prompts"], 1):
        lines.append(f"  prompt {i}: {p['tokens']} tokens, {p['blocks']} blocks; stored {p['stored_blocks']} blocks "
                     f"({p['stored_tokens']} tokens)")
    lines.append(f"{len(r['prompts'])} prompts looked up in {r['lookup_s'] * 1e3:.2f} ms (one read transaction)")
    return "\n".join(lines)


@click.command("lookup")
@store_prompts_arguments
@click.option("--layer-partition", default=None,
              help="Layers per pipeline stage of the deployment that wrote a store of units (e.g. 14,14); default one stage.")
@json_option
def lookup_command(path: Path, namespace: str, tokens_file: Path, layer_partition: str | None, as_json: bool) -> None:
    """Print each prompt's stored prefix in the local store at PATH, in
    blocks and tokens, from one read transaction (the remote tier is not
    asked). Prompts are keyed at the namespace's epoch, as `ucm-db warm
    --tokens` keys them. In a store written by the vLLM connector a block
    counts only when every KV head's unit is stored: the prefix an engine
    on this store (at any TP size) would load. Read-only: writes nothing,
    touches nothing.

    \b
    Example:
        ucm-db lookup /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B --tokens prompts.jsonl --json
    """
    partition = parse_partition(layer_partition)
    report = maintenance.lookup(path, namespace, read_prompts(tokens_file), layer_partition=partition)
    emit(as_json, report, render)
