"""An archive's manifest: its format and versions, and the checks import
applies to it before anything is written (the format itself:
:mod:`ucm_db.maintenance.archive`).

Invariants:
    * A manifest is read from exactly one regular ``manifest.json`` member,
      at most :data:`MAX_MANIFEST_BYTES` of JSON nested at most
      :data:`~ucm_db.maintenance.archive.files.MAX_MANIFEST_DEPTH` deep, and
      its whole shape is checked (ConfigError otherwise): format, version,
      namespaces (each description hashing to its id), block rows, epochs
      (:func:`~ucm_db.maintenance.archive.epochs.carried_epochs`).
    * Its version is an int of :data:`READABLE_VERSIONS`: ``true`` or
      ``1.0`` (equal to 1 in Python) is refused, never read as version 1,
      whose epochs are not read.
    * It may end in spaces (JSON whitespace): an export that left blocks out
      drops their rows and pads the manifest to the size it had written
      (:mod:`ucm_db.maintenance.archive.members`).
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError
from ucm_db.keys import KEY_BYTES, Namespace
from ucm_db.maintenance.archive.epochs import carried_epochs
from ucm_db.maintenance.archive.files import is_hex, parse_bounded_json, read_member
from ucm_db.maintenance.archive.macs import ArchiveVerifier
from ucm_db.maintenance.archive.sealed import SEALED_ARCHIVE_VERSION

ARCHIVE_FORMAT = "ucm-db-export"
ARCHIVE_VERSION = 2
#: Versions import reads (1: before archives carried epochs; 3: encrypted).
READABLE_VERSIONS = (1, 2, SEALED_ARCHIVE_VERSION)
#: Largest manifest import reads (about 1.5 million blocks; export refuses more).
MAX_MANIFEST_BYTES = 256 << 20
NS_ID_BYTES = 16
DAMAGED = "the archive is damaged or not written by ucm-db export; export it again"


def check_manifest(manifest: Any, archive: Path, *, signed: bool = False) -> dict[str, Any]:
    """The manifest, after checking its whole shape (ConfigError otherwise);
    ``signed``: an auth key authenticated it (its epochs' ceiling)."""
    version = manifest.get("version") if isinstance(manifest, dict) else None
    # An int, never True or 1.0 (== 1): read as version 1, an archive's epochs were ignored.
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT or type(version) is not int or version not in READABLE_VERSIONS:
        raise ConfigError(f"{archive} is not a ucm-db export of version {' or '.join(map(str, READABLE_VERSIONS))} "
                          f"(its manifest's version is {str(version)[:40]!r})", hint="export it again with this ucm-db")
    for name, kind in (("namespaces", dict), ("blocks", list)):
        if not isinstance(manifest.get(name), kind):
            raise ConfigError(f"{archive}: the manifest has no {name} {kind.__name__}", hint=DAMAGED)
    for ns_hex, desc in manifest["namespaces"].items():
        if not is_hex(ns_hex, NS_ID_BYTES) or not isinstance(desc, dict):
            raise ConfigError(f"{archive}: namespace entry {str(ns_hex)[:40]!r} is malformed", hint=DAMAGED)
        try:
            digest = Namespace.from_dict(desc).digest[:NS_ID_BYTES].hex()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{archive}: namespace {ns_hex} has an invalid description: {exc}", hint=DAMAGED) from exc
        if digest != ns_hex:
            raise ConfigError(f"{archive}: namespace {ns_hex} does not match its description (hashes to {digest})",
                              hint="the archive was altered; export it again")
    for row in manifest["blocks"]:
        ok = (isinstance(row, list) and len(row) == 3 and is_hex(row[0], KEY_BYTES)
              and (row[1] is None or is_hex(row[1], KEY_BYTES)) and is_hex(row[2], NS_ID_BYTES))
        if not ok:
            raise ConfigError(f"{archive}: block entry {str(row)[:80]} is malformed", hint=DAMAGED)
    carried_epochs(manifest, archive, signed=signed)  # malformed epochs: refused before anything is written
    return manifest


def read_manifest(tar: tarfile.TarFile, archive: Path, verifier: ArchiveVerifier | None = None) -> dict[str, Any]:
    """The archive's checked manifest: one regular ``manifest.json`` member,
    at most :data:`MAX_MANIFEST_BYTES` of JSON nested at most
    :data:`~ucm_db.maintenance.archive.files.MAX_MANIFEST_DEPTH` deep (ConfigError otherwise)."""
    found = [m for m in tar.getmembers() if m.name == "manifest.json"]
    if not found:
        raise ConfigError(f"{archive} has no manifest.json", hint="pass an archive written by ucm-db export")
    if len(found) > 1:
        raise ConfigError(f"{archive} holds {len(found)} manifest.json members", hint=DAMAGED)
    data = read_member(tar, found[0], MAX_MANIFEST_BYTES, DAMAGED)
    if verifier is not None:
        verifier.check_manifest(bytes(data))  # the exact bytes parsed next
    try:
        manifest = parse_bounded_json(bytes(data))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{archive}: manifest.json is not valid JSON: {exc}", hint=DAMAGED) from exc
    return check_manifest(manifest, archive, signed=verifier is not None)
