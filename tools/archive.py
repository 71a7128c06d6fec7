"""``ucm-db export`` / ``ucm-db import``: a portable archive of namespaces.

Archive format: an uncompressed tar (payloads are already compressed) of

* ``manifest.json`` first: ``{"format": "ucm-db-export", "version": 1,
  "created_ns", "ucm_db_version", "namespaces": {id hex: description},
  "blocks": [[key hex, parent hex | null, namespace id hex], ...]}``, with
  each namespace's blocks parent-first;
* ``blocks/<key hex>``: each block's encoded blob exactly as stored (codec
  header, owning key, checksum).

Import trusts nothing in the archive: each namespace description must hash
to its id, each blob must pass :func:`ucm_db.codec.verify` under its key,
and a block whose parent is missing or bad is skipped (prefix invariant).
Nothing is unpickled or evaluated; only JSON and codec blobs are read.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db import codec
from ucm_db.errors import ConfigError, CorruptBlockError, MissingAncestorError
from ucm_db.keys import Namespace
from ucm_db.tiers.base import Txn
from ucm_db.tiers.local import BlockEntry, BlockMeta

from ucm_db.tools.cli_common import EXIT_OK, EXIT_PROBLEMS, emit, json_option, progress, store_view
from ucm_db.tools.inspect_cmd import select_namespaces

ARCHIVE_FORMAT = "ucm-db-export"
ARCHIVE_VERSION = 1
#: Blocks per read transaction on export and per put on import.
CHUNK_BLOCKS = 256
_MAX_MANIFEST_BYTES = 1 << 30


def export_store(path: Path, archive: Path, namespaces: tuple[str, ...], show_progress: bool) -> dict[str, Any]:
    from ucm_db import __version__

    with store_view(path) as view:
        selected = select_namespaces(view, namespaces)
        descriptions = view.tier.namespace_descriptions()

        def listing(txn: Txn) -> list[tuple[bytes, BlockMeta]]:
            metas = ((k, BlockMeta.unpack(v)) for k, v in txn.scan("meta"))
            return [(k, m) for k, m in metas if selected is None or m.namespace_id in selected]

        blocks = sorted(view.engine.read(listing), key=lambda km: (km[1].namespace_id, km[1].depth, km[0]))
        used = sorted({m.namespace_id for _, m in blocks} | (selected or set()))
        manifest = {
            "format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION, "created_ns": time.time_ns(), "ucm_db_version": __version__,
            "namespaces": {ns.hex(): descriptions.get(ns, {}) for ns in used},
            "blocks": [[k.hex(), m.parent.hex() if m.parent else None, m.namespace_id.hex()] for k, m in blocks],
        }
        stored = 0
        with tarfile.open(archive, "w") as tar, progress(show_progress, len(blocks), "exporting") as bar:
            _add(tar, "manifest.json", json.dumps(manifest).encode())
            for start in range(0, len(blocks), CHUNK_BLOCKS):
                keys = [k for k, _ in blocks[start : start + CHUNK_BLOCKS]]
                blobs = [blob or b"" for blob in view.tier.read_blobs(keys)]
                for key, blob in zip(keys, blobs):
                    _add(tar, f"blocks/{key.hex()}", blob)
                    stored += len(blob)
                bar.update(len(keys))
    return {"archive": str(archive), "blocks": len(blocks), "stored_bytes": stored, "namespaces": manifest["namespaces"]}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def read_manifest(tar: tarfile.TarFile, archive: Path) -> dict[str, Any]:
    try:
        member = tar.getmember("manifest.json")
    except KeyError as exc:
        raise ConfigError(f"{archive} has no manifest.json", hint="pass an archive written by ucm-db export") from exc
    if member.size > _MAX_MANIFEST_BYTES:
        raise ConfigError(f"{archive}: manifest of {member.size} bytes is implausible", hint="the archive is damaged")
    try:
        manifest = json.loads(_member_bytes(tar, member))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{archive}: manifest.json is not valid JSON: {exc}", hint="the archive is damaged") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT or manifest.get("version") != ARCHIVE_VERSION:
        raise ConfigError(f"{archive} is not a ucm-db export of version {ARCHIVE_VERSION}", hint="export it again with this ucm-db")
    for ns_hex, desc in manifest["namespaces"].items():
        try:
            digest = Namespace.from_dict(desc).digest[:16].hex()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{archive}: namespace {ns_hex} has an invalid description: {exc}", hint="the archive is damaged") from exc
        if digest != ns_hex:
            raise ConfigError(f"{archive}: namespace {ns_hex} does not match its description (hashes to {digest})",
                              hint="the archive was altered; export it again")
    return manifest


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise ConfigError(f"archive member {member.name} is not a file", hint="the archive is damaged")
    return handle.read()


def import_archive(archive: Path, path: Path, show_progress: bool) -> dict[str, Any]:
    import ucm_db

    report: dict[str, Any] = {"archive": str(archive), "stored": 0, "already_present": 0, "skipped": []}
    with tarfile.open(archive, "r:") as tar:
        manifest = read_manifest(tar, archive)
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        with ucm_db.open(path) as store, progress(show_progress, len(manifest["blocks"]), "importing") as bar:
            good: set[bytes] = set()
            batch: list[BlockEntry] = []
            batch_ns = b""
            for key_hex, parent_hex, ns_hex in manifest["blocks"]:
                key, parent, ns_id = bytes.fromhex(key_hex), bytes.fromhex(parent_hex) if parent_hex else None, bytes.fromhex(ns_hex)
                entry, reason = _checked_entry(tar, members, key, parent, ns_id, good, manifest)
                if entry is None:
                    report["skipped"].append({"key": key_hex, "reason": reason})
                elif batch and (ns_id != batch_ns or len(batch) >= CHUNK_BLOCKS):
                    _put(store, batch, manifest, report)
                    batch = [entry]
                else:
                    batch.append(entry)
                if entry is not None:
                    good.add(key)
                    batch_ns = ns_id
                bar.update(1)
            _put(store, batch, manifest, report)
    return report


def _checked_entry(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], key: bytes, parent: bytes | None,
    ns_id: bytes, good: set[bytes], manifest: dict[str, Any],
) -> tuple[BlockEntry | None, str]:
    if ns_id.hex() not in manifest["namespaces"]:
        return None, "namespace not described in the manifest"
    if parent is not None and parent not in good:
        return None, "parent block missing or bad"
    member = members.get(f"blocks/{key.hex()}")
    if member is None:
        return None, "payload missing from the archive"
    if member.size > codec.MAX_RAW_BYTES:
        return None, "payload implausibly large"
    blob = _member_bytes(tar, member)
    try:
        header = codec.verify(blob, key)
    except CorruptBlockError as exc:
        return None, f"corrupt: {exc}"
    return BlockEntry.of_blob(key, parent, blob, header.raw_len, ns_id), ""


def _put(store: Any, batch: list[BlockEntry], manifest: dict[str, Any], report: dict[str, Any]) -> None:
    if not batch:
        return
    ns_hex = batch[0].namespace_id.hex()
    desc = (batch[0].namespace_id, json.dumps(manifest["namespaces"][ns_hex], sort_keys=True).encode())
    try:
        result = store.tier.put_blocks(batch, namespace_desc=desc)
    except MissingAncestorError:
        # A parent put earlier was evicted meanwhile: the store is too small.
        report["skipped"] += [{"key": e.key.hex(), "reason": "parent evicted during import (capacity too small)"} for e in batch]
        return
    report["stored"] += result.stored
    report["already_present"] += result.already_present


@click.command("export")
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable. Default: all.")
@json_option
def export_command(path: Path, archive: Path, namespaces: tuple[str, ...], as_json: bool) -> None:
    """Write the blocks of chosen namespaces to a portable tar ARCHIVE
    (JSON manifest + encoded blocks). Read-only on the store.

    \b
    Example:
        ucm-db export /var/cache/ucm-db qwen.tar --namespace Qwen/Qwen2.5-0.5B
    """
    report = export_store(path, archive, namespaces, show_progress=not as_json)
    emit(as_json, report, lambda r: f"exported {r['blocks']} blocks ({r['stored_bytes']} bytes) of {len(r['namespaces'])} namespace(s) to {r['archive']}")


@click.command("import")
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def import_command(archive: Path, path: Path, as_json: bool) -> None:
    """Load an ARCHIVE written by `ucm-db export` into the store at PATH
    (created if missing). Every block is verified; bad ones and their
    descendants are skipped and reported (exit status 1).

    \b
    Example:
        ucm-db import qwen.tar /var/cache/ucm-db
    """
    report = import_archive(archive, path, show_progress=not as_json)

    def human(r: dict[str, Any]) -> str:
        lines = [f"imported {r['stored']} blocks ({r['already_present']} already present), skipped {len(r['skipped'])}"]
        return "\n".join(lines + [f"  skipped {s['key'][:16]}: {s['reason']}" for s in r["skipped"]])

    emit(as_json, report, human)
    raise SystemExit(EXIT_PROBLEMS if report["skipped"] else EXIT_OK)
