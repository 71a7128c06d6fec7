"""Portable archives of namespaces: export from a store, import into one.

Archive format: an uncompressed tar (payloads are already compressed) of

* ``manifest.json`` first: ``{"format": "ucm-db-export", "version": 2,
  "created_ns", "ucm_db_version", "namespaces": {id hex: description},
  "epochs": {id hex: epoch},
  "blocks": [[key hex, parent hex | null, namespace id hex], ...]}``, with
  each namespace's blocks parent-first; ``epochs`` is each namespace's
  invalidation epoch (:mod:`ucm_db.maintenance.archive.epochs`: import
  records the higher of it and the store's before writing a block; an
  archive of version 1, without epochs, is still imported, lowering and
  raising nothing);
* ``blocks/<key hex>``: each block's encoded blob exactly as stored (codec
  header, owning key, checksum);
* with an auth key, ``manifest.auth`` last: MACs of the manifest and of
  each block (:mod:`ucm_db.maintenance.archive.macs`);
* with an encryption key, version 3: each block member sealed (AES-256-GCM)
  and the manifest's ``encryption`` field (:mod:`ucm_db.maintenance.archive.sealed`).

The manifest's checks are :mod:`ucm_db.maintenance.archive.manifest`'s; how
export reads the members beside live writers (a block evicted meanwhile is
left out with its descendants, and its row dropped from the manifest) is
:mod:`ucm_db.maintenance.archive.members`'.

Invariants:
    * Import trusts nothing in the archive: the manifest's shape is checked
      before anything is written, each namespace description must hash to
      its id, each blob must pass :func:`ucm_db.codec.verify` under its key,
      and a block whose parent is missing or bad is skipped (prefix
      invariant). Only JSON and codec blobs are read; nothing is unpickled.
    * Import only adds blocks, and by default evicts nothing: when the
      archive's new blocks (those not already stored, counted at their
      stored size) do not fit in the store's free capacity, it refuses with
      StoreFullError before writing anything. With ``allow_evict=True`` it
      goes on and LRU-evicts what it must (``report["evicted"]`` counts
      them). A concurrent writer's puts may still evict, as they always can.
    * Import reads bounded bytes: the manifest at most
      :data:`MAX_MANIFEST_BYTES` and :data:`~ucm_db.maintenance.archive.files.MAX_MANIFEST_DEPTH`
      deep, each block member at most :data:`MAX_MEMBER_BYTES` (read in
      chunks; a larger one is skipped), each put batch at most
      :data:`BATCH_BYTES` (plus one member); only regular members are read.
    * Export writes whole blocks that verify under their keys only, each
      with its parent before it, and the manifest lists exactly the blocks
      written (``left_out`` counts those gone while it ran or corrupt,
      ``corrupt`` names the corrupt ones: :mod:`ucm_db.maintenance.archive.members`).
    * Export never replaces anything but a regular file, writes a temp file
      beside the archive (``O_EXCL | O_NOFOLLOW``, the store's permissions),
      and renames it into place when complete (:mod:`ucm_db.maintenance.archive.files`), so
      a failed export leaves no truncated archive behind; the temp file of
      one killed mid-write is removed by the next export to that directory
      (:mod:`ucm_db.maintenance.archive.temps`). It refuses a store
      whose manifest or blocks would exceed the bounds import applies.
    * Import with an auth key accepts only what that key (or another of the
      keys given) signed (:mod:`ucm_db.maintenance.archive.macs`); export with a key
      adds ``manifest.auth``.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from ucm_db import codec
from ucm_db.maintenance.archive.epochs import adopt_epochs, carried_epochs, export_epochs
from ucm_db.maintenance.archive.macs import AUTH_MEMBER, ArchiveSigner, ArchiveVerifier
from ucm_db.maintenance.archive.members import ExportMembers, check_export_format, rewrite_in_place
from ucm_db.maintenance.archive.sealed import SEALED_ARCHIVE_VERSION, ArchiveOpener, ArchiveSealer, archive_opener
from ucm_db.maintenance.archive.files import (
    BoundedTarInfo, atomic_output, check_archive_end, check_import_target, check_target, read_member, store_file_mode,
)
from ucm_db.maintenance.archive.manifest import (  # noqa: F401 - the format's names, re-exported
    ARCHIVE_FORMAT, ARCHIVE_VERSION, DAMAGED as _DAMAGED, MAX_MANIFEST_BYTES, READABLE_VERSIONS, check_manifest, read_manifest,
)
from ucm_db.arguments import require_namespace_selectors
from ucm_db.auth import load_keys
from ucm_db.errors import ConfigError, CorruptBlockError, MissingAncestorError, StoreFullError
from ucm_db.keys import Namespace
from ucm_db.remote.sealing import load_sealing_keys
from ucm_db.store.view import ProgressFn, open_view, select_namespaces
from ucm_db.index import provisional as provisional_marks
from ucm_db.index.namespace_guard import ForeignNamespaceError
from ucm_db.store.epochs import EpochUnknownError

#: Blocks per read transaction on export and per put on import.
CHUNK_BLOCKS = 256
#: Largest block member import reads (export refuses a store with a larger block).
MAX_MEMBER_BYTES = 512 << 20
#: Bytes of blobs gathered before one put on import (one member may overshoot).
BATCH_BYTES = 256 << 20
_Block = tuple[bytes, bytes | None, bytes | bytearray]  # key, parent, blob: what Store.put_encoded takes


def _settled(view: Any, blocks: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """``blocks`` (parents first) but the provisional ones and their
    descendants (:mod:`ucm_db.store.provisional`): their writer may still
    take them back, or died before it could (a read-only view never sweeps)."""
    left_out = view.tier.engine.read(provisional_marks.marked_keys)
    if not left_out:
        return blocks
    kept = []
    for key, meta in blocks:
        if key in left_out or meta.parent in left_out:
            left_out.add(key)
        else:
            kept.append((key, meta))
    return kept


def _check_manifest_size(path: str | Path, manifest_bytes: int) -> None:
    if manifest_bytes > MAX_MANIFEST_BYTES:
        raise ConfigError(f"the manifest of this export would be {manifest_bytes} bytes, over the {MAX_MANIFEST_BYTES} "
                          "bytes import reads", hint=f"export fewer namespaces per archive (--namespace) from {path}")


def _check_block_size(key: bytes, blob_bytes: int) -> None:
    if blob_bytes > MAX_MEMBER_BYTES:
        raise ConfigError(f"block {key.hex()[:16]} is {blob_bytes} bytes, over the {MAX_MEMBER_BYTES} bytes import reads "
                          "per block", hint="export the other namespaces (--namespace); such a block cannot be imported")


def export_archive(path: str | Path, archive: str | Path, namespaces: tuple[str, ...] = (),
                   progress: ProgressFn | None = None, *, auth_key_file: str | Path | None = None,
                   auth_key_env: str | None = None, encryption_key_file: str | Path | None = None,
                   encryption_key_env: str | None = None) -> dict[str, Any]:
    """Writes the blocks of ``namespaces`` (all by default) of the store at
    ``path`` to the tar ``archive``; read-only on the store. With an auth
    key (a key file and/or an environment variable, :mod:`ucm_db.auth`)
    the archive carries MACs made with the first key; with an encryption
    key its blocks are encrypted with the first (version 3). Returns
    counts: ``blocks`` written, ``left_out`` (gone while it ran or corrupt,
    with their descendants), ``stored_bytes``; ``corrupt`` (key hex and
    reason of each block left out as corrupt); and the namespaces and their
    epochs.

    Raises:
        ConfigError: ``archive`` exists and is not a regular file (a
            symlink, directory, FIFO or device: never replaced), its
            directory is missing, the export would exceed import's bounds,
            a namespace's epoch is at or above the ceiling import takes
            (:mod:`ucm_db.maintenance.archive.epochs`), or a namespace
            selector is empty.
        TierError: writing the archive failed (it is left as it was).
        EpochUnknownError: (a TierError) an exported namespace's epoch
            cannot be established (nothing written).
        FormatVersionError: the store is of a newer format than this
            ucm-db's (nothing written).
    """
    from ucm_db.version import __version__

    namespaces = require_namespace_selectors(namespaces, "export")
    archive = Path(archive)
    auth_keys = load_keys(auth_key_file, auth_key_env)
    signer = ArchiveSigner(auth_keys) if auth_keys is not None else None
    sealing_keys = load_sealing_keys(encryption_key_file, encryption_key_env)
    sealer = ArchiveSealer(sealing_keys) if sealing_keys is not None else None
    check_target(archive)
    with open_view(path) as view:
        check_export_format(view)
        selected = select_namespaces(view, namespaces)
        descriptions = view.tier.namespace_descriptions()
        blocks = _settled(view, sorted(view.tier.scan_metas(selected).items(), key=lambda km: (km[1].namespace_id, km[1].depth, km[0])))
        used = sorted({m.namespace_id for _, m in blocks} | (selected or set()))
        manifest = {
            "format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION if sealer is None else SEALED_ARCHIVE_VERSION,
            "created_ns": time.time_ns(), "ucm_db_version": __version__,
            **({} if sealer is None else {"encryption": sealer.manifest_field()}),
            "namespaces": {ns.hex(): descriptions.get(ns, {}) for ns in used}, "epochs": (epochs := export_epochs(view, used)),
            "blocks": [[k.hex(), m.parent.hex() if m.parent else None, m.namespace_id.hex()] for k, m in blocks],
        }
        manifest_bytes = json.dumps(manifest).encode()
        _check_manifest_size(path, len(manifest_bytes))
        members = ExportMembers(view.tier, epochs, signer, sealer)  # beside live writers (its module invariants)
        with atomic_output(archive, store_file_mode(Path(path))) as out:
            with tarfile.open(fileobj=out, mode="w") as tar:
                manifest_at = _add(tar, "manifest.json", manifest_bytes)
                for start in range(0, len(blocks), CHUNK_BLOCKS):
                    for key, member in members.chunk(blocks[start : start + CHUNK_BLOCKS]):
                        _check_block_size(key, len(member))
                        _add(tar, f"blocks/{key.hex()}", member)
                    if progress is not None:
                        progress(min(start + CHUNK_BLOCKS, len(blocks)), len(blocks))
                final_manifest = members.final_manifest(manifest, manifest_bytes)
                if signer is not None:
                    signer.manifest(final_manifest)  # the bytes the archive ends up holding
                    _add(tar, AUTH_MEMBER, signer.member())
            if final_manifest != manifest_bytes:
                rewrite_in_place(out, manifest_at, final_manifest)
    return {"archive": str(archive), "blocks": members.written, "left_out": members.left_out, "corrupt": members.corrupt,
            "stored_bytes": members.stored_bytes,
            "namespaces": manifest["namespaces"], "epochs": manifest["epochs"], "authenticated": signer is not None,
            "encrypted": sealer is not None}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Appends a regular member; returns the archive offset of its data."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    data_at = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
    tar.addfile(info, io.BytesIO(data))
    return data_at


def _open_archive(archive: Path) -> tarfile.TarFile:
    if not archive.is_file():
        raise ConfigError(f"{archive} is not a file", hint="pass an archive written by ucm-db export")
    try:
        return tarfile.open(archive, "r:", tarinfo=BoundedTarInfo)
    except OSError as exc:
        raise ConfigError(f"cannot read {archive}: {exc}", hint="check the path and its permissions") from exc
    except tarfile.TarError as exc:
        raise ConfigError(f"{archive} is not a tar archive ({exc})", hint="pass an archive written by ucm-db export") from exc


def import_archive(archive: str | Path, path: str | Path, progress: ProgressFn | None = None, *,
                   allow_evict: bool = False, auth_key_file: str | Path | None = None,
                   auth_key_env: str | None = None, encryption_key_file: str | Path | None = None,
                   encryption_key_env: str | None = None) -> dict[str, Any]:
    """Loads ``archive`` into the store at ``path`` (created if missing);
    returns counts (``stored``, ``already_present``, ``evicted``) and the
    skipped blocks with reasons (module invariants), and ``epochs`` (per
    namespace: the epoch ``carried``, the store's ``epoch`` now, a ``note``)
    with ``epoch_problems`` (namespaces whose epoch this store cannot
    establish). The carried epochs are recorded before any block
    (:mod:`ucm_db.maintenance.archive.epochs`). With an auth key, an
    archive it did not sign is refused and a block it did not sign is skipped.
    An encrypted archive needs its encryption key (refused without), a key
    needs an encrypted archive, and a block no key opens is skipped.

    Raises:
        ConfigError: the archive is not one ucm-db export wrote, is damaged
            in its manifest or tar structure, or (with an auth key) is not
            signed by a given key, or its encryption and the keys given
            disagree (nothing is written).
        StoreFullError: the archive's new blocks do not fit in the store's
            free capacity and ``allow_evict`` is False (nothing is written).
    """
    from ucm_db.store import open as open_store

    archive, path = Path(archive), Path(path)
    auth_keys = load_keys(auth_key_file, auth_key_env)
    sealing_keys = load_sealing_keys(encryption_key_file, encryption_key_env)
    check_import_target(path)
    report: dict[str, Any] = {"archive": str(archive), "stored": 0, "already_present": 0, "evicted": 0, "skipped": [],
                              "epochs": {}, "epoch_problems": [], "encrypted": False}
    with _open_archive(archive) as tar:
        try:
            check_archive_end(tar, archive, _DAMAGED)  # tarfile stops silently at a header it cannot read
            verifier = ArchiveVerifier(tar, archive, auth_keys) if auth_keys is not None else None
            manifest = read_manifest(tar, archive, verifier)
            members = {m.name: m for m in tar.getmembers() if m.isreg()}
        except tarfile.TarError as exc:
            raise ConfigError(f"{archive} is a damaged tar archive ({exc})", hint=_DAMAGED) from exc
        carried = carried_epochs(manifest, archive, signed=verifier is not None)
        opener = archive_opener(manifest, carried, archive, sealing_keys)
        report["encrypted"] = opener is not None
        with open_store(path) as store:
            if not allow_evict:  # a sealed member's size overstates its blob's by 44 bytes: the safe side
                _refuse_eviction(store._tier, manifest, members, path)
            report["epochs"], report["epoch_problems"] = adopt_epochs(store, carried)
            _load(tar, members, manifest, store, report, progress, verifier, opener)
    return report


def _refuse_eviction(tier: Any, manifest: dict[str, Any], members: dict[str, tarfile.TarInfo], path: Path) -> None:
    """StoreFullError when the archive's blocks not yet stored (at their
    member size, which is their stored size) exceed the free capacity."""
    rows = manifest["blocks"]
    needed_bytes = 0
    for start in range(0, len(rows), CHUNK_BLOCKS):
        keys = [bytes.fromhex(row[0]) for row in rows[start : start + CHUNK_BLOCKS]]
        for key, meta in zip(keys, tier.metas(keys)):
            member = members.get(f"blocks/{key.hex()}")
            if meta is None and member is not None and member.size <= MAX_MEMBER_BYTES:
                needed_bytes += member.size
    free_bytes = max(0, tier.capacity_bytes - tier.totals().stored_bytes)
    if needed_bytes > free_bytes:
        raise StoreFullError(
            f"importing would evict stored blocks: the archive's new blocks need {needed_bytes} bytes and the store "
            f"at {path} has {free_bytes} of {tier.capacity_bytes} bytes free; nothing was imported",
            hint=f"free {needed_bytes - free_bytes} bytes (ucm-db compact {path} --target-bytes N), import into a new store "
            "created with a larger capacity_bytes, or pass --allow-evict (allow_evict=True) to evict least recently used blocks")


def _load(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], manifest: dict[str, Any], store: Any,
          report: dict[str, Any], progress: ProgressFn | None, verifier: ArchiveVerifier | None,
          opener: ArchiveOpener | None = None) -> None:
    total = len(manifest["blocks"])
    good: dict[bytes, bytes] = {}  # key -> namespace id of the blocks taken so far
    batch: list[_Block] = []
    batch_ns, batch_bytes = b"", 0
    for done, (key_hex, parent_hex, ns_hex) in enumerate(manifest["blocks"], 1):
        key, ns_id = bytes.fromhex(key_hex), bytes.fromhex(ns_hex)
        parent = bytes.fromhex(parent_hex) if parent_hex else None
        block, reason = _checked_block(tar, members, key, parent, ns_id, good, manifest, verifier, opener)
        if block is None:
            report["skipped"].append({"key": key_hex, "reason": reason})
        else:
            if batch and (ns_id != batch_ns or len(batch) >= CHUNK_BLOCKS or batch_bytes >= BATCH_BYTES):
                _put(store, batch, manifest["namespaces"][batch_ns.hex()], report, good)
                batch, batch_bytes = [], 0
            batch.append(block)
            batch_ns = ns_id
            batch_bytes += len(block[2])
            good[key] = ns_id
        if progress is not None and (done % CHUNK_BLOCKS == 0 or done == total):
            progress(done, total)
    if batch:
        _put(store, batch, manifest["namespaces"][batch_ns.hex()], report, good)


def _checked_block(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], key: bytes, parent: bytes | None,
    ns_id: bytes, good: dict[bytes, bytes], manifest: dict[str, Any], verifier: ArchiveVerifier | None = None,
    opener: ArchiveOpener | None = None,
) -> tuple[_Block | None, str]:
    if ns_id.hex() not in manifest["namespaces"]:
        return None, "namespace not described in the manifest"
    if parent is not None and parent not in good:
        return None, "parent block missing or bad"
    if parent is not None and good[parent] != ns_id:
        return None, "its parent is listed under another namespace (a chain never spans namespaces)"
    member = members.get(f"blocks/{key.hex()}")
    if member is None:
        return None, "payload missing from the archive (or not a regular member)"
    if member.size > MAX_MEMBER_BYTES:
        return None, f"payload of {member.size} bytes is over the {MAX_MEMBER_BYTES} bytes import reads per block"
    try:
        blob: bytes | bytearray = read_member(tar, member, MAX_MEMBER_BYTES, _DAMAGED)
    except ConfigError as exc:
        return None, "unreadable: " + exc.message
    if verifier is not None and not verifier.block_ok(key, blob):
        return None, "unauthenticated: its MAC does not match (altered, or not signed with the given key)"
    if opener is not None:
        opened, why = opener.open(key, parent, ns_id, blob)
        if opened is None:
            return None, why
        blob = opened
    try:
        codec.verify_sound(blob, key)  # frames that cannot decode are skipped here, never stored
        return (key, parent, blob), ""
    except CorruptBlockError as exc:
        return None, f"corrupt: {exc}"


def _put(store: Any, batch: list[_Block], description: dict[str, Any], report: dict[str, Any],
         good: dict[bytes, bytes]) -> None:
    """Puts one batch (one namespace) as any put goes (:meth:`~ucm_db.Store.put_encoded`). A batch
    refused as crossing namespaces (a key stored here under another one) is put block by block, skipping
    the refused blocks and their descendants (dropped from ``good``, so later batches skip theirs too);
    a namespace whose epoch is unknown here takes nothing (``epoch_problems`` names it)."""
    namespace = Namespace.from_dict(description)  # checked against its id by check_manifest
    try:
        result = store.put_encoded(namespace, batch)
    except MissingAncestorError:
        # A parent put earlier was evicted meanwhile: the store is too small.
        report["skipped"] += [{"key": key.hex(), "reason": "parent evicted during import (capacity too small)"} for key, _, _ in batch]
        return
    except EpochUnknownError:
        report["skipped"] += [{"key": key.hex(), "reason": "its namespace's epoch is unknown here (epoch_problems)"} for key, _, _ in batch]
        return
    except ForeignNamespaceError:
        for key, parent, blob in batch:
            if parent is not None and parent not in good:
                reason = "parent block missing or bad"
            else:
                try:
                    _count(report, store.put_encoded(namespace, [(key, parent, blob)]))
                    continue
                except ForeignNamespaceError:
                    reason = "stored in this store under another namespace"
                except MissingAncestorError:
                    reason = "parent evicted during import (capacity too small)"
            good.pop(key, None)
            report["skipped"].append({"key": key.hex(), "reason": reason})
        return
    _count(report, result)


def _count(report: dict[str, Any], result: Any) -> None:
    for name in ("stored", "already_present", "evicted"):
        report[name] += getattr(result, name)
