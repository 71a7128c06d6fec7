"""The remote tier: content-addressed block objects on any fsspec filesystem.

Layout under the remote root (``s3://bucket/prefix``, ``file:///mnt/nfs/kv``,
``memory://kv``, anything fsspec speaks)::

    ROOT/<namespace short id>/manifest.json          readable namespace description
    ROOT/<namespace short id>/<key[0] hex>/<key hex>  one object per block

The namespace short id is the first 8 bytes of the namespace digest in hex
(:attr:`ucm_db.keys.Namespace.short_id`); the 256 ``<key[0] hex>`` fan-out
directories keep listings small on filesystems that dislike large ones.

An object is a 64-byte envelope (parent key, namespace id, checksum bound to
the key) followed by the codec blob exactly as the local tier stores it; see
:mod:`ucm_db.remote.envelope`. Local and NFS directories are read and
written through :mod:`ucm_db.remote.files`.

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
    * Every read is bounded by what the object's header allows: the first
      request reads at most :data:`FIRST_READ_BYTES`; the envelope and codec
      header then state the object's exact length, which must be within
      :attr:`RemoteRoot.max_object_bytes` (the store's
      ``remote_max_object_bytes``, at most :data:`MAX_OBJECT_BYTES`; a
      larger one is refused unread, a miss counted in
      :attr:`RemoteStats.too_large` and logged once per path, as is one
      whose codec header declares a block of more raw bytes than that,
      before it is promoted), and at most that many bytes (plus one,
      to see an object longer than stated) are read, in chunks within the
      caller's deadline and byte budget (:mod:`ucm_db.remote.object_reads`).
      An object shorter or longer than its header states is corrupt (a miss).
    * On a local or NFS directory only regular files are read: a symlink,
      FIFO, device or directory in an object's place is never opened for
      reading (so never hangs or streams), it is a miss, counted in
      :attr:`RemoteStats.not_regular`, logged once per path and listed in
      :attr:`RemoteRoot.quarantined`.
    * A miss is ``None``; errors other than "not found" propagate to the
      caller (the store's read-through layer turns them into misses with a
      deadline and backoff).
    * Trust: checksums catch corruption, not a malicious remote. With auth
      keys (:attr:`RemoteRoot.auth`) a fetch serves only objects one key
      signed (:mod:`ucm_db.remote.envelope`); others are misses counted
      as ``unauthenticated``/``mac_mismatch``. A probe cannot check a MAC:
      a forged object can lengthen a prefix search, never make a hit.
    * Confidentiality: with encryption keys (:attr:`RemoteRoot.sealing`)
      uploads are encrypted (AES-256-GCM, :mod:`ucm_db.remote.sealing`) and
      a fetch serves only objects one key opens; a plaintext object is a
      miss counted ``unencrypted``, one no key opens (or any encrypted one,
      without keys) a miss counted ``undecryptable``.
"""

from __future__ import annotations


import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ucm_db.auth import AuthKeys
from ucm_db.errors import ConfigError, CorruptBlockError, TierError
from ucm_db.engines.base import Buffer, Tier, TierCapabilities
from ucm_db.remote.files import (  # noqa: F401 - re-exported: the remote tier's public names
    TEMP_PREFIX, DirSyncs, NotRegularFileError, require_regular_file, is_local_fs, range_past_the_end, read_local_range,
    remove_whole, write_new, write_whole, open_filesystem,
)
from ucm_db.remote.remote_stats import RemoteStats  # noqa: F401 - re-exported
from ucm_db.remote import manifests as remote_manifests
from ucm_db.remote.manifests import (  # noqa: F401 - re-exported
    MANIFEST_NAME, MAX_MANIFEST_BYTES, ManifestError, NamespaceListing, is_namespace_id,
)
from ucm_db.remote.object_reads import ObjectTooLargeError, ReadLimits, check_raw_bytes, read_object
from ucm_db.remote.sealing import SealingKeys
from ucm_db.remote.envelope import (  # noqa: F401 - re-exported
    ENVELOPE_BYTES, MAX_OBJECT_BYTES, OBJECT_FORMAT_VERSION, OBJECT_MAGIC, PROBE_BYTES, RemoteObject, pack_object,
    UnauthenticatedObject, is_signed, parse_envelope, probe_problem, stated_object_bytes, unpack_object,
)

#: The first request of a fetch reads this much: a whole object when it is
#: smaller (one request for typical KV blocks), its header otherwise.
FIRST_READ_BYTES = 8 << 20
#: Paths kept in :attr:`RemoteRoot.quarantined` (later ones are counted only).
MAX_QUARANTINED = 1024

_log = logging.getLogger("ucm_db")


