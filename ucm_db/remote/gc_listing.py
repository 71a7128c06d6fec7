"""Listing a remote for gc (:mod:`ucm_db.remote.gc`): ucm-db's own objects,
each with its size, time and parent, and the parents that land after the
listing passed their path.

Only what ucm-db wrote is ever listed (:func:`list_objects`): paths of its
own layout under a namespace directory whose ``manifest.json`` is ucm-db's,
starting like a ucm-db object (one ranged read of each object's head).
Retractions' tombstones (``<key[0]>/<key hex>.retracted``,
:mod:`ucm_db.remote.tombstones`) are listed apart, by name (read only when
gc would remove one): they are neither objects nor skipped entries.

A listing is no snapshot: it walks the paths in order while nodes upload.
An uploader sends a parent before its child, yet the listing may pass the
parent's path before it lands and the child's after, and then holds a
young child without its parent: on a busy namespace nearly every run did,
and gc held the namespace run after run. :func:`landed_parents` reads such
a parent where it belongs, and its own absent parent in turn, so gc knows
the chain it hangs from (a parent still absent then is in flight).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.remote.manifests import ROOT_MARKERS
from ucm_db.remote.tier import (
    MANIFEST_NAME, OBJECT_MAGIC, PROBE_BYTES, TEMP_PREFIX, ManifestError, RemoteRoot, is_namespace_id, parse_envelope,
)
from ucm_db.remote.tombstones import MAX_TOMBSTONE_BYTES, TOMBSTONE_MAX_AGE_S, parse_tombstone, tombstone_key

#: Protocols whose root's first path component is a bucket, which must exist.
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
#: Objects :func:`landed_parents` reads past the listing in one run, at most
#: (two requests each); past it, the parents left are taken for in flight.
MAX_LANDED = 4096

_HEX = frozenset("0123456789abcdef")


@dataclass
class RemoteObjectInfo:
    """An object of ucm-db's layout: where, how big, how old, and its parent
    from its envelope (``broken``: the envelope fails its checksum)."""

    path: str
    key: bytes
    size_bytes: int
    mtime_s: float
    parent: bytes | None = None
    broken: bool = False

    @property
    def namespace_dir(self) -> str:
        """Its namespace directory: its path less ``/<key[0]>/<key>``."""
        return self.path.rsplit("/", 2)[0]


@dataclass
class RemoteListing:
    """What :func:`list_objects` found: ucm-db's objects, temp files and
    tombstones (path, mtime), and how many entries it left alone as not
    ucm-db's."""

    objects: list[RemoteObjectInfo]
    temps: list[tuple[str, float]]
    skipped_entries: int
    tombstones: list[tuple[str, float]] = field(default_factory=list)


def _mtime_s(info: dict[str, Any]) -> float:
    """An entry's time in a listing (0.0: none stated; gc then counts it young).
    WebHDFS states ``modificationTime`` in ms, FTP ``modify`` as UTC digits."""
    stamp = info.get("modificationTime")
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and stamp > 0:
        return float(stamp) / 1000.0
    modify = info.get("modify")
    if isinstance(modify, str) and len(modify) >= 14 and modify[:14].isdigit():
        try:
            return dt.datetime.strptime(modify[:14], "%Y%m%d%H%M%S").replace(tzinfo=dt.timezone.utc).timestamp()
        except ValueError:
            pass
    for name in ("mtime", "LastModified", "last_modified", "created", "updated"):
        value = info.get(name)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def list_objects(root: RemoteRoot) -> RemoteListing:
    """ucm-db's objects and temp files under the root (see the module
    docstring); reads each object's head (:data:`PROBE_BYTES`)."""
    listing = root.list_namespaces()
    skipped = sum(1 for name in listing.stray if name not in ROOT_MARKERS)
    objects: list[RemoteObjectInfo] = []
    temps: list[tuple[str, float]] = []
    tombstones: list[tuple[str, float]] = []
    for short_id in listing.entries:
        namespace_id = bytes.fromhex(short_id)
        if not _is_own_namespace(root, namespace_id, short_id):
            skipped += 1
            continue
        base = root.namespace_dir(namespace_id)
        try:
            found = root.fs.find(base, detail=True)
        except FileNotFoundError:
            continue
        for path, info in found.items():
            path = str(path)
            parts = path[len(base) + 1 :].split("/") if path.startswith(base + "/") else []
            name = parts[-1] if parts else ""
            if parts == [MANIFEST_NAME]:
                continue
            if name.startswith(TEMP_PREFIX) and (len(parts) == 1 or (len(parts) == 2 and _is_hex(parts[0], 2))):
                temps.append((path, _mtime_s(info)))
            elif len(parts) == 2 and _is_hex(parts[0], 2) and tombstone_key(name) is not None and name[:2] == parts[0]:
                tombstones.append((path, _mtime_s(info)))
            elif len(parts) == 2 and _is_hex(parts[0], 2) and _is_hex(name, 64) and name[:2] == parts[0]:
                obj = _read_head(root, RemoteObjectInfo(path, bytes.fromhex(name), int(info.get("size", 0)), _mtime_s(info)))
                if obj is None:
                    skipped += 1
                else:
                    objects.append(obj)
            else:
                skipped += 1
    return RemoteListing(objects, temps, skipped, tombstones)


