"""The tiered block store: the public object behind :func:`ucm_db.open`.

A :class:`Store` turns ``(namespace, keys, payloads)`` into encoded blocks in a
:class:`~ucm_db.tiers.local.LocalTier`, and back.

Invariants:
    * A block is visible only after the transaction that put it commits.
    * Every payload read is verified (header, owning key, checksum) before a
      byte reaches the caller; a corrupt block reads as ``None`` and is
      quarantined, together with its descendants (prefix invariant).
    * Reader activity (LRU touches, hit and miss counts) is kept in memory
      and folded into the next write, or written by the maintenance thread
      every ``sync_interval_s``: reads never take the writer lock.
    * The store is safe for threads, and for several processes on one node
      with the LMDB engine; it re-opens itself in a forked child.
    * With a ``remote``: every block put is queued for upload in its own
      commit (write-back drains the queue in the background; write-through
      uploads before ``put`` returns); local misses in lookup/get read
      through to the remote and promote into the local tier (see
      :mod:`ucm_db.readthrough`); a lookup waits at most
      ``remote_deadline_s`` on the remote.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

from ucm_db import codec
from ucm_db.config import PERSISTED_FIELDS, StoreConfig
from ucm_db.errors import ClosedError, ConfigError, CorruptBlockError, FormatVersionError, MissingAncestorError, TierError
from ucm_db.keys import KEY_BYTES, Namespace
from ucm_db.storelock import hold_shared
from ucm_db.tiers.base import Buffer, Engine
from ucm_db.tiers.local import BlockEntry, LocalTier, PendingActivity, PutResult

if TYPE_CHECKING:
    from ucm_db.readthrough import RemoteLink
    from ucm_db.uploader import Uploader
    from ucm_db.warming import WarmProgress, WarmReport

#: A bulk remote fetch (get of local misses) waits this many lookup deadlines.
FETCH_DEADLINE_FACTOR = 10
#: Default seconds flush() waits for the upload queue to drain.
FLUSH_UPLOAD_TIMEOUT_S = 60.0

#: On-disk format of the store's tables; migrations move stores between them.
STORE_FORMAT_VERSION = 3
FORMAT_VERSION_KEY = b"format_version"
#: JSON record of the code that created the store (format 2 on; see migrations).
CREATED_KEY = b"created"
SETTINGS_KEY = b"settings"
_ACTIVITY_FLUSH_KEYS = 4096

Payload = Union[Buffer, Sequence[Buffer]]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    description: dict[str, Any]
    blocks: int
    raw_bytes: int
    stored_bytes: int
    last_use_ns: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters (committed state plus this
    process's not yet flushed hits and misses)."""

    path: str
    engine: str
    format_version: int
    settings: dict[str, Any]
    capacity_bytes: int
    blocks: int
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    hits: int
    misses: int
    evictions: int
    quarantined: int
    pending_uploads: int
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compression_ratio"] = self.compression_ratio
        return out


def open(path: str | os.PathLike[str], **options: Any) -> Store:  # noqa: A001 - public API name
    """Opens (creating if needed) the store at ``path``.

    Args:
        path: store directory on a local disk.
        **options: :class:`~ucm_db.config.StoreConfig` fields by name. On an
            existing store, omitted persisted settings (capacity, codec,
            durability, engine) come from the store; a conflicting one is a
            :class:`~ucm_db.errors.ConfigError`.
    """
    return Store(path, **options)


def detect_engine(path: Path) -> str | None:
    """The engine of an existing store directory, or None if there is none."""
    for name in ("lmdb", "rocksdb"):
        if (path / name).is_dir():
            return name
    return None


def _make_engine(path: Path, config: StoreConfig) -> Engine:
    if config.engine == "memory":
        from ucm_db.tiers.memory import MemoryEngine

        return MemoryEngine()
    if config.engine == "rocksdb":
        from ucm_db.tiers.rocksdb import RocksDbEngine  # type: ignore[import-not-found]

        return RocksDbEngine(path / "rocksdb", sync=config.durability == "sync")  # type: ignore[no-any-return]
    from ucm_db.tiers.lmdb import LmdbEngine

    map_size = config.map_size_bytes or max(64 << 20, 2 * config.capacity_bytes + (256 << 20))
    return LmdbEngine(path / "lmdb", map_size_bytes=map_size, sync=config.durability == "sync", max_readers=config.max_readers)