class RemoteRoot:
    """One remote location: the filesystem, its root and request counters.

    Thread-safe: fsspec filesystems are, and counters take a lock.
    """

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        #: The largest object read (a larger one is a miss, never read).
        self.max_object_bytes = MAX_OBJECT_BYTES
        #: Keys that sign uploads and authenticate fetches; None: neither.
        self.auth: AuthKeys | None = None
        #: Keys that encrypt uploads and open fetches; None: neither.
        self.sealing: SealingKeys | None = None
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        self.manifests_written = remote_manifests.RecentManifests()
        #: Each namespace's highest epoch met here (its manifest's, :mod:`ucm_db.remote.manifests`).
        self.epochs: dict[bytes, int] = {}
        self._local = is_local_fs(fs)
        #: Paths found unreadable as objects (not a regular file), with why;
        #: at most :data:`MAX_QUARANTINED`. Nothing is moved on the remote:
        #: other nodes share it, and an operator decides.
        self.quarantined: dict[str, str] = {}
        self._told_too_large: set[str] = set()

    @property
    def is_local(self) -> bool:
        """True for a directory of this machine's file systems (``file://``; NFS included)."""
        return self._local

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

    def tier(self, namespace_id: bytes, *, exclusive: bool = False, syncs: DirSyncs | None = None) -> RemoteTier:
        """A block tier over one namespace of this root (``exclusive``,
        ``syncs``: how its :meth:`RemoteTier.store` writes)."""
        return RemoteTier(self, namespace_id, exclusive=exclusive, syncs=syncs)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def read_range(self, path: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the object at ``path`` (fewer at its
        end), as one counted request; None if it does not exist or is not a
        regular file (which is quarantined). Other errors are counted and
        raised."""
        self.count(requests=1)
        try:
            if self._local:
                data: bytes = read_local_range(path, start, end)
            else:
                data = self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            self.count(misses=1)
            return None
        except (NotRegularFileError, IsADirectoryError, NotADirectoryError) as exc:
            self.quarantine(path, str(exc))
            return None
        except OSError as exc:
            if not range_past_the_end(exc):
                self.count(errors=1)
                raise
            data = b""  # S3 answers a range starting at or past an object's end (a zero-byte one's 0) with 416
        except BaseException:
            self.count(errors=1)
            raise
        self.count(bytes_read=len(data))
        return data

    def quarantine(self, path: str, why: str) -> None:
        """Records a path that is not an object (a miss for every reader);
        logs it once."""
        with self._lock:
            self.stats.not_regular += 1
            new = path not in self.quarantined and len(self.quarantined) < MAX_QUARANTINED
            if new:
                self.quarantined[path] = why
        if new:
            _log.warning("remote %s: %s; it reads as a miss (hint: remove it from the remote)", self.root, why)

    def refuse_too_large(self, path: str, why: str) -> None:
        """Counts an object refused for its size (``too_large``); logs it once per path."""
        with self._lock:
            self.stats.too_large += 1
            new = path not in self._told_too_large and len(self._told_too_large) < MAX_QUARANTINED
            if new:
                self._told_too_large.add(path)
        if new:
            _log.warning("remote %s: %s at %s; it reads as a miss (hint: raise remote_max_object_bytes if real KV blocks "
                         "are this large)", self.root, why, path)

    # -- manifests (ucm_db.remote.manifests) ------------------------------
    def ensure_manifest(self, namespace_id: bytes, description: dict[str, Any]) -> None:
        """Writes the namespace manifest where none is (asked again every
        minute); an unreadable manifest is replaced."""
        remote_manifests.ensure_manifest(self, namespace_id, description)

    def manifest_written(self, namespace_id: bytes) -> None:
        with self._lock:
            self.manifests_written.add(namespace_id)

    def read_manifest(self, namespace_id: bytes) -> dict[str, Any] | None:
        """The namespace's manifest; None if it has none (a
        :class:`ManifestError` if it cannot be read as one)."""
        return remote_manifests.read_manifest(self, namespace_id)

    def namespaces(self) -> list[str]:
        """Short ids of the namespaces present under the root."""
        return remote_manifests.namespaces(self)

    def list_namespaces(self) -> NamespaceListing:
        """Namespace directories under the root and the entries that are not one."""
        return remote_manifests.list_namespaces(self)

    def manifests(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Every readable namespace manifest, by short id, and one problem
        line per entry that is not a namespace or whose manifest is missing
        or unreadable."""
        return remote_manifests.manifests(self)