def _is_hex(name: str, length: int) -> bool:
    """True for ``length`` lowercase hex digits (how the uploader names things)."""
    return len(name) == length and set(name) <= _HEX


def _is_own_namespace(root: RemoteRoot, namespace_id: bytes, short_id: str) -> bool:
    """True when the directory's manifest is ucm-db's for this namespace id."""
    if not is_namespace_id(short_id):
        return False
    try:
        manifest = root.read_manifest(namespace_id)
    except ManifestError:
        return False
    if manifest is None or "ucm_db_remote_format" not in manifest:
        return False
    named = manifest.get("namespace_id")
    return isinstance(named, str) and named.startswith(short_id)


def _read_head(root: RemoteRoot, obj: RemoteObjectInfo) -> RemoteObjectInfo | None:
    """``obj`` with its parent from its envelope (or marked broken); None when
    the file is not a ucm-db object (gone, not a regular file, or not
    starting with the object magic).

    A read that fails (a timeout, a reset connection, EIO, a refusal) raises:
    the object may be a live chain's, and taken for absent its children
    would be orphans, removed with everything under them (an audit saw one
    transient error remove a young conversation). gc then stops before
    removing anything; a rerun once the remote answers collects."""
    head = root.read_range(obj.path, 0, PROBE_BYTES)  # None: gone, or not a regular file (never opened)
    if head is None or bytes(head[: len(OBJECT_MAGIC)]) != OBJECT_MAGIC:
        return None
    try:
        obj.parent, _namespace_id = parse_envelope(head, obj.key)
    except CorruptBlockError:
        obj.broken = True
    return obj


def landed_parents(root: RemoteRoot, objects: list[RemoteObjectInfo], orphaned: list[RemoteObjectInfo],
                   ) -> list[RemoteObjectInfo]:
    """Objects the listing lacks that the parent chains of ``orphaned``
    (listed objects whose parent is not in ``objects``) reach: each read
    like a listed object (its size and time, then its head), up its chain
    until a listed object, a chain's first block, an absent or a broken
    object; at most :data:`MAX_LANDED`, each key read once."""
    known = {o.key for o in objects}
    found: list[RemoteObjectInfo] = []
    todo = [(o.namespace_dir, o.parent) for o in orphaned if o.parent is not None]
    while todo and len(found) < MAX_LANDED:
        namespace_dir, key = todo.pop()
        if key in known:
            continue
        known.add(key)
        obj = _read_late(root, f"{namespace_dir}/{key[:1].hex()}/{key.hex()}", key)
        if obj is not None:
            found.append(obj)
            if obj.parent is not None and not obj.broken:
                todo.append((namespace_dir, obj.parent))
    return found


def _read_late(root: RemoteRoot, path: str, key: bytes) -> RemoteObjectInfo | None:
    """The object at ``path`` if one is there now (None: absent, or not ucm-db's)."""
    root.fs.invalidate_cache(path)  # the listing cached its directory without it
    try:
        info = root.fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        return None
    return _read_head(root, RemoteObjectInfo(path, key, int(info.get("size", 0)), _mtime_s(info)))


def stale_tombstones(root: RemoteRoot, tombstones: list[tuple[str, float]], now_s: float) -> list[str]:
    """Paths of the listed tombstones older than :data:`TOMBSTONE_MAX_AGE_S`
    (by their time, or the retraction time they state where the listing
    gives none), each read first: a file that is not ucm-db's tombstone is
    left alone. One request per tombstone that old."""
    stale: list[str] = []
    for path, mtime_s in tombstones:
        if mtime_s > 0 and now_s - mtime_s <= TOMBSTONE_MAX_AGE_S:
            continue
        key = tombstone_key(path.rsplit("/", 1)[-1])
        try:
            data = root.read_range(path, 0, MAX_TOMBSTONE_BYTES + 1)
        except OSError:
            continue
        retracted_ns = None if data is None or key is None else parse_tombstone(data, key)
        if retracted_ns is None:
            continue
        written_s = mtime_s if mtime_s > 0 else retracted_ns / 1e9
        if now_s - written_s > TOMBSTONE_MAX_AGE_S:
            stale.append(path)
    return stale


def missing_bucket(root: RemoteRoot) -> str | None:
    """The bucket an object-store root names when it does not exist, else
    None (one request; none for a file system without buckets). A listing
    of a missing bucket is empty: a typo in the URL ran as an empty remote
    (gc: "0 objects", exit 0, run after run; warm: "0 namespaces match")."""
    protocols = root.fs.protocol if isinstance(root.fs.protocol, (tuple, list)) else (root.fs.protocol,)
    if not BUCKET_PROTOCOLS.intersection(protocols):
        return None
    bucket = root.root.lstrip("/").split("/", 1)[0]
    return bucket if bucket and not root.fs.exists(bucket) else None


def require_bucket(root: RemoteRoot, url: str) -> None:
    """Raises :class:`~ucm_db.errors.ConfigError` when ``url``'s bucket does not exist (:func:`missing_bucket`)."""
    bucket = missing_bucket(root)
    if bucket is not None:
        raise ConfigError(f"remote {url}: bucket {bucket!r} does not exist",
                          hint="check the bucket name in the URL, and the endpoint (--option endpoint_url) it is on")
