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

A head that cannot be read (an error other than "not found": a timeout, a
reset link, a refusal, an object in an archive storage class such as S3
GLACIER, whose GetObject fails with InvalidObjectState) is read once more
at the end of the listing. One still unreadable is listed as ucm-db's,
present, with an unknown parent (``read_error`` says why): taken for absent,
its children would be orphans, removed with the live chains under them; a
run that stopped on it instead stopped on every run while the object was
archived. :mod:`ucm_db.remote.gc` never removes it and holds what it may
hang from. But when the first :data:`MAX_FAILED_HEADS` heads read all fail
and none succeeds (credentials that may list but not read), gc stops
there (TierError, nothing removed), as it did before the retry: else it
made two failing requests per object for a report that said nothing more.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from ucm_db.errors import ConfigError, CorruptBlockError, TierError
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
#: Head reads that may fail, none succeeding, before gc stops (:func:`_stop_if_unreadable`).
MAX_FAILED_HEADS = 100

_HEX = frozenset("0123456789abcdef")


@dataclass
class RemoteObjectInfo:
    """An object of ucm-db's layout: where, how big, how old, and its parent
    from its envelope (``broken``: the envelope fails its checksum;
    ``read_error``: its head could not be read, twice, so its parent is
    unknown: ``parent`` is None then, and says nothing)."""

    path: str
    key: bytes
    size_bytes: int
    mtime_s: float
    parent: bytes | None = None
    broken: bool = False
    read_error: str | None = None

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
    docstring); reads each object's head (:data:`PROBE_BYTES`), a head that
    failed once more after the others (:func:`_read_head`)."""
    listing = root.list_namespaces()
    skipped = sum(1 for name in listing.stray if name not in ROOT_MARKERS)
    objects: list[RemoteObjectInfo] = []
    temps: list[tuple[str, float]] = []
    tombstones: list[tuple[str, float]] = []
    failed: list[RemoteObjectInfo] = []
    read_ok = 0
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
                candidate = RemoteObjectInfo(path, bytes.fromhex(name), int(info.get("size", 0)), _mtime_s(info))
                try:
                    obj = _read_head(root, candidate, last_try=False)
                except Exception as exc:  # noqa: BLE001 - any backend failure (botocore's are not all OSErrors): read again below
                    failed.append(candidate)
                    _stop_if_unreadable(root, len(failed), read_ok, exc)
                    continue
                read_ok += 1
                skipped += not _keep(obj, objects)
            else:
                skipped += 1
    for candidate in failed:  # the link had the rest of the listing to recover
        skipped += not _keep(_read_head(root, candidate), objects)
    return RemoteListing(objects, temps, skipped, tombstones)


def _keep(obj: RemoteObjectInfo | None, objects: list[RemoteObjectInfo]) -> bool:
    """Appends ``obj`` unless None (not ucm-db's); True when appended."""
    if obj is not None:
        objects.append(obj)
    return obj is not None


def _stop_if_unreadable(root: RemoteRoot, failures: int, successes: int, exc: Exception) -> None:
    """Raises :class:`~ucm_db.errors.TierError` (naming the remote and
    ``exc``, the last failure) once :data:`MAX_FAILED_HEADS` head reads
    failed and none succeeded: not one object the remote holds is
    readable, and each would fail twice more for nothing."""
    if successes == 0 and failures >= MAX_FAILED_HEADS:
        raise TierError(f"remote {root_url(root)}: gc could read none of the first {failures} object heads it tried, "
                        f"so it stopped and removed nothing; last error: {f'{type(exc).__name__}: {exc}'[:200]}",
                        hint="check that the credentials may read the objects (S3: s3:GetObject), their storage class "
                        "(GLACIER/DEEP_ARCHIVE: restore them) and the link; rerun gc once reads succeed") from exc


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


def _read_head(root: RemoteRoot, obj: RemoteObjectInfo, *, last_try: bool = True) -> RemoteObjectInfo | None:
    """``obj`` with its parent from its envelope (or marked broken); None when
    the file is not a ucm-db object (gone, not a regular file, or not
    starting with the object magic).

    A read that fails (a timeout, a reset connection, EIO, a refusal, an
    archived object) raises unless ``last_try``; on the last try ``obj`` is
    returned with ``read_error`` set and no parent: present, parent unknown.
    Never absent: the object may be a live chain's, and taken for absent its
    children would be orphans, removed with everything under them (an audit
    saw one transient error remove a young conversation)."""
    try:
        head = root.read_range(obj.path, 0, PROBE_BYTES)  # None: gone, or not a regular file (never opened)
    except Exception as exc:  # noqa: BLE001 - any backend failure (botocore's are not all OSErrors)
        if not last_try:
            raise
        obj.parent, obj.read_error = None, f"{type(exc).__name__}: {exc}"[:200]
        return obj
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
    object; at most :data:`MAX_LANDED`, each key read once. A head that
    fails is read once more when the others are done (then, still failing,
    the object is present with an unknown parent, as in :func:`list_objects`)."""
    known = {o.key for o in objects}
    found: list[RemoteObjectInfo] = []
    todo = [(o.namespace_dir, o.parent) for o in orphaned if o.parent is not None]
    failed: list[RemoteObjectInfo] = []
    read_ok = 0
    while (todo or failed) and len(found) < MAX_LANDED:
        if todo:
            namespace_dir, key = todo.pop()
            if key in known:
                continue
            known.add(key)
            candidate = _late_info(root, f"{namespace_dir}/{key[:1].hex()}/{key.hex()}", key)
            if candidate is None:
                continue
            try:
                obj = _read_head(root, candidate, last_try=False)
            except Exception as exc:  # noqa: BLE001 - any backend failure: read again once the others are done
                failed.append(candidate)
                _stop_if_unreadable(root, len(failed), read_ok, exc)
                continue
            read_ok += 1
        else:
            obj = _read_head(root, failed.pop())
        if obj is not None:
            found.append(obj)
            if obj.parent is not None and not obj.broken:
                todo.append((obj.namespace_dir, obj.parent))
    return found


def _late_info(root: RemoteRoot, path: str, key: bytes) -> RemoteObjectInfo | None:
    """The file at ``path`` if one is there now, its head unread (None: absent, or not a file)."""
    root.fs.invalidate_cache(path)  # the listing cached its directory without it
    try:
        info = root.fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        return None
    return RemoteObjectInfo(path, key, int(info.get("size", 0)), _mtime_s(info))


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


def _protocols(root: RemoteRoot) -> tuple[str, ...]:
    protocol = root.fs.protocol
    return tuple(protocol) if isinstance(protocol, (tuple, list)) else (str(protocol),)


def missing_bucket(root: RemoteRoot) -> str | None:
    """The bucket an object-store root names when the store says it does
    not exist, else None (none for a file system without buckets). A
    listing of a missing bucket is empty: a typo in the URL ran as an empty
    remote (gc: "0 objects", exit 0, run after run; warm: "0 namespaces
    match").

    One bounded request (:func:`_probe_bucket`), missing only on a definite
    "not found" (NoSuchBucket: FileNotFoundError). Any other failure
    (credentials scoped to a prefix may list nothing else and may not ask
    where the bucket is, a transient error) is no answer: the remote stays
    what its listing said, empty. ``fs.exists`` was no test: s3fs answers
    False on any error, and such credentials read as a missing bucket;
    ``fs.ls(bucket)`` paged through the bucket's whole top level (a request
    per 1000 entries, all held in memory) to tell one fact."""
    if not BUCKET_PROTOCOLS.intersection(_protocols(root)):
        return None
    bucket, _, prefix = root.root.strip("/").partition("/")
    if not bucket:
        return None
    try:
        _probe_bucket(root.fs, bucket, prefix)
    except FileNotFoundError:
        return bucket
    except Exception:  # noqa: BLE001 - refused, timed out, botocore's own: not "missing"
        return None
    return None


def _probe_bucket(fs: Any, bucket: str, prefix: str) -> None:
    """One request that fails with FileNotFoundError when ``bucket`` does not
    exist. s3fs: a listing of at most one key under the root's own prefix
    (what credentials scoped to that prefix may list; s3fs turns NoSuchBucket
    into FileNotFoundError). Other stores: ``info`` of the bucket (gcsfs,
    adlfs: one request for the bucket's or container's record)."""
    if callable(getattr(fs, "call_s3", None)):
        fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
    else:
        fs.info(bucket)


def root_url(root: RemoteRoot) -> str:
    """The root as a URL, with its scheme (``s3://bucket/prefix``)."""
    return f"{_protocols(root)[0]}://{root.root}"


def require_bucket(root: RemoteRoot, url: str | None = None) -> None:
    """Raises :class:`~ucm_db.errors.ConfigError` when the bucket of ``url``
    (default: the root's, :func:`root_url`) does not exist (:func:`missing_bucket`)."""
    bucket = missing_bucket(root)
    if bucket is not None:
        raise ConfigError(f"remote {url or root_url(root)}: bucket {bucket!r} does not exist",
                          hint="check the bucket name in the URL, and the endpoint (--option endpoint_url) it is on")