class RemoteTier(Tier):
    """The blocks of one namespace on a :class:`RemoteRoot`.

    Methods are synchronous, one request per key; the store's read-through
    layer runs them on a thread pool for concurrency and deadlines.
    ``exclusive``: :meth:`store` writes only where no object is (an
    ancestor's re-upload: :mod:`ucm_db.remote.ancestry`); ``syncs``: where
    its directory fsyncs go (an upload batch's, :class:`DirSyncs`).
    """

    def __init__(self, root: RemoteRoot, namespace_id: bytes, *, exclusive: bool = False,
                 syncs: DirSyncs | None = None) -> None:
        if len(namespace_id) != 16:
            raise ConfigError("namespace id must be 16 bytes", hint="pass namespace.id")
        self.remote = root
        self.namespace_id = bytes(namespace_id)
        self.exclusive, self.syncs = exclusive, syncs
        #: The first :data:`PROBE_BYTES` of the object :meth:`store` last
        #: wrote (what tells it from another writer's; a tier made for one
        #: upload); None: none written.
        self.stored_head: bytes | None = None

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(persistent=True, transactional=False, multi_process=True, sorted_iteration=False)

    def path(self, key: bytes) -> str:
        return self.remote.object_path(self.namespace_id, key)

    # -- single-object operations (what the thread pools run) -----------------
    def read_object(self, key: bytes, limits: ReadLimits = ReadLimits()) -> bytes | bytearray | None:
        """The whole object of ``key``, read within the bound its header
        states and within ``limits`` (:func:`~ucm_db.remote.object_reads.read_object`);
        None if absent or not a regular file."""
        return read_object(self.remote, self.path(key), key, FIRST_READ_BYTES, limits)

    def fetch(self, key: bytes, limits: ReadLimits = ReadLimits()) -> RemoteObject | None:
        """The verified object of ``key``; None if absent, corrupt or too
        large (counted apart, as ``too_large``).

        Raises:
            ReadAbandoned: ``limits`` stopped the read (nothing counted).
        """
        self.remote.count(gets=1)
        try:
            data = self.read_object(key, limits)
            if data is None:
                return None
            obj = unpack_object(data, key, self.remote.auth, self.remote.sealing)
            check_raw_bytes(obj.raw_bytes, self.remote.max_object_bytes)  # an encrypted one's header is read only now
        except ObjectTooLargeError as exc:
            self.remote.refuse_too_large(self.path(key), exc.message)
            return None
        except CorruptBlockError:
            self.remote.count(corrupt=1)
            return None
        except UnauthenticatedObject as exc:
            self.remote.count(**{exc.reason: 1})
            return None
        if obj.namespace_id != self.namespace_id:
            self.remote.count(corrupt=1)
            return None
        return obj

    def probe(self, key: bytes) -> RemoteObject | None:
        """Presence check reading only the envelope and codec header (one
        ranged request); returns the object without its blob, or None."""
        data = self.remote.read_range(self.path(key), 0, PROBE_BYTES)
        if data is None:
            return None
        try:
            parent, namespace_id = parse_envelope(data, key)
        except CorruptBlockError:
            self.remote.count(corrupt=1)
            return None
        # The blob itself is verified when fetched; a probe only needs the
        # envelope (parent) to be intact and the blob to start like one.
        problem = probe_problem(data, self.remote.auth, self.remote.sealing)
        if problem is not None:
            self.remote.count(**{problem: 1})
            return None
        if namespace_id != self.namespace_id:
            self.remote.count(corrupt=1)
            return None
        return RemoteObject(key, parent, namespace_id, b"", -1)

    def store(self, key: bytes, parent: bytes | None, blob: Buffer) -> int:
        """Uploads one block as a whole object; returns bytes written (0:
        ``exclusive`` and an object was there, left as it is)."""
        data = pack_object(key, parent, self.namespace_id, blob, self.remote.auth, self.remote.sealing)
        self.remote.count(requests=1, puts=1)
        self.stored_head = None
        try:
            if self.exclusive and not write_new(self.remote.fs, self.path(key), data, self.syncs):
                return 0
            if not self.exclusive:
                write_whole(self.remote.fs, self.path(key), data, self.syncs)
        except BaseException:
            self.remote.count(errors=1)
            raise
        self.stored_head = bytes(memoryview(data)[:PROBE_BYTES])
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
        """Deletes the objects of ``keys``; returns how many were there.
        ``exists`` only counts (an object store deletes a missing key silently):
        the delete goes whatever it answered (a lagging answer on an eventually
        consistent store skipped it, and a retraction was confirmed)."""
        removed = 0
        for key in keys:
            self.remote.count(requests=2)
            present = self.remote.fs.exists(self.path(key))
            try:
                remove_whole(self.remote.fs, self.path(key))
            except FileNotFoundError:
                continue
            removed += bool(present)
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

