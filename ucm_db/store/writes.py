"""The store's write path: ``put``, ``put_segments`` and ``delete``.

Invariants:
    * Arguments are checked (:mod:`ucm_db.arguments`) before anything is
      encoded or written: a refused call writes nothing.
    * A put is one transaction of the local tier: every block of every
      segment, or none; with a remote, every block put is queued for upload
      in that same commit.
    * Pending reader activity rides on the transaction of a put that
      evicts (the eviction must see it); otherwise, or if the put fails,
      it stays with the maintenance thread (background.ReadsForEviction).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

from ucm_db import codec
from ucm_db.arguments import UNSET, Unset, key_list, require_namespace, require_payload, segment_list, segment_parent
from ucm_db.store.background import ReadsForEviction
from ucm_db.codec.pool import Payload
from ucm_db.config import CODECS
from ucm_db.errors import ConfigError, MissingAncestorError
from ucm_db.events import BlockEventFields, pack_event_fields
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.store.base import StoreBase
from ucm_db.index.local import BlockEntry, PutResult


class StoreWrites(StoreBase):
    """``put``, ``put_segments`` and ``delete`` of :class:`~ucm_db.store.Store`."""

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
            EpochUnknownError: (a TierError) the namespace's epoch cannot be
                established (:mod:`ucm_db.store.epoch_gate`; nothing written).
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
        self._epochs.before_put(namespace)  # an unknown epoch: refused (store/epoch_gate.py)
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
            BlockEntry(keys[i], parents[i], block.head, block.body_buffer(), block.raw_len, namespace.id,
                       None if packed is None else packed.get(keys[i]))
            for i, block in zip(todo, encoded)
        ]
        reads = ReadsForEviction(self._activity)
        desc = _namespace_description(namespace)
        committed = False
        try:
            skipped = set(range(len(keys))) - set(todo)
            result = self._tier.put_blocks(
                entries, namespace_desc=desc, enqueue_upload=self._wing is not None, activity=reads,
                protect=[keys[i] for i in sorted(skipped)],
            )
            committed = True
        finally:
            reads.settle(committed)
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
        removed = self._tier.delete(keys, namespace_id=namespace.id)
        self._activity.committed(0)  # a delete writes index pages only: its file growth counts
        return removed


@functools.lru_cache(maxsize=256)
def _namespace_description(namespace: Namespace) -> tuple[bytes, bytes]:
    """(namespace id, JSON description) recorded with a namespace's blocks;
    cached: building it cost 0.15 ms, most of a small commit."""
    return namespace.id, json.dumps(namespace.to_dict(), sort_keys=True).encode()
