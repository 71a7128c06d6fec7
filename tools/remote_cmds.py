"""``ucm-db gc`` and ``ucm-db warm``: commands that delegate to other
modules (:func:`ucm_db.maintenance.gc_remote`, the store's warming API).
``ucm-db bench`` is :mod:`ucm_db.tools.cli_bench`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from ucm_db import ConfigError, maintenance
from ucm_db.keys import KEY_BYTES

from ucm_db.tools.cli_common import (
    EXIT_PROBLEMS, CliPath, ProgressBar, auth_options, emit, encryption_options, human_bytes, json_option, warn,
)
from ucm_db.tools.prompt_files import one_namespace, read_prompts, read_text

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration_s(text: str) -> float:
    """``"7d" -> 604800.0``; units s, m, h, d, w (default seconds)."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(f"cannot read duration {text!r}", hint="write e.g. 90s, 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _SECONDS[match.group(2)]


#: Longest size text read (a byte count of 40 digits is past any disk).
MAX_SIZE_CHARS = 48


def parse_size_bytes(text: str) -> int:
    """``"10GiB" -> 10737418240``, ``"500MB" -> 500000000``, ``"4096" -> 4096``,
    ``"1.5KiB" -> 1536``: in integer arithmetic (a float lost the last digits of
    ``9007199254740993``), a fraction of a byte dropped. A non-zero size that
    comes to 0 bytes (``0.5``) is refused: it meant something, never "nothing"."""
    match = _SIZE.match(text) if len(text) <= MAX_SIZE_CHARS else None  # int() refuses over 4300 digits
    if not match:
        shown = repr(text) if len(text) <= MAX_SIZE_CHARS else f"of {len(text)} characters"
        raise ConfigError(f"cannot read size {shown}", hint="write e.g. 4096, 500MB or 10GiB")
    whole, _, fraction = match.group(1).partition(".")
    unit = (match.group(2) or "").lower()
    power = " kmgt".index(unit) if unit else 0
    base = 1024 if match.group(3) else 1000
    size = int(whole + fraction) * base**power // 10 ** len(fraction)
    if size == 0 and int(whole + fraction) != 0:
        raise ConfigError(f"size {text!r} is less than one byte",
                          hint="write a whole number of bytes or a unit, e.g. 4096, 500MB or 10GiB")
    return size


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``("endpoint_url=http://x", "anon=true")`` -> fsspec keyword arguments."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--option {item!r} is not NAME=VALUE", hint="write e.g. --option endpoint_url=http://127.0.0.1:9000")
        out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


@click.command("gc")
@click.argument("remote")
@click.option("--older-than", default=None,
              help="Remove objects when neither they nor anything under them was written for this long (e.g. 7d, 12h).")
@click.option("--max-bytes", default=None,
              help="Remove the oldest chain tails until the remote holds at most this much, and no more (e.g. 500GiB).")
