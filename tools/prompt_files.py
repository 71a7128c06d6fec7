"""The prompt files the commands read (``--tokens``: one JSON list of token
ids per line; ``--keys``: hex keys of one chain per line), one reader for
every command: UTF-8, or UTF-8/16/32 with a byte-order mark, and a
ConfigError naming the file, the line and the fix for anything else."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ucm_db import ConfigError
from ucm_db.tools.cli_common import CliPath

_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def read_text(source: Path) -> str:
    """The text of a --tokens/--keys file: UTF-8, or UTF-8/16/32 with a
    byte-order mark (as Windows tools write); anything else is a ConfigError
    naming the file, the bad byte and the fix."""
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc}", hint="check the path and its permissions") from exc
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {source}: it is not valid {encoding.upper().replace('-SIG', '')} text "
                          f"(byte {exc.start}: {exc.reason})",
                          hint=f"save it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 {source} > fixed.txt); "
                          "UTF-16/32 is read only with a byte-order mark") from exc


def read_prompts(source: Path) -> list[list[int]]:
    """Token sequences of a ``--tokens`` file: one JSON list of token ids per
    (non-empty) line."""
    lines = [line for line in read_text(source).splitlines() if line.strip()]
    try:
        prompts = [json.loads(line) for line in lines]
    except ValueError as exc:
        raise ConfigError(f"cannot read {source}: {exc}", hint="--tokens: one JSON list of token ids per line") from exc
    for number, tokens in enumerate(prompts, 1):
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ConfigError(f"cannot read {source}: line {number} is not a JSON list of integers",
                              hint="--tokens: one JSON list of token ids per line, e.g. [151644, 8948, 198]")
    return prompts


NAMESPACE_HELP = "Namespace: id prefix or model name (`ucm-db inspect` lists them); exactly one must match."
TOKENS_HELP = "File of prompts: one JSON list of token ids per line (no LoRA, cache_salt or multimodal extras)."


def store_prompts_arguments(fn: Callable[..., Any]) -> Callable[..., Any]:
    """PATH, ``--namespace`` and ``--tokens`` of the commands that act on a
    store's prompts (pin, unpin, lookup)."""
    fn = click.option("--tokens", "tokens_file", required=True, type=CliPath(exists=True, dir_okay=False), help=TOKENS_HELP)(fn)
    fn = click.option("--namespace", required=True, help=NAMESPACE_HELP)(fn)
    return click.argument("path", type=CliPath())(fn)
