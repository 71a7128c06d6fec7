"""The remote tier: content-addressed block objects on any fsspec filesystem.

Layout under the remote root (``s3://bucket/prefix``, ``file:///mnt/nfs/kv``,
``memory://kv``, anything fsspec speaks)::

    ROOT/<namespace short id>/manifest.json          readable namespace description
    ROOT/<namespace short id>/<key[0] hex>/<key hex>  one object per block

The namespace short id is the first 8 bytes of the namespace digest in hex
(:attr:`ucm_db.keys.Namespace.short_id`); the 256 ``<key[0] hex>`` fan-out
directories keep listings small on filesystems that dislike large ones.

Object format (little-endian): a 64-byte envelope followed by the codec blob
(:mod:`ucm_db.codec`) exactly as the local tier stores it::

    envelope  magic "UCMR" | version u16 | flags u16 | namespace id 16B |
              parent key 32B | checksum u64
    blob      codec header (owning key, raw length, ...) | frame table | body

The envelope carries what the codec blob lacks to promote the block into a
local tier: its parent key (flag bit 0 set; a chain's first block has none)
and the 16-byte namespace id. Its checksum is xxh3-64 over the envelope with
the checksum field zeroed, followed by the object's own key, so an envelope
that is bit-flipped or served under another key's path fails.

Invariants:
    * Objects are immutable and named by their key: writing one twice writes
      the same bytes, so uploads are idempotent and may be retried freely.
    * Whole-object writes only: ``pipe_file`` (one PUT on object stores); on
      a local or NFS directory a temp file in the same directory, fsync,
      then rename. No reader ever sees a partial object under its final name
      (temp files start with ``.tmp-`` and are never read as objects).
    * Every object read is verified (envelope checksum + codec header,
      owning key and checksum) before its bytes leave this module; a failure
      is a miss, counted in :attr:`RemoteStats.corrupt`, never wrong bytes.
    * A miss is ``None``; errors other than "not found" propagate to the
      caller (the store's read-through layer turns them into misses with a
      deadline and backoff).
    * Trust: checksums catch corruption, not a malicious remote. Whoever can
      write the remote can serve any KV to every node that reads it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ucm_db import codec
from ucm_db.crashpoints import crashpoint
from ucm_db.errors import ConfigError, CorruptBlockError, TierError
from ucm_db.tiers.base import Buffer, Tier, TierCapabilities

OBJECT_MAGIC = b"UCMR"
OBJECT_FORMAT_VERSION = 1
_ENVELOPE = struct.Struct("<4sHH16s32sQ")
ENVELOPE_BYTES = _ENVELOPE.size
_ENV_CHECKSUM_OFFSET = ENVELOPE_BYTES - 8
_FLAG_HAS_PARENT = 1
_NO_PARENT = bytes(32)
#: Bytes a presence probe reads: the envelope plus the codec header.
PROBE_BYTES = ENVELOPE_BYTES + codec.HEADER_BYTES
MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """A verified remote block (or, from a probe, its verified envelope).

    Attributes:
        key: the block key.
        parent: the parent key, None for a chain's first block.
        namespace_id: 16-byte namespace id (first bytes of its digest).
        blob: the codec blob, a read-only view into the fetched object
            (empty for a probe result).
        raw_bytes: raw payload length from the codec header (-1 for a
            probe result).
    """

    key: bytes
    parent: bytes | None
    namespace_id: bytes
    blob: Buffer
    raw_bytes: int


@dataclass(slots=True)
class RemoteStats:
    """Request counters of one :class:`RemoteRoot` (this process)."""

    requests: int = 0
    gets: int = 0
    puts: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def pack_object(key: bytes, parent: bytes | None, namespace_id: bytes, blob: Buffer) -> bytes:
    """Builds the object bytes for ``blob`` (envelope + blob)."""
    if len(namespace_id) != 16:
        raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.digest[:16]")
    flags = _FLAG_HAS_PARENT if parent is not None else 0
    head = _ENVELOPE.pack(OBJECT_MAGIC, OBJECT_FORMAT_VERSION, flags, namespace_id, parent or _NO_PARENT, 0)
    checksum = xxhash.xxh3_64(head + key).intdigest()
    return head[:_ENV_CHECKSUM_OFFSET] + struct.pack("<Q", checksum) + bytes(blob)


def parse_envelope(data: Buffer, key: bytes) -> tuple[bytes | None, bytes]:
    """Verifies an object's envelope; returns ``(parent, namespace_id)``.

    Raises:
        CorruptBlockError: short, wrong magic or version, or bad checksum.
    """
    if len(data) < ENVELOPE_BYTES:
        raise CorruptBlockError(f"remote object of {len(data)} bytes is shorter than its envelope")
    magic, version, flags, namespace_id, parent, checksum = _ENVELOPE.unpack_from(data, 0)
    if magic != OBJECT_MAGIC:
        raise CorruptBlockError("bad magic: not a ucm-db remote object")
    if version != OBJECT_FORMAT_VERSION:
        raise CorruptBlockError(f"remote object format {version} is not {OBJECT_FORMAT_VERSION}")
    view = memoryview(data)
    hasher = xxhash.xxh3_64(view[:_ENV_CHECKSUM_OFFSET])
    hasher.update(bytes(8))
    hasher.update(key)
    if hasher.intdigest() != checksum:
        raise CorruptBlockError("remote envelope checksum mismatch")
    return (bytes(parent) if flags & _FLAG_HAS_PARENT else None), bytes(namespace_id)


def unpack_object(data: Buffer, key: bytes) -> RemoteObject:
    """Verifies a whole object (envelope and codec blob) for ``key``."""
    parent, namespace_id = parse_envelope(data, key)
    blob = memoryview(data)[ENVELOPE_BYTES:]  # a view: no copy of the payload
    header = codec.verify(blob, key)
    return RemoteObject(key, parent, namespace_id, blob, header.raw_len)


def is_local_fs(fs: Any) -> bool:
    """True for fsspec's local filesystem (where rename is atomic)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def write_whole(fs: Any, path: str, data: bytes) -> None:
    """Writes ``data`` as one whole object: readers see all of it or nothing.

    Object stores and ``memory://`` replace objects atomically on
    ``pipe_file``; a local or NFS directory gets a temp file in the same
    directory, fsync, then rename.
    """
    if not is_local_fs(fs):
        fs.pipe_file(path, data)
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            crashpoint("remote.during_upload")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Resolves an fsspec URL to ``(filesystem, root path)``.

    Raises:
        ConfigError: unknown protocol or a missing fsspec backend.
    """
    try:
        import fsspec.core
    except ImportError as exc:  # pragma: no cover - fsspec is in the remote extra
        raise ConfigError("the remote tier needs fsspec", hint="pip install 'ucm-db[remote]' (or [s3])") from exc
    if url.startswith("ucmfault://"):
        import ucm_db.tiers.wrappers  # noqa: F401 - registers the fault-injecting protocol
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot open remote {url!r}: {exc}", hint="install the fsspec backend for its protocol (s3fs for s3://)") from exc
    return fs, str(root).rstrip("/")


class RemoteRoot:
    """One remote location: the filesystem, its root and request counters.

    Thread-safe: fsspec filesystems are, and counters take a lock.
    """

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        self.manifests_written: set[bytes] = set()

    def after_fork(self) -> None:
        """In a forked child: a lock held by a parent thread stays held."""
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, options: dict[str, Any] | None = None) -> RemoteRoot:
        fs, root = open_filesystem(url, options)
        return cls(fs, root)

    def namespace_dir(self, namespace_id: bytes) -> str:
        return f"{self.root}/{namespace_id[:8].hex()}"

    def object_path(self, namespace_id: bytes, key: bytes) -> str:
        return f"{self.root}/{namespace_id[:8].hex()}/{key[:1].hex()}/{key.hex()}"

    def tier(self, namespace_id: bytes) -> RemoteTier:
        """A block tier over one namespace of this root."""
        return RemoteTier(self, namespace_id)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # -- manifests -------------------------------------------------------------
    def ensure_manifest(self, namespace_id: bytes, description: dict[str, Any]) -> None:
        """Writes the namespace manifest once (idempotent, whole-object)."""
        if namespace_id in self.manifests_written:
            return
        path = f"{self.namespace_dir(namespace_id)}/{MANIFEST_NAME}"
        if self.read_manifest(namespace_id) is None:  # one GET (exists() costs two on S3)
            body = {
                "ucm_db_remote_format": OBJECT_FORMAT_VERSION,
                "namespace_id": namespace_id.hex(),
                "namespace": description,
                "layout": "<namespace id[:8] hex>/<key[0] hex>/<key hex>; object = 64-byte envelope + codec blob",
                "created_unix_s": round(time.time(), 3),
            }
            self.count(requests=1, puts=1)
            write_whole(self.fs, path, json.dumps(body, indent=2, sort_keys=True).encode())
        with self._lock:
            self.manifests_written.add(namespace_id)

    def read_manifest(self, namespace_id: bytes) -> dict[str, Any] | None:
        path = f"{self.namespace_dir(namespace_id)}/{MANIFEST_NAME}"
        self.count(requests=1)
        try:
            return json.loads(self.fs.cat_file(path))  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def namespaces(self) -> list[str]:
        """Short ids of the namespaces present under the root."""
        self.count(requests=1)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(str(e).rstrip("/")) for e in entries if len(os.path.basename(str(e).rstrip("/"))) == 16)


class RemoteTier(Tier):
    """The blocks of one namespace on a :class:`RemoteRoot`.

    Methods are synchronous, one request per key; the store's read-through
    layer runs them on a thread pool for concurrency and deadlines.
    """

    def __init__(self, root: RemoteRoot, namespace_id: bytes) -> None:
        if len(namespace_id) != 16:
            raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.digest[:16]")
        self.remote = root
        self.namespace_id = bytes(namespace_id)

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(persistent=True, transactional=False, multi_process=True, sorted_iteration=False)

    def path(self, key: bytes) -> str:
        return self.remote.object_path(self.namespace_id, key)

    # -- single-object operations (what the thread pools run) -----------------
    def _read(self, key: bytes, *, end: int | None = None, gets: int = 0) -> bytes | None:
        """Bytes of ``key``'s object (the first ``end`` if given), counted;
        None if it does not exist. Other errors are counted and raised."""
        self.remote.count(requests=1, gets=gets)
        try:
            if end is None:
                return self.remote.fs.cat_file(self.path(key))  # type: ignore[no-any-return]
            return self.remote.fs.cat_file(self.path(key), start=0, end=end)  # type: ignore[no-any-return]
        except FileNotFoundError:
            self.remote.count(misses=1)
            return None
        except BaseException:
            self.remote.count(errors=1)
            raise

    def fetch(self, key: bytes) -> RemoteObject | None:
        """The verified object of ``key``; None if absent or corrupt."""
        data = self._read(key, gets=1)
        if data is None:
            return None
        self.remote.count(bytes_read=len(data))
        try:
            obj = unpack_object(data, key)
        except CorruptBlockError:
            self.remote.count(corrupt=1)
            return None
        if obj.namespace_id != self.namespace_id:
            self.remote.count(corrupt=1)
            return None
        return obj

    def probe(self, key: bytes) -> RemoteObject | None:
        """Presence check reading only the envelope and codec header (one
        ranged request); returns the object without its blob, or None."""
        data = self._read(key, end=PROBE_BYTES)
        if data is None:
            return None
        try:
            parent, namespace_id = parse_envelope(data, key)
        except CorruptBlockError:
            self.remote.count(corrupt=1)
            return None
        # The blob itself is verified when fetched; a probe only needs the
        # envelope (parent) to be intact and the blob to start like one.
        if namespace_id != self.namespace_id or bytes(data[ENVELOPE_BYTES : ENVELOPE_BYTES + 4]) != codec.MAGIC:
            self.remote.count(corrupt=1)
            return None
        return RemoteObject(key, parent, namespace_id, b"", -1)

    def store(self, key: bytes, parent: bytes | None, blob: Buffer) -> int:
        """Uploads one block as a whole object; returns bytes written."""
        data = pack_object(key, parent, self.namespace_id, blob)
        self.remote.count(requests=1, puts=1)
        try:
            write_whole(self.remote.fs, self.path(key), data)
        except BaseException:
            self.remote.count(errors=1)
            raise
        self.remote.count(bytes_written=len(data))
        return len(data)

    # -- Tier interface --------------------------------------------------------
    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            obj = self.fetch(key)
            out.append(None if obj is None else bytes(obj.blob))
        return out

    def put_batch(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Stores ``(key, blob)`` pairs as chain roots (no parent).

        Not atomic across items (each object is); the store uses
        :meth:`store` with parents.
        """
        for key, blob in items:
            self.store(key, None, blob)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.probe(key) is not None for key in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            # Object stores delete missing keys silently: ask first to count.
            self.remote.count(requests=2)
            if not self.remote.fs.exists(self.path(key)):
                continue
            try:
                self.remote.fs.rm_file(self.path(key))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def iterate(self) -> Iterator[bytes]:
        """Keys of every object of the namespace (temp files skipped)."""
        base = self.remote.namespace_dir(self.namespace_id)
        self.remote.count(requests=1)
        try:
            paths = self.remote.fs.find(base)
        except FileNotFoundError:
            return iter(())
        keys = []
        for path in paths:
            name = os.path.basename(str(path))
            if len(name) == 64 and not name.startswith(TEMP_PREFIX):
                try:
                    keys.append(bytes.fromhex(name))
                except ValueError:
                    continue
        return iter(keys)


def remote_failure(exc: BaseException, url: str) -> TierError:
    """Wraps a remote failure in a TierError naming the remote and the fix."""
    return TierError(
        f"remote {url} failed: {type(exc).__name__}: {exc}",
        hint="check remote/remote_options (endpoint, credentials, network); blocks stay queued locally and are retried",
    )