@click.option("--option", "options", multiple=True, help="fsspec option NAME=VALUE (endpoint_url, key, secret, ...); repeatable.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed without removing it.")
@json_option
def gc_command(remote: str, older_than: str | None, max_bytes: str | None, options: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Garbage-collect the remote tier at REMOTE (an fsspec URL): remove
    objects by age and/or down to a size, from the tails of their chains, so
    the remote keeps whole prefixes. An object counts as old only when
    nothing under it is young (a shared system prompt stays while
    conversations under it are written); --max-bytes removes the oldest
    tails first and stops once the remote fits. Objects whose parent is
    gone are removed too. Safe beside live servers. Only ucm-db's own
    objects are touched: files of its layout, in namespace directories with
    its manifest, that start like a ucm-db object. A remote that cannot be
    reached or read is an error naming it (exit 1); objects whose head
    cannot be read (an archive storage class, no read access, a flaky
    link) are kept and reported, the rest is collected, exit 1.

    \b
    Example:
        ucm-db gc s3://kv-cache/prod --older-than 14d --max-bytes 2TiB \\
            --option endpoint_url=http://minio:9000
    """
    if older_than is None and max_bytes is None:
        raise ConfigError("gc needs --older-than and/or --max-bytes", hint="e.g. ucm-db gc s3://b/p --older-than 7d")
    # `is not None`: an empty limit ("$AGE" unset) is refused as unreadable, never dropped.
    report = maintenance.gc_remote(remote, parse_options(options),
                                   older_than_s=None if older_than is None else parse_duration_s(older_than),
                                   max_bytes=None if max_bytes is None else parse_size_bytes(max_bytes), dry_run=dry_run)

    def human(r: dict[str, Any]) -> str:
        verb = "would remove" if r["dry_run"] else "removed"
        return (f"{r['remote']}: {r['objects_before']} objects, {human_bytes(r['bytes_before'])}; {verb} {r['removed_objects']} "
                f"({r['removed_by_rule']} by rule + {r['removed_descendants']} descendants), {human_bytes(r['removed_bytes'])}; "
                f"{r['temp_files_removed']} stale temp files; {r['skipped_entries']} entries not ucm-db's left alone"
                + (f"; {r['tombstones_removed']} of {r['tombstones']} retraction tombstones" if r.get("tombstones") else "")
                + (f"; {r['held_by_rule']} held: {r['held_reason']}" if r.get("held_namespaces") else "")
                + (f"; {r['unreadable']} unreadable kept: {'; '.join(r['unreadable_examples'])}" if r.get("unreadable") else "")
                + (f"; {r['max_bytes_shortfall_reason']}" if r.get("max_bytes_shortfall_reason") else ""))

    emit(as_json, report, human)
    if report.get("unreadable"):  # the rest is done; these objects (and what they may hang from) wait: exit 1
        warn(f"{report['unreadable']} object(s) on {remote} could not be read: {report['unreadable_hint']}")
        raise SystemExit(EXIT_PROBLEMS)


#: Byte-order marks a --tokens/--keys file may start with, longest first
#: (a UTF-32 LE mark begins with the UTF-16 LE one).
def read_chains(tokens_file: Path | None, keys_file: Path | None) -> tuple[list[list[int]] | None, list[list[bytes]] | None]:
    """Token sequences (JSON list per line) or key chains (hex keys per line)."""
    if (tokens_file is None) == (keys_file is None):
        raise ConfigError("warm needs exactly one of --tokens FILE or --keys FILE", hint="e.g. --tokens prompts.jsonl")
    if tokens_file is not None:
        return read_prompts(tokens_file), None
    assert keys_file is not None
    chains: list[list[bytes]] = []
    for number, line in enumerate(read_text(keys_file).splitlines(), 1):  # blank lines counted, as an editor counts them
        if not line.strip():
            continue
        try:
            chain = [bytes.fromhex(k) for k in line.split()]
        except ValueError as exc:
            raise ConfigError(f"cannot read {keys_file} line {number}: {exc}", hint="--keys: hex keys of one chain per line") from exc
        short = next((k for k in chain if len(k) != KEY_BYTES), None)
        if short is not None:
            raise ConfigError(f"cannot read {keys_file} line {number}: key {short.hex()[:16]!r} is {len(short)} bytes; "
                              f"block keys are {KEY_BYTES}", hint=f"--keys: {2 * KEY_BYTES} hex digits per key, one chain per line")
        chains.append(chain)
    return None, chains


def refuse_file_on_store_path(path: Path) -> None:
    """warm creates its store if needed: a file at PATH, or on the way to it,
    is a usage error (exit 2) as in every other command, not the TierError
    (exit 1) the store's open reports. A path that cannot be checked
    (permission denied on the way) is left to the open, which names it."""
    absolute = path.absolute()
    try:
        blocker = next((p for p in (absolute, *absolute.parents) if p.exists() and not p.is_dir()), None)
    except OSError:
        return
    if blocker is not None:
        where = "it is a file" if blocker == absolute else f"{blocker} on its path is a file"
        raise ConfigError(f"cannot warm into {path}: {where}, not a directory",
                          hint="pass a store directory (new or existing); a store is a directory")


@click.command("warm")
@click.argument("path", type=CliPath())
@click.option("--remote", required=True, help="fsspec URL of the remote tier to warm from.")
@click.option("--namespace", "namespace", required=True, multiple=True, callback=one_namespace,
              help="Namespace on the remote: id prefix or model name (once).")
@click.option("--tokens", "tokens_file", type=CliPath(exists=True, dir_okay=False), help="File of prompts: one JSON list of token ids per line.")
@click.option("--keys", "keys_file", type=CliPath(exists=True, dir_okay=False), help="File of chains: hex block keys of one chain per line.")
@click.option("--option", "options", multiple=True, help="fsspec option NAME=VALUE for the remote; repeatable.")
@auth_options("serve only remote objects they signed")
@encryption_options("read an encrypted remote and encrypt the queued uploads (required once the store used it encrypted)")
@json_option
def warm_command(path: Path, remote: str, namespace: str, tokens_file: Path | None, keys_file: Path | None,
                 options: tuple[str, ...], auth_key_file: Path | None, auth_key_env: str | None,
                 encryption_key_file: Path | None, encryption_key_env: str | None, as_json: bool) -> None:
    """Pull the blocks of the given prompts (or key chains) from the remote
    tier into the local store at PATH ahead of traffic (ucm_db.remote.warming).
    Prompts are keyed at the namespace's epoch, the higher of the store's
    and the remote's (a store whose epoch of it cannot be established is
    refused, exit 1), so an invalidated model's old blocks are never pulled.
    Opening the store starts its uploader: on an encrypted remote pass the
    fleet's encryption key (a store that used the remote encrypted refuses
    to open without one, exit 2). Blocks the remote failed to give (an
    error or a timeout) are reported as "failed" and exit 1: warm again.

    \b
    Example:
        ucm-db warm /var/cache/ucm-db --remote s3://kv-cache/prod \\
            --namespace Qwen/Qwen2.5-0.5B --tokens system_prompts.jsonl
    """

    import ucm_db

    refuse_file_on_store_path(path)
    tokens, keys = read_chains(tokens_file, keys_file)
    remote_options = parse_options(options)
    ns = maintenance.remote_namespace(remote, remote_options, namespace)
    key_settings = {"remote_auth_key_file": None if auth_key_file is None else str(auth_key_file), "remote_auth_key_env": auth_key_env,
            "remote_encryption_key_file": None if encryption_key_file is None else str(encryption_key_file),
            "remote_encryption_key_env": encryption_key_env}
    with ProgressBar(not as_json, "warming") as bar, ucm_db.open(path, remote=remote, remote_options=remote_options, **key_settings) as store:
        report = store.warm(ns, token_sequences=tokens, keys=keys, progress=bar)
    data = report.to_dict()  # the counts and their sum, "blocks" (distinct blocks named)
    emit(as_json, data, lambda d: "warmed: " + ", ".join(f"{k}={v}" for k, v in d.items()))
    if data.get("failed"):
        # The remote failed for some blocks (it may hold them): not a warm to rely on, so exit 1 after the report.
        warn(f"{data['failed']} block(s) not fetched: the remote {remote} failed or timed out; run warm again once it answers")
        raise SystemExit(EXIT_PROBLEMS)
