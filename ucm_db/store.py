"""The tiered block store: the public object behind :func:`ucm_db.open`.

A :class:`Store` turns ``(namespace, keys, payloads)`` into encoded blocks in a
:class:`~ucm_db.tiers.local.LocalTier`, and back.

Invariants:
    * A block is visible only after the transaction that put it commits.
    * Every payload read is verified (header, owning key, checksum) before
      it is reported read (``get_into`` verifies a raw body as it copies it:
      a failed block's flag is False, its buffers may hold its bytes); a
      corrupt block reads as a miss and is quarantined with its descendants.
    * Reader activity (LRU touches, hit and miss counts) is kept in memory
      and folded into the next write, or written by the maintenance thread
      (:mod:`ucm_db.background`): reads never open a write transaction.
    * The store is safe for threads, and for several processes on one node
      with the LMDB engine; it re-opens itself in a forked child.
    * With a ``remote``: every block put is queued for upload in its own
      commit (write-back drains the queue in the background; write-through
      uploads before ``put`` returns); local misses in lookup/get read
      through to the remote and promote into the local tier (the remote
      wing, :mod:`ucm_db.remote`); a lookup waits at most
      ``remote_deadline_s`` on the remote.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ucm_db import codec, epochs, raw_loads
from ucm_db.auth import load_keys
from ucm_db.background import Background
from ucm_db.codec_pool import CodecPool, Payload
from ucm_db.config import CODECS, PERSISTED_FIELDS, StoreConfig
from ucm_db.format import (  # noqa: F401 - re-exported: ucm_db.store.STORE_FORMAT_VERSION and friends
    CREATED_KEY, FORMAT_VERSION_KEY, SETTINGS_KEY, STORE_FORMAT_VERSION, check_format_version, check_persisted_settings, checked_format_version,
    creation_record, detect_engine, engine_for_config, parse_format_version, write_format_version,
)
from ucm_db.errors import ClosedError, ConfigError, CorruptBlockError, MissingAncestorError, TierError
from ucm_db.tiers import records
from ucm_db.tiers.accounting import seal_records
from ucm_db.arguments import (
    UNSET, ProbedKeys, Unset, key_list, parse_settings, require_keys, require_namespace, require_payload, require_writable,
    segment_list, segment_parent,
)
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.stats import NamespaceStats, StoreStats
from ucm_db.storelock import ensure_store_dir, hold_shared
from ucm_db.store_path import detect_engine_checked, permission_error, store_path
from ucm_db.events import BlockEventFields, ChangeBatch, EventInventory, pack_event_fields
from ucm_db.tiers import changefeed
from ucm_db.tiers.base import Buffer
from ucm_db.tiers.local import BlockEntry, LocalTier, PutResult

if TYPE_CHECKING:
    from ucm_db.remote.warming import WarmProgress, WarmReport
    from ucm_db.remote.wing import RemoteWing

logger = logging.getLogger("ucm_db")

#: Default seconds flush() waits for the upload queue to drain.
FLUSH_UPLOAD_TIMEOUT_S = 60.0




def open(path: str | os.PathLike[str], **options: Any) -> Store:  # noqa: A001 - public API name
    """Opens (creating if needed) the store at ``path``.

    Args:
        path: store directory on a local disk.
        **options: :class:`~ucm_db.config.StoreConfig` fields by name. On an
            existing store, omitted persisted settings (capacity, codec,
            durability, engine) come from the store; a conflicting one is a
            :class:`~ucm_db.errors.ConfigError`. ``read_only=True`` opens an
            existing store (on a read-only volume too) without writing
            anything; puts and deletes then raise
            :class:`~ucm_db.errors.TierError`.
    """
    return Store(path, **options)


class Store:
    """A KV block store (see module invariants). Use :func:`ucm_db.open`."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self.path = store_path(path)  # bytes, "", too long, inside another store: ConfigError, nothing created
        explicit = dict(options)
        checked = StoreConfig.from_dict(explicit)  # reject unknown or invalid options early
        auth_keys = load_keys(checked.remote_auth_key_file, checked.remote_auth_key_env)  # a bad key: before anything opens
        existing = detect_engine_checked(self.path)
        if "engine" not in explicit:
            if existing is not None:
                explicit["engine"] = existing
        elif existing is not None and explicit["engine"] != existing:
            # Opening with another engine would start a second, empty store
            # beside this one and miss everything stored.
            raise ConfigError(
                f"engine={explicit['engine']!r} conflicts with the store at {self.path}, which is a {existing} store",
                hint=f"omit engine (or pass engine={existing!r}) to open it, or use a new store path for another engine",
            )
        read_only = explicit.get("read_only") is True
        if read_only and existing is None:
            raise TierError(
                f"no ucm-db store at {self.path} to open read-only",
                hint="check the path (a read-only open never creates a store), or open it writable once to create it",
            )
        if not read_only:
            ensure_store_dir(self.path)  # a file or a read-only volume is a TierError with the fix
        # Keeps compact/migrate from rewriting files under us (read-only: creating nothing).
        self._dir_lock = hold_shared(self.path, read_only=read_only)
        self.config = StoreConfig.from_dict(explicit)
        try:
            self._engine = engine_for_config(self.path, self.config)
            self._tier = LocalTier(self._engine, capacity_bytes=self.config.capacity_bytes)
            self.config = self._adopt_settings(explicit)
        except BaseException as exc:
            # A refused store (format, settings, lock) is let go at once, so
            # e.g. `migrate` in this same process can take it.
            if hasattr(self, "_engine"):
                self._engine.close()
            self._dir_lock.release()
            if isinstance(exc, PermissionError):  # e.g. an unreadable data file, read-only open included
                raise permission_error(self.path, exc) from exc
            raise
        self._tier.capacity_bytes = self.config.capacity_bytes
        self._closed = False
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: CodecPool | None = None
        self._background: Background | None = None
        #: The remote wing (link, promotion, uploader); None without a ``remote``.
        self._wing: RemoteWing | None = None
        if self.config.remote is not None:
            from ucm_db.remote.wing import RemoteWing  # loaded only by a store with a remote

            self._wing = RemoteWing(self.config, auth_keys, self._tier, self.path)
        self._ensure_process()

    # -- setup -----------------------------------------------------------------
    def _adopt_settings(self, explicit: Mapping[str, Any]) -> StoreConfig:
        """Records settings in a new store, or checks them against an old one."""
        wanted = self.config.persisted()

        def run(txn: Any) -> tuple[int, dict[str, Any]]:
            version = checked_format_version(txn)
            settings = txn.get("info", SETTINGS_KEY)
            if version is None:
                if self.config.read_only:
                    raise TierError(f"the store at {self.path} was never initialised: it records no format version",
                                    hint="open it writable once, or check the path")
                write_format_version(txn)
                records.put_checked(txn, SETTINGS_KEY, json.dumps(wanted, sort_keys=True).encode())
                txn.put("info", CREATED_KEY, creation_record())
                return STORE_FORMAT_VERSION, wanted
            if settings is not None:
                try:
                    records.check(txn, SETTINGS_KEY, settings)
                except records.DamagedRecord:
                    settings = b"damaged"  # parse_settings names it
            return parse_format_version(version), parse_settings(settings, self.path)

        version, stored = (self._engine.read if self.config.read_only else self._engine.write)(run)
        check_format_version(version, self.path)
        check_persisted_settings(stored, self.path)
        if not self.config.read_only:
            # Records of older code get checksums; their counters are recounted first (issue 26 item 18).
            self._engine.write(seal_records)
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
            self._pool = CodecPool(self.config.encode_threads)
            self._background = Background(self.path, self._engine, self._tier, self.config)
            if self._wing is not None:
                self._wing.start_process(forked=self._pid != -1)  # a forked child: the parent's threads are gone
            self._pid = os.getpid()
            self._background.start()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.path} is closed")
        self._ensure_process()

    @property
    def _codecs(self) -> CodecPool:
        """This process's codec threads (made again after a fork)."""
        assert self._pool is not None  # made in __init__ and after every fork
        return self._pool

    @property
    def _activity(self) -> Background:
        """This process's background work (made again after a fork)."""
        assert self._background is not None  # made in __init__ and after every fork
        return self._background

    def _refuse_read_only(self, operation: str) -> None:
        if self.config.read_only:
            raise TierError(f"{operation} on store {self.path}, which is open read-only",
                            hint="open it without read_only=True (on a writable volume) to store or delete blocks")

    def _check_writable(self) -> None:
        self._check_open()
        self._refuse_read_only("put")
        failure = self._activity.failure
        if failure is not None:
            raise TierError(
                f"store {self.path}: its maintenance thread (background sync) died: {failure!r}; puts are refused",
                hint="close and reopen the store; if it happens again, report the error",
            )

    # -- writes ----------------------------------------------------------------
    def put(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        parent: bytes | None | Unset = UNSET,
        codec_name: str | None = None,
        event_fields: Mapping[bytes, BlockEventFields] | None = None,
    ) -> PutResult:
        """Atomically stores a chain segment.

        Either every block of the segment is stored when this returns, or
        nothing is (an eviction the put needs never removes the segment's
        own ancestors: with too little evictable room it raises
        :class:`StoreFullError` instead).

        Args:
            namespace: the blocks' namespace.
            keys: consecutive chain keys (``keys[i]``'s parent is
                ``keys[i-1]``), best a slice of :meth:`Namespace.block_keys`,
                which knows the key before its first one.
            payloads: one per key: bytes-like (C-contiguous buffers), or a
                list/tuple of per-layer frames (kept apart with codec
                ``none``; zstd compresses runs of small adjacent frames
                together, see :data:`ucm_db.codec.ZSTD_GROUP_BYTES`).
            parent: key of the block before ``keys[0]``; None if ``keys[0]``
                is the chain's first block. Needed for a plain list of keys;
                for :class:`~ucm_db.keys.BlockKeys` it defaults to (and must
                agree with) ``keys.parent``.
            codec_name: codec of these blocks (``"none"`` or ``"zstd"``);
                None: the store's ``codec``. Each block names its codec in
                its own header, so readers never need to know.
            event_fields: vLLM's event fields of some of these blocks, by
                key: those blocks are *evented* (:mod:`ucm_db.events`):
                their put and their later removal appear in
                :meth:`changes_since` and :meth:`event_inventory`. A block
                already stored keeps what it was put with.

        Raises:
            MissingAncestorError: ``parent`` is not stored (nothing written).
            StoreFullError: the batch does not fit even after evicting every
                block that is neither in it nor its ancestor (nothing written).
            ConfigError: malformed keys, parent or payloads, a plain key
                list without ``parent=``, or a key or parent stored under
                another namespace (keys built for another namespace; nothing
                written).
        """
        self._check_writable()
        require_namespace(namespace, "put")
        keys = key_list(keys, "put")
        return self._put_checked(namespace, [(keys, payloads, segment_parent(keys, parent))], codec_name, event_fields)

    def put_segments(
        self,
        namespace: Namespace,
        segments: Sequence[tuple[Sequence[bytes], Sequence[Payload]]],
        *,
        codec_name: str | None = None,
        event_fields: Mapping[bytes, BlockEventFields] | None = None,
    ) -> PutResult:
        """Atomically stores several chain segments in one transaction
        (e.g. the KV-head unit chains of one engine step): every block of
        every segment, or nothing.

        Args:
            segments: ``(keys, payloads)`` pairs; each ``keys`` is a
                :class:`~ucm_db.keys.BlockKeys` (it knows its parent). A
                segment may continue another one of the same call.
            codec_name, event_fields: as for :meth:`put`.

        Raises:
            The errors of :meth:`put`; MissingAncestorError if any
            segment's parent is neither stored nor in the call.
        """
        self._check_writable()
        require_namespace(namespace, "put_segments")
        checked: list[tuple[Sequence[bytes], Sequence[Payload], bytes | None]] = []
        for keys, payloads in segment_list(segments):
            keys = key_list(keys, "put_segments")
            if not isinstance(keys, BlockKeys):
                raise ConfigError(
                    "put_segments takes BlockKeys (keys that know their parent)",
                    hint="pass slices of Namespace.block_keys, or BlockKeys(keys, parent=...)",
                )
            checked.append((keys, payloads, keys.parent))
        return self._put_checked(namespace, checked, codec_name, event_fields)

    def _put_checked(
        self, namespace: Namespace, segments: list[tuple[Sequence[bytes], Sequence[Payload], bytes | None]],
        codec_name: str | None, event_fields: Mapping[bytes, BlockEventFields] | None = None,
    ) -> PutResult:
        packed = pack_event_fields(event_fields)
        if codec_name is None:
            codec_name = self.config.codec
        elif codec_name not in CODECS:
            raise ConfigError(f"unknown codec {codec_name!r}", hint=f"use one of {', '.join(CODECS)}, or None for the store's")
        keys: list[bytes] = []
        payloads: list[Payload] = []
        parents: list[bytes | None] = []
        for segment_keys, segment_payloads, parent in segments:
            if not isinstance(segment_payloads, Sequence) or isinstance(segment_payloads, (bytes, bytearray, memoryview, str)):
                raise ConfigError(
                    f"put takes a sequence of payloads (one per key), got {type(segment_payloads).__name__}",
                    hint="pass a list such as [block0_bytes, block1_bytes]",
                )
            if len(segment_keys) != len(segment_payloads):
                raise ConfigError(f"put got {len(segment_keys)} keys and {len(segment_payloads)} payloads", hint="pass one payload per key")
            for payload in segment_payloads:
                require_payload(payload)
            if segment_keys:
                parents.extend([parent, *segment_keys[:-1]])
                keys.extend(segment_keys)
                payloads.extend(segment_payloads)
        if not keys:
            return PutResult()
        # Presence within the namespace: a key stored under another one is a
        # ForeignNamespaceError (ConfigError) here, before anything is encoded.
        present = self._tier.present_for_put(keys, _namespace_description(namespace))
        todo = [i for i, p in enumerate(present) if not p]
        try:
            return self._put_indices(namespace, keys, payloads, parents, todo, codec_name, packed)
        except MissingAncestorError:
            if len(todo) == len(keys):
                raise
            # A block seen present was evicted meanwhile: put the whole chain.
            return self._put_indices(namespace, keys, payloads, parents, list(range(len(keys))), codec_name, packed)

    def _put_indices(
        self, namespace: Namespace, keys: Sequence[bytes], payloads: Sequence[Payload],
        parents: Sequence[bytes | None], todo: list[int], codec_name: str, packed: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        encoded = self._codecs.encode_many(
            [(keys[i], payloads[i]) for i in todo], codec_name=codec_name,
            element_bytes=codec.element_bytes_for(namespace.kv_dtype), level=self.config.zstd_level,
        )
        entries = [
            BlockEntry(keys[i], parents[i], block.head, block.body_buffer(), block.raw_len, namespace.digest[:16],
                       None if packed is None else packed.get(keys[i]))
            for i, block in zip(todo, encoded)
        ]
        activity = self._activity.take()
        desc = _namespace_description(namespace)
        try:
            skipped = set(range(len(keys))) - set(todo)
            result = self._tier.put_blocks(
                entries, namespace_desc=desc, enqueue_upload=self._wing is not None, activity=activity,
                protect=[keys[i] for i in sorted(skipped)],
            )
        except BaseException:
            self._activity.give_back(activity)
            raise
        result.already_present += len(keys) - len(todo)
        self._activity.committed(sum(e.stored_bytes for e in entries))
        if self._wing is not None and entries:
            self._wing.upload(entries)
        return result

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """Deletes ``namespace``'s blocks among ``keys`` and their
        descendants; returns blocks removed. A key stored under another
        namespace is left alone (it counts as not removed).

        Raises:
            ConfigError: a descendant is stored under another namespace (a
                chain written before puts refused that); nothing is deleted.
        """
        self._check_open()
        require_namespace(namespace, "delete")
        self._refuse_read_only("delete")
        keys = key_list(keys, "delete")
        removed = self._tier.delete(keys, namespace_id=namespace.digest[:16])
        self._activity.committed(0)  # a delete writes index pages only: its file growth counts
        return removed

    # -- KV cache events (ucm_db.events) -------------------------------------------
    def changes_since(self, seq: int, limit: int = 1024, *, namespace: Namespace | None = None) -> ChangeBatch:
        """Change feed records from ``seq`` on (at most ``limit`` seqs;
        of ``namespace`` only, if given), written by any process. One read
        transaction; with nothing new, one record read. ``resync`` set: the
        reader fell behind the feed's bound: clear, then :meth:`event_inventory`."""
        self._check_open()
        ns_id = None
        if namespace is not None:
            require_namespace(namespace, "changes_since")
            ns_id = namespace.digest[:16]
        return self._engine.read(lambda txn: changefeed.since(txn, seq, limit, None if ns_id is None else {ns_id}))

    def event_inventory(self, *, namespace: Namespace | None = None, namespace_id: bytes | None = None) -> EventInventory:
        """Every evented block stored now (of a namespace, if given) as
        ``stored`` records, parents first, with the feed's ``next_seq`` of
        the same snapshot (follow :meth:`changes_since` from there)."""
        self._check_open()
        if namespace is not None:
            require_namespace(namespace, "event_inventory")
            namespace_id = namespace.digest[:16]
        wanted = None if namespace_id is None else {namespace_id}
        found, next_seq = self._engine.read(lambda txn: changefeed.inventory(txn, wanted))
        return EventInventory(tuple(found), next_seq)

    def feed_position(self) -> int:
        """The seq the next change feed record gets (start following here)."""
        self._check_open()
        return self._engine.read(changefeed.position)[0]

    def epoch(self, namespace: Namespace) -> int:
        """``namespace``'s epoch (0 until it is first bumped): root key
        chains at it (``namespace.block_keys(..., epoch=store.epoch(ns))``)
        to find only blocks stored since the last invalidation. One read
        (:mod:`ucm_db.epochs`); a damaged record is a TierError."""
        self._check_open()
        require_namespace(namespace, "epoch")
        return epochs.read(self._engine, namespace.digest[:16])

    def bump_epoch(self, namespace: Namespace) -> int:
        """Invalidates ``namespace``'s blocks: moves its epoch on, durably
        and for every process on the store, and returns the new epoch.
        Nothing is deleted: blocks keyed at older epochs are never found
        again and leave through LRU eviction (:mod:`ucm_db.epochs`)."""
        self._check_open()
        require_namespace(namespace, "bump_epoch")
        self._refuse_read_only("bump_epoch")
        return epochs.bump(self._engine, namespace.digest[:16])

    # -- reads -------------------------------------------------------------------
    def lookup(
        self, namespace: Namespace, keys: Sequence[bytes], *, remote: bool = True, remote_deadline_s: float | None = None,
    ) -> int:
        """Number of leading ``keys`` stored: O(log n) reads.

        Args:
            remote: also continue the local prefix from the remote tier
                (promoting what it finds, within ``remote_deadline_s``);
                False looks at the local tier only.
            remote_deadline_s: this call's deadline on the remote instead of
                the store's ``remote_deadline_s`` (a lookup off the serving
                path can wait longer).
        """
        self._check_open()
        require_namespace(namespace, "lookup")
        # Checked: the first and last key and the O(log n) keys the binary
        # search reads. A full scan of 8192 keys costs more than the lookup
        # itself, and a malformed key reads as absent (none is ever stored).
        if not isinstance(keys, Sequence) or isinstance(keys, (bytes, bytearray, memoryview, str)):
            keys = key_list(keys, "lookup")
        if keys:
            require_keys((keys[0], keys[-1]))
        deadline_s = self.config.remote_deadline_s if remote_deadline_s is None else remote_deadline_s
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
            raise ConfigError(f"remote_deadline_s must be a positive number of seconds, got {remote_deadline_s!r}", hint="pass e.g. 5.0")
        count = self._tier.count_prefix(ProbedKeys(keys), namespace_id=namespace.digest[:16])
        if remote and self._wing is not None and count < len(keys):
            count = self._wing.extend_prefix(namespace.digest[:16], keys, count, deadline_s)
        return count

    def get(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bytearray | None]:
        """Raw payloads of ``keys``; ``None`` for a miss, a corrupt block or
        a block of another namespace."""
        self._check_open()
        require_namespace(namespace, "get")
        keys = key_list(keys, "get")
        corrupt: list[tuple[bytes, str]] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bytearray | None:
            try:
                return codec.decode_parts(head, body, keys[i])
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return None

        results = self._tier.with_blocks(
            keys, lambda blocks: self._codecs.decode_blocks(blocks, decode), namespace_id=namespace.digest[:16],
        )

        def decode_fetched(i: int, blob: Buffer) -> None:
            results[i] = codec.decode(blob, keys[i])

        self._read_through(namespace, keys, results, decode_fetched, corrupt)
        return self._finish_read(keys, results, corrupt)

    def _read_through(
        self, namespace: Namespace, keys: Sequence[bytes], results: list[Any], use: Callable[[int, Buffer], None],
        corrupt: list[tuple[bytes, str]],
    ) -> None:
        """Fetches local misses (``None`` in ``results``; corrupt local
        blocks included: the remote copy is verified on its own) from the
        remote, promotes what keeps the prefix invariant, and hands each
        verified blob to ``use(index, blob)`` as it arrives, so the caller
        decodes it while later ones are still being fetched. ``use`` runs
        on a codec thread for a zstd block with large frames, on the
        caller's thread otherwise; every call has returned when this does.
        A blob whose checksum held but whose frames do not decode
        (``CorruptBlockError`` from ``use``) stays a miss and joins
        ``corrupt``, as a local one does."""
        if self._wing is None:
            return

        def use_or_miss(i: int, blob: Buffer) -> None:
            try:
                use(i, blob)
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))

        missing = [i for i, r in enumerate(results) if r is None]
        if not missing:
            return
        # Large zstd blocks are decoded on the codec threads while later
        # ones are fetched, joined before this returns.
        decodes = self._codecs.pending()
        try:
            self._wing.read_through(namespace.digest[:16], keys, missing, use_or_miss, decodes)
        finally:
            decodes.join()

    def get_into(
        self, namespace: Namespace, keys: Sequence[bytes], buffers: Sequence[Buffer | list[Buffer] | tuple[Buffer, ...]],
    ) -> list[bool]:
        """Decodes blocks straight into caller-provided buffers.

        ``buffers[i]`` is one buffer, or a list or tuple of buffers that the
        block's raw bytes fill one after another (a scatter list: for
        example a KV cache's slab of each layer, so nothing is staged and
        copied again). A block that fails may have written part of its
        buffers; its flag is False.

        Returns:
            For each key, True if ``buffers[i]`` now holds the block.
        """
        self._check_open()
        require_namespace(namespace, "get_into")
        keys = key_list(keys, "get_into")
        if not isinstance(buffers, Sequence) or len(keys) != len(buffers):
            raise ConfigError("get_into needs a sequence of one buffer per key", hint="pass a list of len(keys) buffers")
        for buffer in buffers:
            for piece in buffer if isinstance(buffer, (list, tuple)) else (buffer,):
                if type(piece) is not memoryview or piece.readonly or not piece.c_contiguous:  # a view: checked inline
                    require_writable(piece)
        corrupt: list[tuple[bytes, str]] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bool:
            try:
                codec.decode_parts_into(head, body, keys[i], buffers[i])
                return True
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return False

        def decode_all(blocks: list[tuple[memoryview, memoryview] | None]) -> list[Any]:
            raw = raw_loads.copy_raw_blocks(blocks, keys, buffers, corrupt)  # the rest on the codec's path
            return [r if r is not None else d for r, d in zip(raw, self._codecs.decode_blocks(blocks, decode))]

        results = self._tier.with_blocks(keys, decode_all, namespace_id=namespace.digest[:16])
        flags: list[Any] = [True if r else None for r in results]

        def decode_fetched(i: int, blob: Buffer) -> None:
            codec.decode_into(blob, keys[i], buffers[i])
            flags[i] = True

        self._read_through(namespace, keys, flags, decode_fetched, corrupt)
        done = self._finish_read(keys, flags, corrupt)
        return [r is not None for r in done]

    def _finish_read(self, keys: Sequence[bytes], results: list[Any], corrupt: list[tuple[bytes, str]]) -> list[Any]:
        for key, reason in corrupt:
            self._quarantine(key, reason)
        self._activity.record_reads(keys, results)
        return results

    def _quarantine(self, key: bytes, reason: str) -> None:
        if self.config.read_only:
            return  # the block reads as a miss all the same; a writer quarantines it

        self._tier.quarantine(key, reason, lambda head, body: not codec.readable(head, body, key))

    # -- durability --------------------------------------------------------------------
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
        self._activity.flush_activity()
        self._engine.sync()
        if self._wing is not None:
            self._wing.wait_drained(upload_timeout_s)

    def warm(
        self,
        namespace: Namespace,
        *,
        token_sequences: Sequence[Sequence[int]] | None = None,
        keys: Sequence[bytes] | Sequence[Sequence[bytes]] | None = None,
        progress: WarmProgress | None = None,
    ) -> WarmReport:
        """Pulls what the remote has of these chains into the local tier
        ahead of traffic; see :func:`ucm_db.remote.warming.warm`."""
        from ucm_db.remote.warming import warm

        require_namespace(namespace, "warm")
        link = None if self._wing is None else self._wing.link
        return warm(self._tier, link, namespace, token_sequences=token_sequences, keys=keys, progress=progress)

    def close(self) -> None:
        """Flushes and closes; further calls raise ClosedError.

        The store is released (engine closed, lock let go) even when the
        flush or the final sync fails; that failure is raised afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pid == os.getpid():
                self._close_this_process()
        finally:
            try:
                self._engine.close()
            finally:
                self._dir_lock.release()

    def _close_this_process(self) -> None:
        """Stops this process's threads, flushes counters and syncs. Every
        step runs even when an earlier one fails; the first failure is
        raised at the end."""
        steps: list[Callable[[], object]] = [self._activity.stop]
        if self._wing is not None:
            steps += self._wing.close_steps()
        steps += [self._activity.flush_activity, self._engine.sync]
        if self._pool is not None:
            steps.append(self._pool.shutdown)
        first: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection -------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Counters of the whole store (all processes), plus this process's
        unflushed hits and misses."""
        self._check_open()
        totals = self._tier.totals()
        hits, misses = self._activity.pending_counts()
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
            maintenance_errors=self._activity.errors + (self._activity.failure is not None),
            remote=self._remote_stats(),
        )

    def _remote_stats(self) -> dict[str, Any]:
        return {} if self._wing is None else self._wing.stats()


@functools.lru_cache(maxsize=256)
def _namespace_description(namespace: Namespace) -> tuple[bytes, bytes]:
    """(namespace id, JSON description) recorded with a namespace's blocks;
    cached: building it cost 0.15 ms, most of a small commit."""
    return namespace.digest[:16], json.dumps(namespace.to_dict(), sort_keys=True).encode()


def _fresh_lock(store: Store) -> threading.Lock:
    # After fork the parent's lock may be held by a thread that does not
    # exist here: give the child a new one.
    store._lock = threading.Lock()
    return store._lock
