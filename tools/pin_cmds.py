"""``ucm-db pin`` and ``ucm-db unpin``: keep prompts' stored KV out of
eviction (a system prompt, a few-shot preamble), and let it go again.

The work is :func:`ucm_db.maintenance.pin` / :func:`~ucm_db.maintenance.unpin`
(:meth:`ucm_db.Store.pin`); this module reads the prompts and renders the
report. The prompt file is read as ``ucm-db warm --tokens`` reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import emit, human_bytes, json_option, warn
from ucm_db.tools.prompt_files import read_prompts, store_prompts_arguments
from ucm_db.tools.remote_cmds import parse_size_bytes


def units_text(r: dict[str, Any]) -> str:
    u = r.get("units")
    if not u:
        return "whole blocks"
    return f"units: {u['kv_heads']} KV heads x {len(u['stages'])} stage(s) of {u['layers']} layers, {u['units_per_block']} per block"


def render(r: dict[str, Any], verb: str) -> str:
    lines = [f"namespace {r['namespace']} ({r['model']}), epoch {r['epoch']}, block size {r['block_size']}, {units_text(r)}"]
    for i, p in enumerate(r["prompts"], 1):
        lines.append(f"  prompt {i}: {p['tokens']} tokens, {p['blocks']} blocks; {p['pinned_blocks']} blocks "
                     f"({p['pinned_tokens']} tokens) pinned")
    lines.append(f"{verb} {r['changed_blocks']} stored blocks ({human_bytes(r['changed_bytes'])}); the namespace has "
                 f"{r['namespace_blocks']} pinned ({human_bytes(r['namespace_bytes'])}), the store "
                 f"{human_bytes(r['store_bytes'])} of max_pinned_bytes {human_bytes(r['max_pinned_bytes'])}")
    return "\n".join(lines)




@click.command("pin")
@store_prompts_arguments
@click.option("--max-pinned-bytes", default=None,
              help="Cap on the store's pinned bytes for this pin (e.g. 4GiB); default: the max_pinned_bytes default, half the capacity.")
@json_option
def pin_command(path: Path, namespace: str, tokens_file: Path, max_pinned_bytes: str | None, as_json: bool) -> None:
    """Pin the stored KV of the given prompts: their blocks (and every
    block before them) are never evicted until `ucm-db unpin`. Prompts are
    keyed at the namespace's epoch, as `ucm-db warm --tokens` keys them; in
    a store written by the vLLM connector every KV head's unit is pinned.
    What is stored now is pinned (store it first by serving the prompt);
    pinning a prompt again adds no second pin. Pins survive restarts and
    `compact`; `ucm-db invalidate` releases them (an invalidate between
    reading the epoch and pinning refuses the pin, exit 1: run it again).
    A pin that would pass max_pinned_bytes is refused (exit 1), pinning
    nothing.

    \b
    Example:
        ucm-db pin /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B --tokens system_prompts.jsonl
    """
    cap = None if max_pinned_bytes is None else parse_size_bytes(max_pinned_bytes)
    prompts = read_prompts(tokens_file)
    report = maintenance.pin(path, namespace, prompts, max_pinned_bytes=cap)
    for number, row in enumerate(report["prompts"], 1):
        if not row["blocks"]:
            warn(f"prompt {number} of {tokens_file} has {row['tokens']} tokens, less than one block of {report['block_size']}: "
                 "nothing of it can be pinned")
    emit(as_json, report, lambda r: render(r, "pinned"))


@click.command("unpin")
@store_prompts_arguments
@json_option
def unpin_command(path: Path, namespace: str, tokens_file: Path, as_json: bool) -> None:
    """Take back the pins the given prompts made (give them as pinned):
    their blocks are evicted as any others again (least recently used
    first), except where another prompt's pin still holds them: a system
    prompt pinned on its own stays pinned when a conversation continuing
    it is unpinned, and the other way round (the report shows what stays
    pinned).

    \b
    Example:
        ucm-db unpin /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B --tokens system_prompts.jsonl
    """
    report = maintenance.unpin(path, namespace, read_prompts(tokens_file))
    for number, row in enumerate(report["prompts"], 1):
        if row["pinned_blocks"]:
            warn(f"prompt {number} of {tokens_file} stays pinned ({row['pinned_blocks']} blocks): another prompt's pin "
                 "holds them, and a pin is taken back only by the prompt that made it, given as it was pinned "
                 "(`ucm-db inspect` shows the pinned bytes; `ucm-db invalidate` releases every pin of the namespace)")
    emit(as_json, report, lambda r: render(r, "unpinned"))
