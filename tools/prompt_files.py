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


#: Token ids are uint32 (:meth:`ucm_db.Namespace.block_keys`' range).
MAX_TOKEN_ID = (1 << 32) - 1
TOKENS_HINT = "--tokens: one JSON list of token ids per line, e.g. [151644, 8948, 198]"


def read_prompts(source: Path) -> list[list[int]]:
    """Token sequences of a ``--tokens`` file: one JSON list of token ids per
    (non-empty) line. Each line is parsed on its own, and a bad one is a
    ConfigError naming the file and its line number (blank lines counted, as
    an editor counts them); so is a file without a token id (every command
    that reads one would do nothing and succeed)."""
    prompts: list[list[int]] = []
    for number, line in enumerate(read_text(source).splitlines(), 1):
        if not line.strip():
            continue
        try:
            tokens = json.loads(line)
        except ValueError as exc:  # a JSONDecodeError, or an integer too long to convert
            problem = f"column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise ConfigError(f"cannot read {source} line {number}: {problem}", hint=TOKENS_HINT) from exc
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ConfigError(f"cannot read {source} line {number}: not a JSON list of integers", hint=TOKENS_HINT)
        bad = next((t for t in tokens if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise ConfigError(f"cannot read {source} line {number}: token id {bad} is out of range (0 to 2**32 - 1)",
                              hint="pass the prompt's token ids as the tokenizer gave them")
        prompts.append(tokens)
    if not any(prompts):  # an empty file (a failed generator step) pinned, warmed or looked up nothing, exit 0
        raise ConfigError(f"{source} holds no prompts: no line with a token id",
                          hint=f"{TOKENS_HINT}; check the step that wrote the file")
    return prompts


NAMESPACE_HELP = "Namespace: id prefix or model name (`ucm-db inspect` lists them); exactly one must match."
TOKENS_HELP = "File of prompts: one JSON list of token ids per line (no LoRA, cache_salt or multimodal extras)."


def one_namespace(ctx: click.Context, _param: click.Parameter, given: tuple[str, ...]) -> str:
    """The one ``--namespace`` of pin/unpin/lookup/warm. Given twice, click kept
    the last and dropped the first without a word (`pin --namespace a
    --namespace b` pinned in b only)."""
    if len(given) > 1:
        raise ConfigError(f"{ctx.info_name} takes one --namespace, got {len(given)}: " + ", ".join(map(repr, given)),
                          hint=f"run `ucm-db {ctx.info_name}` once per namespace")
    return given[0]


def store_prompts_arguments(fn: Callable[..., Any]) -> Callable[..., Any]:
    """PATH, ``--namespace`` (exactly once) and ``--tokens`` of the commands
    that act on a store's prompts (pin, unpin, lookup)."""
    fn = click.option("--tokens", "tokens_file", required=True, type=CliPath(exists=True, dir_okay=False), help=TOKENS_HELP)(fn)
    fn = click.option("--namespace", required=True, multiple=True, callback=one_namespace, help=NAMESPACE_HELP)(fn)
    return click.argument("path", type=CliPath())(fn)
