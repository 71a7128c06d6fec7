"""Namespace manifests and the listing of a remote root: the readable
description of each namespace (``ROOT/<namespace short id>/manifest.json``,
see :mod:`ucm_db.remote.tier`) and which entries under the root are
namespaces.

Invariants:
    * A manifest is written once per namespace and process, whole-object
      (idempotent), only where none is (:func:`~ucm_db.remote.files.write_new`:
      an upload never writes over a manifest another node wrote meanwhile,
      its epoch included); an unreadable one is replaced, and one that
      cannot be (a directory in its place) is logged and left: uploads go
      on. It is written again when its namespace's epoch moves on
      (:func:`record_epoch`).
    * A manifest is read only as a regular file of at most
      :data:`MAX_MANIFEST_BYTES` holding a JSON object; anything else (JSON
      nested too deep to parse included) is a :class:`ManifestError`, and
      one bad entry never hides the others.
    * Takes the root as a :class:`RemoteRoot` protocol: this module never
      imports :mod:`ucm_db.remote.tier`, which calls it.
    * The epoch travels with the blocks (issue 48): a manifest carries its
      namespace's invalidation epoch (``"epoch"``; with auth keys also
      ``"epoch_auth"``, the key id and HMAC-SHA256 of the namespace id and
      the epoch under :data:`EPOCH_LABEL`). :func:`record_epoch` never
      lowers it (it reads the manifest just before writing; where two
      nodes' writes cross, the claims raise it again to the higher epoch,
      :mod:`ucm_db.remote.epoch_claims`, which also numbers bumps so that
      two never share an epoch). :func:`manifest_epoch` reads it
      as None (unknown: a store adopts nothing) when the manifest is
      missing, unreadable or older (no ``"epoch"``), and refuses (ManifestError)
      one whose epoch is malformed or, with keys, not signed by one of
      them: a planted epoch is never adopted, and the store reads nothing
      of that namespace through from the remote meanwhile
      (:mod:`ucm_db.store.epoch_gate`); a bump still goes above the epoch of
      a manifest signed by a key not configured here (one rotated out), up to
      :data:`UNVERIFIED_EPOCH_LIMIT` (an unverified number only ever raises an
      epoch, and only so far: misses, never stale KV), so after a key
      rotation the next bump re-signs the manifest above the old key's epoch. A MAC cannot stop a replayed older
      manifest, nor one stripped of its epoch: either can make only a *new*
      store start at that older epoch (a store never moves back).
    * An epoch at or above :data:`UNKEYED_EPOCH_LIMIT` (without keys) or
      :data:`KEYED_EPOCH_LIMIT` (signed by a configured key) is refused as
      a malformed one is: never adopted, so a bump always has room
      (:mod:`ucm_db.store.epochs`), and a bump rewrites the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ucm_db.auth import AuthKeys
from ucm_db.errors import UcmDbError
from ucm_db.remote.files import TEMP_PREFIX, NotRegularFileError, require_regular_file, write_new, write_whole
from ucm_db.remote.envelope import OBJECT_FORMAT_VERSION

MANIFEST_NAME = "manifest.json"
#: The root's marker of a keyed remote (:mod:`ucm_db.remote.keying`): not a namespace, not a stray.
KEYED_MARKER_NAME = "auth.json"
#: The root's marker of an encrypted remote (:mod:`ucm_db.remote.keying`): not a namespace, not a stray.
ENCRYPTED_MARKER_NAME = "encryption.json"
#: The root's directory of epoch claims (:mod:`ucm_db.remote.epoch_claims`): not a namespace, not a stray.
EPOCH_CLAIMS_NAME = "epoch-claims"
#: The root's own entries that are no namespace.
ROOT_MARKERS = (MANIFEST_NAME, KEYED_MARKER_NAME, ENCRYPTED_MARKER_NAME, EPOCH_CLAIMS_NAME)
#: A manifest is a small JSON document; a bigger one is not read.
MAX_MANIFEST_BYTES = 1 << 20
#: The MAC label of a manifest's epoch (:mod:`ucm_db.auth`: one label per use).
EPOCH_LABEL = b"ucm-db remote ep"
_EPOCH_LIMIT = 1 << 64
#: The ceilings (exclusive) of an epoch a store takes from a manifest: without
#: auth keys, and signed by a configured key. The same numbers as
#: :data:`ucm_db.store.epochs.CARRIED_EPOCH_LIMIT` and ``SIGNED_EPOCH_LIMIT``
#: (the wing never imports the store): room to bump is always left (an
#: unkeyed manifest carrying 2**64 - 1 made its namespace impossible to
#: invalidate everywhere it was adopted).
UNKEYED_EPOCH_LIMIT = 1 << 48
KEYED_EPOCH_LIMIT = 1 << 63
#: The highest epoch a bump goes above unverified (a key rotated out signed
#: it): the unkeyed ceiling, above every epoch a store reaches (fresh epochs,
#: 2**40 and up, included: at 2**32 a bump after a rotation counted from 0
#: below a fresh epoch the old key signed, and nodes holding it kept old KV),
#: far below the signed ceiling, so a planted one cannot use up the epoch space.
UNVERIFIED_EPOCH_LIMIT = UNKEYED_EPOCH_LIMIT

_log = logging.getLogger("ucm_db")


#: How long a manifest this process wrote or found is taken as there: a
#: prefix emptied behind a running node (an operator, an S3 lifecycle rule,
#: which expires a namespace's oldest object, its manifest, first) gets it
#: back from the first upload after that, so gc still owns its objects.
MANIFEST_RECHECK_S = 60.0


class RecentManifests:
    """Namespaces whose manifest this process wrote or found within
    :data:`MANIFEST_RECHECK_S` (``namespace_id in recent``)."""

    def __init__(self) -> None:
        self._at: dict[bytes, float] = {}

    def add(self, namespace_id: bytes) -> None:
        self._at[namespace_id] = time.monotonic()

    def __contains__(self, namespace_id: object) -> bool:
        at = self._at.get(namespace_id) if isinstance(namespace_id, bytes) else None
        return at is not None and time.monotonic() - at < MANIFEST_RECHECK_S


class RemoteRoot(Protocol):
    """What this module needs of :class:`ucm_db.remote.tier.RemoteRoot`."""

    fs: Any
    root: str
    manifests_written: RecentManifests
    auth: AuthKeys | None
    #: The highest epoch of each namespace written or read here (a
    #: replaced manifest keeps it).
    epochs: dict[bytes, int]

    @property
    def is_local(self) -> bool: ...

    def namespace_dir(self, namespace_id: bytes) -> str: ...

    def count(self, **deltas: int) -> None: ...

    def read_range(self, path: str, start: int, end: int) -> bytes | None: ...

    def manifest_written(self, namespace_id: bytes) -> None: ...


class ManifestError(UcmDbError):
    """A namespace manifest on the remote cannot be read as one.

    ``unverified_epoch``: the well-formed epoch a manifest carries that no
    configured key signed (None otherwise): never adopted, but a bump goes
    above it (:mod:`ucm_db.store.epoch_gate`)."""

    unverified_epoch: int | None = None

    default_hint = ("a store writing to this namespace rewrites it; or delete the file so the next upload recreates it, "
                    "or pass the namespace by a longer id prefix")


def ensure_manifest(root: RemoteRoot, namespace_id: bytes, description: dict[str, Any]) -> None:
    """Writes the namespace manifest where none is (idempotent,
    whole-object), asking again once :data:`MANIFEST_RECHECK_S` passed; an
    unreadable manifest is replaced."""
    if namespace_id in root.manifests_written:
        return
    path = f"{root.namespace_dir(namespace_id)}/{MANIFEST_NAME}"
    replace = False
    try:
        present = read_manifest(root, namespace_id) is not None  # one GET (exists() costs two on S3)
    except ManifestError as exc:
        _log.warning("%s; rewriting it", exc)
        present = replace = True
    if not present or replace:
        body = _fresh_body(namespace_id, description)
        if namespace_id in root.epochs:
            body.update(epoch_fields(root, namespace_id, root.epochs[namespace_id]))
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        root.count(requests=1, puts=1)
        if not replace:
            write_new(root.fs, path, data)  # False: another node's came first, with what it knows (its epoch)
        elif not _repaired_since(root, namespace_id):  # another node's bump may have rewritten it meanwhile
            try:
                write_whole(root.fs, path, data)
            except OSError as exc:  # e.g. a directory in its place: uploads go on without it
                _log.warning("cannot replace namespace manifest %s (%s: %s); blocks are uploaded without it",
                             path, type(exc).__name__, exc)
    root.manifest_written(namespace_id)

def _repaired_since(root: RemoteRoot, namespace_id: bytes) -> bool:
    """Whether the unreadable manifest reads as one now (another node
    rewrote it, with its epoch): then it is not replaced. One GET; the
    window between it and the replacing write stays."""
    try:
        return read_manifest(root, namespace_id) is not None
    except ManifestError:
        return False


def _fresh_body(namespace_id: bytes, description: dict[str, Any]) -> dict[str, Any]:
    return {
        "ucm_db_remote_format": OBJECT_FORMAT_VERSION,
        "namespace_id": namespace_id.hex(),
        "namespace": description,
        "layout": "<namespace id[:8] hex>/<key[0] hex>/<key hex>; object = 64-byte envelope + codec blob",
        "created_unix_s": round(time.time(), 3),
    }


def _epoch_parts(namespace_id: bytes, epoch: int) -> list[bytes]:
    return [bytes(namespace_id), epoch.to_bytes(8, "little")]


def epoch_fields(root: RemoteRoot, namespace_id: bytes, epoch: int) -> dict[str, Any]:
    """The manifest fields carrying ``epoch`` (signed with the root's first key)."""
    fields: dict[str, Any] = {"epoch": epoch}
    if root.auth is not None:
        key_id, tag = root.auth.sign(_epoch_parts(namespace_id, epoch), EPOCH_LABEL)
        fields["epoch_auth"] = {"key_id": key_id.hex(), "mac": tag.hex()}
    return fields


def epoch_of(root: RemoteRoot, namespace_id: bytes, manifest: dict[str, Any]) -> tuple[int | None, str | None]:
    """``(epoch, problem)`` of a manifest: the epoch it carries, or None
    with why it is not used (None, None: an older manifest without one)."""
    epoch = manifest.get("epoch")
    if epoch is None:
        return None, None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < _EPOCH_LIMIT:
        return None, f"its epoch {str(epoch)[:40]!r} is not an epoch"
    if root.auth is None:
        if epoch >= UNKEYED_EPOCH_LIMIT:
            return None, (f"its epoch {epoch} is at or above 2**48, the most a store takes from a remote without an "
                          "auth key (no store reaches it: planted or altered)")
        return epoch, None
    signed = manifest.get("epoch_auth")
    try:
        key_id, tag = bytes.fromhex(signed["key_id"]), bytes.fromhex(signed["mac"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None, "its epoch is not signed and an auth key is configured"
    if not root.auth.verify(_epoch_parts(namespace_id, epoch), EPOCH_LABEL, key_id, tag):
        return None, "its epoch's MAC was not made by a configured auth key (altered or planted)"
    if epoch >= KEYED_EPOCH_LIMIT:
        return None, f"its epoch {epoch} is at or above 2**63, the engines' private epochs: no store records one"
    return epoch, None


def manifest_epoch(root: RemoteRoot, namespace_id: bytes) -> int | None:
    """The epoch the namespace's manifest carries; None where none is
    known: no manifest, an unreadable one (logged; the next upload rewrites
    it), or an older one without an epoch.

    Raises:
        ManifestError: the manifest carries an epoch that is malformed or,
            with auth keys, not signed by one of them (planted or altered):
            the namespace's remote epoch cannot be established.
        Exception: remote failures other than "not found" propagate.
    """
    path = f"{root.namespace_dir(namespace_id)}/{MANIFEST_NAME}"
    try:
        manifest = read_manifest(root, namespace_id)
    except ManifestError as exc:
        _log.warning("%s; its epoch is unknown", exc)
        return None
    if manifest is None:
        return None
    epoch, problem = epoch_of(root, namespace_id, manifest)
    if problem is not None:
        error = ManifestError(f"namespace manifest {path}: {problem}; its epoch is not adopted",
                              hint="a store holding the auth key rewrites it when it moves the namespace's epoch on "
                              "(Store.bump_epoch, `ucm-db invalidate`, an engine's reset_cache); or remove the manifest")
        error.unverified_epoch = rotated_out_epoch(root, manifest)
        raise error
    if epoch is not None:
        root.epochs[namespace_id] = max(epoch, root.epochs.get(namespace_id, 0))
    return epoch


def rotated_out_epoch(root: RemoteRoot, manifest: dict[str, Any]) -> int | None:
    """The epoch of a manifest signed (in form) by a key not configured here,
    a key rotated out, below :data:`UNVERIFIED_EPOCH_LIMIT`; else None. A
    bump goes above it: a planted one (anyone may claim a key id) only ever
    raises the epoch, and by at most the limit (misses, never stale KV)."""
    raw, signed = manifest.get("epoch"), manifest.get("epoch_auth")
    try:
        key_id = bytes.fromhex(signed["key_id"])  # type: ignore[index]
        bytes.fromhex(signed["mac"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None  # unsigned: no keyed node wrote it
    if root.auth is None or any(key_id == known for known in root.auth.key_ids):
        return None  # a configured key's id with a MAC that fails: altered
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < UNVERIFIED_EPOCH_LIMIT:
        return raw
    return None


def record_epoch(root: RemoteRoot, namespace_id: bytes, epoch: int, description: dict[str, Any]) -> None:
    """Makes the namespace's manifest carry ``epoch`` unless it carries a
    higher one already (one read, at most one whole-object write; a missing
    or unreadable manifest is written anew from ``description``)."""
    root.epochs[namespace_id] = max(epoch, root.epochs.get(namespace_id, 0))
    try:
        manifest = read_manifest(root, namespace_id)
    except ManifestError:
        manifest = None
    if manifest is not None:
        present, _ = epoch_of(root, namespace_id, manifest)
        if present is not None and present >= epoch:
            return
        body = dict(manifest)
    else:
        body = _fresh_body(namespace_id, description)
    body.pop("epoch_auth", None)
    body.update(epoch_fields(root, namespace_id, root.epochs[namespace_id]))
    root.count(requests=1, puts=1)
    write_whole(root.fs, f"{root.namespace_dir(namespace_id)}/{MANIFEST_NAME}", json.dumps(body, indent=2, sort_keys=True).encode())
    root.manifest_written(namespace_id)


def read_manifest(root: RemoteRoot, namespace_id: bytes) -> dict[str, Any] | None:
    """The namespace's manifest; None if it has none.

    Raises:
        ManifestError: the manifest is not a regular file, larger than
            :data:`MAX_MANIFEST_BYTES`, or not a JSON object.
    """
    path = f"{root.namespace_dir(namespace_id)}/{MANIFEST_NAME}"
    if root.is_local and os.path.lexists(path):
        try:
            require_regular_file(path, os.lstat(path).st_mode)
        except (NotRegularFileError, FileNotFoundError) as exc:
            raise ManifestError(f"namespace manifest {path} is unreadable: {exc}") from exc
    data = root.read_range(path, 0, MAX_MANIFEST_BYTES + 1)
    if data is None:
        return None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"namespace manifest {path} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nested past the parser's depth
        raise ManifestError(f"namespace manifest {path} is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from exc
    if not isinstance(manifest, dict):
        raise ManifestError(f"namespace manifest {path} is not a JSON object")
    return manifest

def namespaces(root: RemoteRoot) -> list[str]:
    """Short ids of the namespaces present under the root: entries named
    by 16 lowercase hex digits (anything else is not a namespace)."""
    return sorted(list_namespaces(root).entries)

def list_namespaces(root: RemoteRoot) -> NamespaceListing:
    """Namespace directories under the root and the entries that are not
    one (listing only; manifests are read by :func:`manifests`)."""
    root.count(requests=1)
    try:
        entries = root.fs.ls(root.root, detail=False)
    except FileNotFoundError:
        return NamespaceListing([], [])
    found: list[str] = []
    stray: list[str] = []
    for entry in entries:
        name = os.path.basename(str(entry).rstrip("/"))
        (found if is_namespace_id(name) else stray).append(name)
    return NamespaceListing(sorted(found), sorted(stray))

def manifests(root: RemoteRoot) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every readable namespace manifest, by short id, and one problem
    line per entry that is not a namespace or whose manifest is missing
    or unreadable (each also logged as a warning): one bad entry never
    hides the others."""
    listing = list_namespaces(root)
    problems = [f"{root.root}/{name}: not a namespace (its name is not 16 hex digits); skipped"
                for name in listing.stray if name not in ROOT_MARKERS and not name.startswith(TEMP_PREFIX)]
    found: dict[str, dict[str, Any]] = {}
    for short_id in listing.entries:
        try:
            manifest = read_manifest(root, bytes.fromhex(short_id))
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        if manifest is None:
            problems.append(f"{root.namespace_dir(bytes.fromhex(short_id))}: no {MANIFEST_NAME}; skipped")
        else:
            found[short_id] = manifest
    for problem in problems:
        _log.warning("remote %s: %s", root.root, problem)
    return found, problems


@dataclass(frozen=True, slots=True)
class NamespaceListing:
    """Entries directly under a remote root.

    Attributes:
        entries: namespace short ids (16 lowercase hex digits).
        stray: names of every other entry.
    """

    entries: list[str]
    stray: list[str]


def is_namespace_id(name: str) -> bool:
    """True for a namespace short id: 16 lowercase hex digits."""
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)
