"""The store's writes of blocks: ``put``, ``put_segments``,
``put_encoded``, ``delete`` and ``quarantine`` (:class:`StoreWrites`, a part
of :class:`~ucm_db.store.Store` over its :class:`~ucm_db.store.state.StoreState`).

Invariants:
    * Arguments are checked (:mod:`ucm_db.arguments`) before anything is
      encoded or written: a refused call writes nothing.
    * A put is one transaction of the local tier: every block of every
      segment, or none; with a remote, every block put is queued for upload
      in that same commit.
    * Every put, of blocks encoded here or already encoded
      (``put_encoded``: an archive import's), takes one path
      (:meth:`StoreWrites._put_new`): the namespace's epoch gate, the
      blocks stored already set aside, one commit, the group-durability
      count, and with a remote the upload (write-through: before the call
      returns). The epoch's state and the blocks' presence are read inside
      the write transaction: a put of codec ``none`` or of encoded blocks
      is that one transaction; a zstd put reads presence first too, to
      compress only what is missing (``_put_new``). Remote promotion
      (:mod:`ucm_db.remote.promotion`) is the only other way blocks enter
      the local tier (fetched blocks are not uploaded again); maintenance
      writes blocks only through this part.
    * ``put_encoded`` stores blobs as given (no re-encoding), each verified
      under its key first (header, owning key, checksum).
    * ``delete`` and ``quarantine`` are one write transaction each, refused
      by a read-only store, and count for group durability (file growth).
      With a remote and ``remote=True``, a delete records a retraction of
      each block it removes in that transaction and deletes their remote objects before
      it returns, within ten lookup deadlines (the uploader deletes what is
      left, retried until done; ``flush`` waits for it). Until an hour after
      that, those blocks are never read from the remote nor promoted here
      (:mod:`ucm_db.index.retractions`), so wrong KV a delete removed (a
      connector's void) does not come back; nodes that read them from the
      remote before keep their copies.
    * Pending reader activity rides on the transaction of a put that
      evicts (the eviction must see it); otherwise, or if the put fails,
      it stays with the maintenance thread (background.ReadsForEviction).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from ucm_db import codec
from ucm_db.arguments import (
    UNSET, Unset, key_list, require_distinct_keys, require_namespace, require_payload, segment_list, segment_parent,
)
from ucm_db.store.background import ReadsForEviction
from ucm_db.codec.pool import Payload
from ucm_db.config import CODECS
from ucm_db.buffers import Buffer
from ucm_db.errors import ConfigError, MissingAncestorError
from ucm_db.events import BlockEventFields, pack_event_fields
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.store.provisional import provisional_tags
from ucm_db.store.put_entries import encoded_entries, raw_entries, verified_entries
from ucm_db.store.state import StoreState
from ucm_db.index.local import BlockEntry, PutResult


class StoreWrites:
    """``put``, ``put_segments``, ``put_encoded``, ``delete`` and
    ``quarantine`` of :class:`~ucm_db.store.Store` (module invariants)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._tier = state.tier
        self._epochs = state.epochs

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

        Returns:
            The counts, and ``stored_keys``: the blocks this put wrote
            (first writer wins: a block stored already is left as it is
            and not named), which a caller undoing its put deletes.

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
        self._state.check_writable()
        require_namespace(namespace, "put")
        keys = key_list(keys, "put")
        require_distinct_keys(keys, "put")  # a chain never repeats a key: a repeat is the caller's slip
        return self._put_checked(namespace, [(keys, payloads, segment_parent(keys, parent))], codec_name, event_fields)

    def put_segments(
        self,
        namespace: Namespace,
        segments: Sequence[tuple[Sequence[bytes], Sequence[Payload]]],
        *,
        codec_name: str | None = None,
        event_fields: Mapping[bytes, BlockEventFields] | None = None,
        provisional: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        """Atomically stores several chain segments in one transaction
        (e.g. the KV-head unit chains of one engine step): every block of
        every segment, or nothing.

        Args:
            segments: ``(keys, payloads)`` pairs; each ``keys`` is a
                :class:`~ucm_db.keys.BlockKeys` (it knows its parent). A
                segment may continue an earlier segment of the same call
                (parents are resolved in order: a segment continuing a
                later one is refused).
            codec_name, event_fields: as for :meth:`put`.
            provisional: a tag (``ProvisionalOwner.tag()``) by key: blocks it stores stay provisional (kept off a write-back
                remote) until the tag is settled; should the owner die first, a sweep deletes them.

        Raises:
            The errors of :meth:`put`; MissingAncestorError if any segment's parent is neither stored nor in an
            earlier segment of the call (nothing is stored).
        """
        self._state.check_writable()
        require_namespace(namespace, "put_segments")
        checked: list[tuple[Sequence[bytes], Sequence[Payload], bytes | None]] = []
        for keys, payloads in segment_list(segments):
            keys = key_list(keys, "put_segments")
            require_distinct_keys(keys, "put_segments")  # within a chain; chains of one call may share blocks
            if not isinstance(keys, BlockKeys):
                raise ConfigError(
                    "put_segments takes BlockKeys (keys that know their parent)",
                    hint="pass slices of Namespace.block_keys, or BlockKeys(keys, parent=...)",
                )
            checked.append((keys, payloads, keys.parent))
        return self._put_checked(namespace, checked, codec_name, event_fields, provisional_tags(provisional))

    def _put_checked(
        self, namespace: Namespace, segments: list[tuple[Sequence[bytes], Sequence[Payload], bytes | None]],
        codec_name: str | None, event_fields: Mapping[bytes, BlockEventFields] | None = None,
        provisional: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        packed = pack_event_fields(event_fields)
        if codec_name is None:
            codec_name = self._state.config.codec
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
        return self._put_new(namespace, keys, lambda todo: self._encode(namespace, keys, payloads, parents, todo, codec_name, packed),
                             check_first=codec_name != "none", provisional=provisional)

    def _encode(
        self, namespace: Namespace, keys: Sequence[bytes], payloads: Sequence[Payload],
        parents: Sequence[bytes | None], todo: list[int], codec_name: str, packed: Mapping[bytes, bytes] | None = None,
    ) -> list[BlockEntry]:
        raw = raw_entries(namespace.id, keys, payloads, parents, todo, packed) if codec_name == "none" else None
        if raw is not None:
            return raw
        encoded = self._state.codecs.encode_many(
            [(keys[i], payloads[i]) for i in todo], codec_name=codec_name,
            element_bytes=codec.element_bytes_for(namespace.kv_dtype), level=self._state.config.zstd_level,
        )
        return encoded_entries(namespace.id, keys, parents, todo, encoded, packed)

    def put_encoded(self, namespace: Namespace, blocks: Sequence[tuple[bytes, bytes | None, Buffer]]) -> PutResult:
        """Atomically stores blocks that are already encoded (an archive's,
        another store's), as they are: their codec and bytes are kept.

        The blocks take :meth:`put`'s way from there on: the namespace's
        epoch must be known, every block is stored or none, an eviction the
        put needs spares the blocks and their ancestors, the commit counts
        for group durability and, with a remote, queues the blocks for
        upload (write-through uploads them before this returns).

        Args:
            namespace: the blocks' namespace (every block is stored under it).
            blocks: ``(key, parent, blob)`` of each block, a parent before
                its children (``parent`` None for a chain's first block);
                ``blob`` is the block exactly as a store holds it (codec
                header, owning key, checksum), e.g. an archive member.

        Raises:
            CorruptBlockError: a blob does not verify under its key (header,
                owning key, checksum; nothing written).
            ConfigError: malformed blocks, keys or parents, or a key or
                parent stored under another namespace (nothing written).
            MissingAncestorError, StoreFullError, EpochUnknownError: as for
                :meth:`put` (nothing written).
        """
        self._state.check_writable()
        require_namespace(namespace, "put_encoded")
        entries = verified_entries(blocks, namespace.id)
        if not entries:
            return PutResult()
        return self._put_new(namespace, [e.key for e in entries], lambda todo: [entries[i] for i in todo], check_first=False)

    def _put_new(
        self, namespace: Namespace, keys: Sequence[bytes], entries_for: Callable[[list[int]], list[BlockEntry]], *, check_first: bool,
        provisional: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        """Puts those of ``keys`` not stored yet, ``entries_for(indices)``
        making their entries: the one way from a put to the tier (module
        invariants).

        The write transaction checks the namespace's epoch and each block's
        presence itself (a block stored already is left as it is; a key
        under another namespace is a ForeignNamespaceError, nothing
        written), so a put is that one transaction (two read transactions less: 7% of a 4 x 32 KiB put's CPU).
        ``check_first``: where making an entry is dear (zstd: 40 us and more per 32 KiB unit), presence is read
        first in a read transaction of its own and only the blocks not stored are encoded. Codec ``none`` (a
        header and a checksum) and encoded blocks go straight to the write, where a block found stored costs
        only its entry (a put of 4 x 32 KiB all stored already: 125 us so, 140 us with the presence read first)."""
        self._epochs.before_put(namespace)  # registers a namespace new here (store/epoch_gate.py)
        desc = _namespace_description(namespace)
        everything = list(range(len(keys)))
        if not check_first:
            return self._commit(namespace, keys, everything, entries_for(everything), desc, provisional)
        # A key stored under another namespace is a ForeignNamespaceError
        # (ConfigError) here, before anything is encoded.
        present = self._tier.present_for_put(keys, desc)
        todo = [i for i, p in enumerate(present) if not p]
        try:
            return self._commit(namespace, keys, todo, entries_for(todo), desc, provisional)
        except MissingAncestorError:
            if len(todo) == len(keys):
                raise
            # A block seen present was evicted meanwhile: put the whole chain.
            return self._commit(namespace, keys, everything, entries_for(everything), desc, provisional)

    def _commit(
        self, namespace: Namespace, keys: Sequence[bytes], todo: list[int], entries: list[BlockEntry], desc: tuple[bytes, bytes],
        provisional: Mapping[bytes, bytes] | None = None,
    ) -> PutResult:
        activity, wing = self._state.activity, self._state.wing
        reads = ReadsForEviction(activity)
        stored: list[BlockEntry] = []
        namespace_id = namespace.id
        committed = False
        try:
            encoded = set(todo)
            result = self._tier.put_blocks(
                entries, namespace_desc=desc, enqueue_upload=wing is not None, activity=reads,
                protect=[key for i, key in enumerate(keys) if i not in encoded] if len(todo) < len(keys) else (),
                guard=lambda txn: self._epochs.check_put(txn, namespace_id), stored=stored, provisional=provisional,
                hold_provisional_uploads=self._state.config.remote_mode == "write_back")
            committed = True
        finally:
            reads.settle(committed)
        result.already_present += len(keys) - len(todo)
        result.stored_keys = [entry.key for entry in stored]
        activity.committed(sum(e.stored_bytes for e in stored))
        if wing is not None and stored:
            wing.upload(stored)
        return result

    def delete(self, namespace: Namespace, keys: Sequence[bytes], *, remote: bool = False) -> int:
        """Deletes ``namespace``'s blocks among ``keys`` and their
        descendants; returns blocks removed. A key stored under another
        namespace is left alone (it counts as not removed).

        ``remote``: off the remote too (module invariants; a void's wrong KV).

        Raises:
            ConfigError: a descendant is stored under another namespace (a
                chain written before puts refused that); nothing is deleted.
        """
        self._state.check_open()
        require_namespace(namespace, "delete")
        self._state.refuse_read_only("delete")
        keys = key_list(keys, "delete")
        retract = remote and self._state.wing is not None
        removed = self._tier.delete(keys, namespace_id=namespace.id, retract=retract)
        self._state.activity.committed(0)  # a delete writes index pages only: its file growth counts
        if retract and self._state.wing is not None:  # a key evicted here is retracted too (retractions.record_absent)
            self._state.wing.retract()  # never raises: what it leaves, the uploader deletes
        return removed

    def quarantine(self, key: bytes, reason: str, *, recheck: bool = True) -> bool:
        """Moves a damaged block and its descendants out of the store, as a
        read does with a block that fails its checks: they read as misses,
        and the quarantine records (``ucm-db inspect``) keep ``reason``
        until ``ucm-db compact`` drops them. For repairs (``ucm-db verify
        --fix``); one write transaction, any namespace.

        Args:
            recheck: quarantine the block only if it still fails to decode
                under its key, checked inside the write transaction (a block
                another process has replaced meanwhile stays). False: it goes
                whatever its payload (its metadata is at fault, e.g. a parent
                cycle). A block whose record is damaged goes either way.

        Returns:
            Whether a quarantine record was filed: False only where the
            recheck found the block readable.

        Raises:
            TierError: the store is open read-only.
        """
        self._state.check_open()
        self._state.refuse_read_only("quarantine")
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise ConfigError(f"quarantine takes a block key (bytes), got {type(key).__name__}", hint="pass the key a check reported")
        key = bytes(key)  # any length: a damaged index may hold a key no put wrote
        still_corrupt = (lambda head, body: not codec.readable(head, body, key)) if recheck else _always
        done = self._tier.quarantine(key, str(reason), still_corrupt)
        self._state.activity.committed(0)  # like a delete: its file growth counts
        return done


def _always(_head: memoryview, _body: memoryview) -> bool:
    return True


@functools.lru_cache(maxsize=256)
def _namespace_description(namespace: Namespace) -> tuple[bytes, bytes]:
    """(namespace id, JSON description) recorded with a namespace's blocks;
    cached: building it cost 0.15 ms, most of a small commit."""
    return namespace.id, namespace.description_json