class Store:
    """A KV block store (see module invariants). Use :func:`ucm_db.open`."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self.path = Path(path)
        explicit = dict(options)
        StoreConfig.from_dict(explicit)  # reject unknown or invalid options early
        if "engine" not in explicit:
            existing = detect_engine(self.path)
            if existing is not None:
                explicit["engine"] = existing
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._dir_lock = hold_shared(self.path)  # keeps compact/migrate from rewriting files under us
        self.config = StoreConfig.from_dict(explicit)
        try:
            self._engine = _make_engine(self.path, self.config)
            self._tier = LocalTier(self._engine, capacity_bytes=self.config.capacity_bytes)
            self.config = self._adopt_settings(explicit)
        except BaseException:
            # A refused store (format, settings, lock) is let go at once, so
            # e.g. `migrate` in this same process can take it.
            if hasattr(self, "_engine"):
                self._engine.close()
            self._dir_lock.release()
            raise
        self._tier.capacity_bytes = self.config.capacity_bytes
        self._closed = False
        self._lock = threading.Lock()
        self._activity = PendingActivity()
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._unsynced_bytes = 0
        self._maintenance: threading.Thread | None = None
        self._remote: RemoteLink | None = None
        self._uploader: Uploader | None = None
        if self.config.remote is not None:
            from ucm_db.readthrough import RemoteLink

            self._remote = RemoteLink(self.config.remote, dict(self.config.remote_options))
        self._ensure_process()

    # -- setup -----------------------------------------------------------------
    def _adopt_settings(self, explicit: Mapping[str, Any]) -> StoreConfig:
        """Records settings in a new store, or checks them against an old one."""
        wanted = self.config.persisted()

        def run(txn: Any) -> tuple[int, dict[str, Any]]:
            version = txn.get("info", FORMAT_VERSION_KEY)
            settings = txn.get("info", SETTINGS_KEY)
            if version is None:
                txn.put("info", FORMAT_VERSION_KEY, str(STORE_FORMAT_VERSION).encode())
                txn.put("info", SETTINGS_KEY, json.dumps(wanted, sort_keys=True).encode())
                txn.put("info", CREATED_KEY, creation_record())
                return STORE_FORMAT_VERSION, wanted
            return int(bytes(version)), json.loads(bytes(settings)) if settings is not None else {}

        version, stored = self._engine.write(run)
        check_format_version(version, self.path)
        for name in PERSISTED_FIELDS:
            if name in explicit and name in stored and explicit[name] != stored[name]:
                raise ConfigError(
                    f"{name}={explicit[name]!r} conflicts with the store at {self.path}, created with {name}={stored[name]!r}",
                    hint=f"omit {name} to use the stored setting, or use a new store path",
                )
        merged = {**{k: v for k, v in explicit.items()}, **{k: v for k, v in stored.items() if k in PERSISTED_FIELDS}}
        return StoreConfig.from_dict(merged)

    def _ensure_process(self) -> None:
        """Starts this process's thread pool and maintenance thread (again
        after a fork)."""
        if self._pid == os.getpid():
            return
        with self._lock if self._pid == -1 else _fresh_lock(self):
            if self._pid == os.getpid():
                return
            self._activity = PendingActivity()
            self._pool = ThreadPoolExecutor(self.config.encode_threads, "ucm-db-codec") if self.config.encode_threads else None
            self._stop = threading.Event()
            self._wake = threading.Event()
            self._unsynced_bytes = 0
            self._maintenance = threading.Thread(target=self._maintain, name="ucm-db-maintenance", daemon=True)
            self._start_uploader()
            self._pid = os.getpid()
            self._maintenance.start()

    def _start_uploader(self) -> None:
        if self._remote is None:
            return
        from ucm_db.uploader import Uploader

        if self._pid != -1:  # a forked child: the parent's threads are gone
            self._remote.after_fork()
            if self._uploader is not None:
                self._uploader.forget_lock_after_fork()
        self._uploader = Uploader(self._tier, self._remote.root, self.path, concurrency=self.config.upload_concurrency)
        self._uploader.start()

    def _maintain(self) -> None:
        """Every ``sync_interval_s``, or when woken by ``sync_bytes`` of
        group commits: folds reader activity in and (group) syncs."""
        while True:
            woken = self._wake.wait(self.config.sync_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if not woken:
                    self._flush_activity()
                if self.config.durability == "group":
                    with self._lock:
                        self._unsynced_bytes = 0
                    self._engine.sync()
            except Exception:  # noqa: BLE001 - keep the thread alive; the next flush() reports
                pass

    def _committed(self, stored_bytes: int) -> None:
        """Counts group-commit bytes; wakes the sync once ``sync_bytes`` are
        unsynced, so the disk's write-back overlaps the next puts."""
        if self.config.durability != "group" or not stored_bytes:
            return
        with self._lock:
            self._unsynced_bytes += stored_bytes
            due = self._unsynced_bytes >= self.config.sync_bytes
        if due:
            self._wake.set()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.path} is closed")
        self._ensure_process()

    # -- writes ----------------------------------------------------------------
    def put(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        parent: bytes | None = None,
    ) -> PutResult:
        """Atomically stores a chain segment.

        Args:
            namespace: the blocks' namespace.
            keys: consecutive chain keys (``keys[i]``'s parent is
                ``keys[i-1]``).
            payloads: one per key: bytes-like, or a sequence of per-layer
                frames (stored as separately decodable frames).
            parent: key of the block before ``keys[0]``; None if ``keys[0]``
                is the chain's first block.

        Raises:
            MissingAncestorError: ``parent`` is not stored (nothing written).
            StoreFullError: the batch alone exceeds ``capacity_bytes``.
        """
        self._check_open()
        if len(keys) != len(payloads):
            raise ConfigError(f"put got {len(keys)} keys and {len(payloads)} payloads", hint="pass one payload per key")
        _require_keys(keys)
        if not keys:
            return PutResult()
        parents = [parent, *keys[:-1]]
        present = self._tier.exists(keys)
        todo = [i for i, p in enumerate(present) if not p]
        try:
            return self._put_indices(namespace, keys, payloads, parents, todo)
        except MissingAncestorError:
            if len(todo) == len(keys):
                raise
            # A block seen present was evicted meanwhile: put the whole chain.
            return self._put_indices(namespace, keys, payloads, parents, list(range(len(keys))))

    def _put_indices(
        self, namespace: Namespace, keys: Sequence[bytes], payloads: Sequence[Payload],
        parents: Sequence[bytes | None], todo: list[int],
    ) -> PutResult:
        encoded = self._encode_many([(keys[i], payloads[i]) for i in todo], namespace)
        entries = [
            BlockEntry(keys[i], parents[i], block.head, block.body_buffer(), block.raw_len, namespace.digest[:16])
            for i, block in zip(todo, encoded)
        ]
        activity = self._take_activity()
        desc = _namespace_description(namespace)
        try:
            result = self._tier.put_blocks(
                entries, namespace_desc=desc, enqueue_upload=self._remote is not None, activity=activity,
            )
        except BaseException:
            self._return_activity(activity)
            raise
        result.already_present += len(keys) - len(todo)
        self._committed(sum(e.stored_bytes for e in entries))
        if self._uploader is not None and entries:
            if self.config.remote_mode == "write_through":
                self._upload_through(entries)
            else:
                self._uploader.notify()
        return result

    def _upload_through(self, entries: list[BlockEntry]) -> None:
        """Write-through: uploads the batch before put returns. The blocks
        are committed and queued already, so a failure loses nothing."""
        assert self._uploader is not None
        errors = self._uploader.upload_now([(e.key, e.parent, e.namespace_id, b"".join([e.head, e.body])) for e in entries])
        if errors:
            self._uploader.notify()
            raise TierError(
                f"write-through upload of {len(errors)} of {len(entries)} block(s) failed: {errors[0]}",
                hint="the blocks are stored locally and queued; the background uploader retries them",
            )

    def _encode_many(self, items: list[tuple[bytes, Payload]], namespace: Namespace) -> list[codec.EncodedBlock]:
        element_bytes = codec.element_bytes_for(namespace.kv_dtype)
        cfg = self.config

        def encode_one(item: tuple[bytes, Payload]) -> codec.EncodedBlock:
            key, payload = item
            # A list or tuple is per-layer frames; anything else (bytes, numpy
            # array, memoryview) is one buffer.
            frames: list[Any] = list(payload) if isinstance(payload, (list, tuple)) else [payload]
            return codec.encode_parts(key, frames, codec=cfg.codec, element_bytes=element_bytes, level=cfg.zstd_level)

        if self._pool is None or len(items) < 2 or cfg.codec == "none":
            return [encode_one(item) for item in items]
        return list(self._pool.map(encode_one, items))

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Deletes blocks and their descendants; returns blocks removed."""
        self._check_open()
        _require_keys(keys)
        return self._tier.delete(keys)

    # -- reads -------------------------------------------------------------------
    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` stored: O(log n) reads."""
        self._check_open()
        # Checked: the first and last key and the O(log n) keys the binary
        # search reads. A full scan of 8192 keys costs more than the lookup
        # itself, and a malformed key reads as absent (none is ever stored).
        if keys:
            _require_keys((keys[0], keys[-1]))
        count = self._tier.count_prefix(_ProbedKeys(keys))
        if self._remote is not None and count < len(keys):
            count, _ = self._remote.extend_prefix(
                self._tier, namespace.digest[:16], keys, count, self.config.remote_deadline_s,
            )
        return count

    def get(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bytearray | None]:
        """Raw payloads of ``keys``; ``None`` for a miss or a corrupt block."""
        self._check_open()
        _require_keys(keys)
        corrupt: list[tuple[bytes, str]] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bytearray | None:
            try:
                return codec.decode_parts(head, body, keys[i])
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return None

        results = self._tier.with_blocks(keys, lambda blocks: self._decode_blocks(blocks, decode))
        for i, blob in self._read_through(namespace, keys, results, corrupt).items():
            results[i] = codec.decode(blob, keys[i])
        return self._finish_read(keys, results, corrupt)

    def _decode_blocks(
        self, blocks: list[tuple[memoryview, memoryview] | None], decode: Callable[[int, memoryview, memoryview], T],
    ) -> list[T | None]:
        """``decode(i, head, body)`` for each present block, inside the
        caller's read transaction. Compressed blocks of a batch are decoded
        on the codec threads straight from the stored bytes (no copy out);
        raw ones are one memcpy each and stay on this thread."""
        results: list[T | None] = [None] * len(blocks)
        compressed: list[int] = []
        for i, block in enumerate(blocks):
            if block is None:
                continue
            if self._pool is not None and codec.codec_of_head(block[0]) == "zstd":
                compressed.append(i)
            else:
                results[i] = decode(i, *block)
        if len(compressed) == 1:
            results[compressed[0]] = decode(compressed[0], *blocks[compressed[0]])  # type: ignore[misc]
        elif compressed:
            assert self._pool is not None  # only blocks for the pool were listed
            done = self._pool.map(lambda i: decode(i, *blocks[i]), compressed)  # type: ignore[misc]
            for i, value in zip(compressed, done):
                results[i] = value
        return results

    def _read_through(
        self, namespace: Namespace, keys: Sequence[bytes], results: list[Any], corrupt: list[tuple[bytes, str]],
    ) -> dict[int, Buffer]:
        """Fetches local misses (corrupt local blocks included: the remote
        copy is verified on its own) from the remote, promotes what keeps
        the prefix invariant, and returns verified blobs by index."""
        if self._remote is None:
            return {}
        missing = [i for i, r in enumerate(results) if r is None]
        if not missing:
            return {}
        from ucm_db.readthrough import promotable_runs, promote

        deadline = time.monotonic() + FETCH_DEADLINE_FACTOR * self.config.remote_deadline_s
        objects = self._remote.fetch_many(namespace.digest[:16], [keys[i] for i in missing], deadline)
        for run in promotable_runs(self._tier, objects):
            promote(self._tier, run)
        return {i: obj.blob for i, obj in zip(missing, objects) if obj is not None}

    def get_into(self, namespace: Namespace, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Decodes blocks straight into caller-provided buffers.

        Returns:
            For each key, True if ``buffers[i]`` now holds the block.
        """
        self._check_open()
        _require_keys(keys)
        if len(keys) != len(buffers):
            raise ConfigError("get_into needs one buffer per key", hint="pass len(keys) buffers")
        corrupt: list[tuple[bytes, str]] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bool:
            try:
                codec.decode_parts_into(head, body, keys[i], buffers[i])
                return True
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return False

        results = self._tier.with_blocks(keys, lambda blocks: self._decode_blocks(blocks, decode))
        flags: list[Any] = [True if r else None for r in results]
        for i, blob in self._read_through(namespace, keys, flags, corrupt).items():
            codec.decode_into(blob, keys[i], buffers[i])
            flags[i] = True
        done = self._finish_read(keys, flags, corrupt)
        return [r is not None for r in done]

    def _finish_read(self, keys: Sequence[bytes], results: list[Any], corrupt: list[tuple[bytes, str]]) -> list[Any]:
        for key, reason in corrupt:
            self._quarantine(key, reason)
        now = time.time_ns()
        with self._lock:
            activity = self._activity
            for key, value in zip(keys, results):
                if value is None:
                    activity.misses += 1
                else:
                    activity.hits += 1
                    activity.touched[key] = now
            big = len(activity.touched) >= _ACTIVITY_FLUSH_KEYS
        if big:
            self._flush_activity()
        return results

    def _quarantine(self, key: bytes, reason: str) -> None:
        def still_corrupt(head: memoryview, body: memoryview) -> bool:
            try:
                codec.verify_parts(head, body, key)
                return False
            except CorruptBlockError:
                return True
        self._tier.quarantine(key, reason, still_corrupt)

    # -- activity, durability ------------------------------------------------------
    def _take_activity(self) -> PendingActivity:
        with self._lock:
            activity, self._activity = self._activity, PendingActivity()
        return activity

    def _return_activity(self, activity: PendingActivity) -> None:
        with self._lock:
            for key, ns in activity.touched.items():
                self._activity.touched[key] = max(ns, self._activity.touched.get(key, 0))
            self._activity.hits += activity.hits
            self._activity.misses += activity.misses

    def _flush_activity(self) -> None:
        activity = self._take_activity()
        try:
            self._tier.apply_activity(activity)
        except BaseException:
            self._return_activity(activity)
            raise

    def flush(self, *, upload_timeout_s: float | None = FLUSH_UPLOAD_TIMEOUT_S) -> None:
        """Writes pending activity, makes every commit durable and, with a
        remote, waits until the upload queue is empty.

        Args:
            upload_timeout_s: longest wait for the upload queue (None: no
                limit).

        Raises:
            TierError: uploads still pending after ``upload_timeout_s``
                (they stay queued and resume).
        """
        self._check_open()
        self._flush_activity()
        self._engine.sync()
        if self._uploader is not None:
            self._uploader.wait_drained(upload_timeout_s)

    def warm(
        self,
        namespace: Namespace,
        *,
        token_sequences: Sequence[Sequence[int]] | None = None,
        keys: Sequence[bytes] | Sequence[Sequence[bytes]] | None = None,
        progress: WarmProgress | None = None,
    ) -> WarmReport:
        """Pulls what the remote has of these chains into the local tier
        ahead of traffic; see :func:`ucm_db.warming.warm`."""
        from ucm_db.warming import warm

        return warm(self, namespace, token_sequences=token_sequences, keys=keys, progress=progress)

    @property
    def remote(self) -> RemoteLink | None:
        """The remote tier link, or None without a ``remote``."""
        return self._remote

    def close(self) -> None:
        """Flushes and closes; further calls raise ClosedError."""
        if self._closed:
            return
        if self._pid == os.getpid():
            self._stop.set()
            self._wake.set()
            if self._maintenance is not None:
                self._maintenance.join()
            if self._uploader is not None:
                self._uploader.stop()
            if self._remote is not None:
                self._remote.close()
            try:
                self._flush_activity()
                self._engine.sync()
            finally:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
        self._closed = True
        self._engine.close()
        self._dir_lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------
    @property
    def tier(self) -> LocalTier:
        """The local tier (for tools and tests)."""
        return self._tier

    def stats(self) -> StoreStats:
        """Counters of the whole store (all processes), plus this process's
        unflushed hits and misses."""
        self._check_open()
        totals = self._tier.totals()
        with self._lock:
            hits, misses = self._activity.hits, self._activity.misses
        descriptions = self._tier.namespace_descriptions()
        namespaces = {
            ns_id.hex(): NamespaceStats(descriptions.get(ns_id, {}), *counts)
            for ns_id, counts in self._tier.namespace_counts().items()
            if counts[0]
        }
        return StoreStats(
            path=str(self.path), engine=self.config.engine, format_version=STORE_FORMAT_VERSION,
            settings=self.config.to_dict(), capacity_bytes=self.config.capacity_bytes,
            blocks=totals.blocks, raw_bytes=totals.raw_bytes, stored_bytes=totals.stored_bytes,
            file_bytes=self._engine.file_bytes(), hits=totals.hits + hits, misses=totals.misses + misses,
            evictions=totals.evictions, quarantined=totals.quarantined,
            pending_uploads=len(self._tier.pending_uploads()), namespaces=namespaces,
            remote=self._remote_stats(),
        )

    def _remote_stats(self) -> dict[str, Any]:
        if self._remote is None:
            return {}
        from ucm_db.uploader import describe

        return {"url": self.config.remote, **asdict(self._remote.root.stats), **describe(self._uploader),
                "breaker_trips": self._remote.breaker.trips}


class _ProbedKeys(Sequence[bytes]):
    """A view of ``keys`` that refuses a malformed key when it is read."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: Any) -> Any:
        key = self._keys[index]
        if isinstance(index, int) and len(key) != KEY_BYTES:
            raise ConfigError(f"block keys are {KEY_BYTES} bytes, got one of {len(key)}", hint="use Namespace.block_keys")
        return key


@functools.lru_cache(maxsize=256)
def _namespace_description(namespace: Namespace) -> tuple[bytes, bytes]:
    """(namespace id, JSON description) recorded with a namespace's blocks;
    cached: building it cost 0.15 ms, most of a small commit."""
    return namespace.digest[:16], json.dumps(namespace.to_dict(), sort_keys=True).encode()


def _require_keys(keys: Sequence[bytes]) -> None:
    """Refuses keys that are not 32-byte block keys (map(len) runs in C: a
    lookup of 8192 keys stays cheap)."""
    lengths = set(map(len, keys))
    if lengths - {KEY_BYTES}:
        bad = sorted(lengths - {KEY_BYTES})[0]
        raise ConfigError(f"block keys are {KEY_BYTES} bytes, got one of {bad}", hint="use Namespace.block_keys")


def _fresh_lock(store: Store) -> threading.Lock:
    # After fork the parent's lock may be held by a thread that does not
    # exist here: give the child a new one.
    store._lock = threading.Lock()
    return store._lock


def creation_record() -> bytes:
    """The ``info/created`` record of a store this code creates."""
    from ucm_db import __version__

    record = {"ucm_db_version": __version__, "created_ns": time.time_ns(), "format_version": STORE_FORMAT_VERSION}
    return json.dumps(record, sort_keys=True).encode()


def check_format_version(version: int, path: Path) -> None:
    """Refuses stores of another format version, with the fix."""
    if version < STORE_FORMAT_VERSION:
        raise FormatVersionError(f"store at {path} has format {version}, this ucm-db reads {STORE_FORMAT_VERSION}", hint=f"run `ucm-db migrate {path}`")
    if version > STORE_FORMAT_VERSION:
        raise FormatVersionError(
            f"store at {path} has format {version}, newer than this ucm-db ({STORE_FORMAT_VERSION})",
            hint="upgrade ucm-db; older code never writes to a newer store",
        )
