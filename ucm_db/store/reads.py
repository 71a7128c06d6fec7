"""The store's read path: ``lookup``, ``get``, ``get_into`` and ``touch``
(:class:`StoreReads`, a part of :class:`~ucm_db.store.Store` over its
:class:`~ucm_db.store.state.StoreState`).

Invariants:
    * Every payload read is verified (header, owning key, checksum) before
      it is reported read; a corrupt block reads as a miss and is
      quarantined with its descendants (by a writable store); so is one
      whose ``meta`` record is damaged (a miss too, which a lookup may
      count past: the hole breaks the prefix invariant under it).
    * Reads never open a write transaction: their activity (LRU touches,
      hit and miss counts) goes to the maintenance thread. A caller may
      read with ``get_into(..., touch=False)`` and touch the blocks from
      another process (``touch``): that process's maintenance thread then
      writes their recency, and the reading process buffers counts only.
    * With a remote, local misses read through to it (the remote wing,
      :mod:`ucm_db.remote`), which promotes what it fetches as a put would
      (the namespace's epoch registered, its description recorded:
      :class:`~ucm_db.remote.promotion.PromotionTarget`); a lookup waits
      at most its deadline on the remote.
    * A namespace whose epoch cannot be established is not served (every
      read of it misses), and nothing of a namespace is read through from
      the remote before its epoch there was read (first contact):
      :mod:`ucm_db.store.epoch_gate`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ucm_db.codec import batch_loads, raw_loads
from ucm_db import codec
from ucm_db.arguments import ProbedKeys, key_list, require_keys, require_namespace, require_writable
from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.keys import Namespace
from ucm_db.codec.slabs import ScatterSlabs
from ucm_db.remote.promotion import PromotionTarget
from ucm_db.store.state import StoreState
from ucm_db.engines.base import Buffer

logger = logging.getLogger(__name__)


class StoreReads:
    """``lookup``, ``get``, ``get_into`` and ``touch`` of :class:`~ucm_db.store.Store` (module invariants)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._tier = state.tier
        self._epochs = state.epochs
        self._wing = state.wing

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
        started_s = time.monotonic()  # one deadline for the whole call: first contact and fetch share it
        self._state.check_open()
        require_namespace(namespace, "lookup")
        # Checked: the first and last key and the O(log n) keys the binary
        # search reads. A full scan of 8192 keys costs more than the lookup
        # itself, and a malformed key reads as absent (none is ever stored).
        if not isinstance(keys, Sequence) or isinstance(keys, (bytes, bytearray, memoryview, str)):
            keys = key_list(keys, "lookup")
        if keys:
            require_keys((keys[0], keys[-1]))
        deadline_s = self._state.config.remote_deadline_s if remote_deadline_s is None else remote_deadline_s
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
            raise ConfigError(f"remote_deadline_s must be a positive number of seconds, got {remote_deadline_s!r}", hint="pass e.g. 5.0")
        if not self._epochs.serves(namespace):
            return 0  # its epoch is unknown: nothing of it is served (store/epoch_gate.py)
        count = self._tier.count_prefix(ProbedKeys(keys), namespace_id=namespace.id)
        if remote and self._wing is not None and count < len(keys) and self._epochs.remote_ok(namespace, deadline_s):
            left_s = deadline_s - (time.monotonic() - started_s)  # a first contact may have used most of it
            if left_s > 0:
                count = self._wing.extend_prefix(PromotionTarget(namespace, self._epochs.before_put), keys, count, left_s)
        return count

    def get(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bytearray | None]:
        """Raw payloads of ``keys``; ``None`` for a miss, a corrupt block or
        a block of another namespace."""
        self._state.check_open()
        require_namespace(namespace, "get")
        keys = key_list(keys, "get")
        if not self._epochs.serves(namespace):
            return [None] * len(keys)  # its epoch is unknown (store/epoch_gate.py)
        corrupt: list[tuple[bytes, str]] = []

        def decode(i: int, head: memoryview, body: memoryview) -> bytearray | None:
            try:
                return codec.decode_parts(head, body, keys[i])
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return None

        results = self._tier.with_blocks(
            keys, lambda blocks: self._state.codecs.decode_blocks(blocks, decode), namespace_id=namespace.id,
            damaged=corrupt,
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
        missing = [i for i, r in enumerate(results) if r is None]
        # Nothing missing, nothing asked of the remote (first contact included:
        # a load of local blocks never waits on it).
        if not missing or self._wing is None or not self._epochs.remote_ok(namespace, self._wing.bulk_deadline_s):
            return

        def use_or_miss(i: int, blob: Buffer) -> None:
            try:
                use(i, blob)
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))

        # Large zstd blocks are decoded on the codec threads while later
        # ones are fetched, joined before this returns.
        decodes = self._state.codecs.pending()
        try:
            self._wing.read_through(PromotionTarget(namespace, self._epochs.before_put), keys, missing, use_or_miss, decodes)
        finally:
            decodes.join()

    def get_into(
        self, namespace: Namespace, keys: Sequence[bytes], buffers: Sequence[Buffer | list[Buffer] | tuple[Buffer, ...]] | ScatterSlabs,
        *, touch: bool = True,
    ) -> list[bool]:
        """Decodes blocks straight into caller-provided buffers.

        ``buffers[i]`` is one buffer, or a list or tuple of buffers that the
        block's raw bytes fill one after another (a scatter list: for
        example a KV cache's slab of each layer, so nothing is staged and
        copied again). ``buffers`` may be a :class:`~ucm_db.ScatterSlabs`
        (every block's scatter list a slab of each of a few large buffers:
        no Python object per slab). A block that fails may have written
        part of its buffers; its flag is False.

        ``touch=False`` counts the read's hits and misses but leaves the
        blocks' recency to a :meth:`touch` made elsewhere (the vLLM
        connector's scheduler touches what it plans its workers to load, so
        a worker process, whose spare moments are the model's, never writes
        recency).

        Returns:
            For each key, True if ``buffers[i]`` now holds the block.
        """
        self._state.check_open()
        require_namespace(namespace, "get_into")
        keys = key_list(keys, "get_into")
        if not isinstance(buffers, Sequence) or len(keys) != len(buffers):
            raise ConfigError("get_into needs a sequence of one buffer per key", hint="pass a list of len(keys) buffers")
        for buffer in () if isinstance(buffers, ScatterSlabs) else buffers:  # slabs: checked when made
            for piece in buffer if isinstance(buffer, (list, tuple)) else (buffer,):
                if type(piece) is not memoryview or piece.readonly or not piece.c_contiguous:  # a view: checked inline
                    require_writable(piece)
        if not self._epochs.serves(namespace):
            return [False] * len(keys)  # its epoch is unknown (store/epoch_gate.py)
        corrupt: list[tuple[bytes, str]] = []

        def decode_block(i: int, head: memoryview, body: memoryview) -> bool:
            try:
                codec.decode_parts_into(head, body, keys[i], buffers[i])
                return True
            except CorruptBlockError as exc:
                corrupt.append((keys[i], str(exc)))
                return False

        # Raw blocks are copied as they are read (raw_loads), the rest on
        # the codec's path once the batch is read.
        take, raw = raw_loads.raw_taker(keys, buffers, corrupt, shuffled=True, below_frame_bytes=self._state.codecs.inline_frame_bytes)
        decode: Callable[[int, memoryview, memoryview], bool] = decode_block
        fit = _SlabFit(keys, sum(buffers.slab_bytes), corrupt, raw) if isinstance(buffers, ScatterSlabs) else None
        if fit is not None:  # a unit fills its slabs exactly (ScatterSlabs' invariants)
            take, decode = fit.take(take), fit.decode(decode_block)
        # Into a KV cache's slabs, the read's units are planned and loaded
        # batch_loads.FLUSH_UNITS at a time by native calls (one to plan, one
        # per thread to load); any they decline go the way they went before.

        def declined(i: int, head: memoryview, body: memoryview) -> bool:
            if not take(i, head, body):
                raw[i] = decode(i, head, body)
            return True

        namespace_id = namespace.id
        batch = batch_loads.batch_for(keys, buffers, self._state.codecs.inline_frame_bytes, self._state.codecs.beside, declined, raw,
                                      namespace_id)

        def decode_all(blocks: list[tuple[memoryview, memoryview] | None]) -> list[Any]:
            if batch is not None:
                batch.finish()
            if not any(blocks):  # every block taken or absent: nothing left to decode
                return raw
            return [r if r is not None else d for r, d in zip(raw, self._state.codecs.decode_blocks(blocks, decode))]

        if batch is None:
            results = self._tier.with_blocks(keys, decode_all, namespace_id=namespace_id, take=take, damaged=corrupt)
        else:
            results = self._tier.with_blocks(keys, decode_all, namespace_id=namespace_id, take=batch.taker(take),
                                             take_chunk=batch.take_chunk, chunk_keys=batch_loads.FLUSH_UNITS, damaged=corrupt)
        flags: list[Any] = [True if r else None for r in results]

        def decode_fetched(i: int, blob: Buffer) -> None:
            if fit is not None and not fit.fits(i, *codec.split(blob)):
                return  # another size than the slabs: a miss
            codec.decode_into(blob, keys[i], buffers[i])
            flags[i] = True

        self._read_through(namespace, keys, flags, decode_fetched, corrupt)
        done = self._finish_read(keys, flags, corrupt, touch=touch)
        return [r is not None for r in done]

    def touch(self, namespace: Namespace, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` as just read, for eviction (recency, per-block hit
        counts), as a read of them would, without reading them: a block
        touched, and its ancestors (prefix invariant), is evicted after
        blocks read or touched before it. Like a read's, the touch is
        written by the maintenance thread (or folded into a put that
        evicts), never in this call, and a key not stored when it is
        written is skipped. A read-only store keeps no recency. Keys are
        not checked against ``namespace``: touch only keys it issued."""
        self._state.check_open()
        require_namespace(namespace, "touch")
        self._state.activity.record_touches(key_list(keys, "touch"))

    def _finish_read(
        self, keys: Sequence[bytes], results: list[Any], corrupt: list[tuple[bytes, str]], *, touch: bool = True,
    ) -> list[Any]:
        for key, reason in dict(corrupt).items():  # a key read twice in one call is quarantined once
            self._quarantine(key, reason)
        self._state.activity.record_reads(keys, results, touch=touch)
        return results

    def _quarantine(self, key: bytes, reason: str) -> None:
        if self._state.config.read_only:
            return  # the block reads as a miss all the same; a writer quarantines it

        self._tier.quarantine(key, reason, lambda head, body: not codec.readable(head, body, key))


class _SlabFit:
    """``take`` and ``decode`` of :meth:`Store.get_into` for slabs of
    ``unit_bytes`` a unit (ScatterSlabs' invariants): a block whose header
    states another raw length is verified first (a damaged header is a
    corrupt block: quarantined), and a sound one of another size is a miss,
    logged once per size pair, never a partial fill nor an error for the
    batch (nothing is raised on a codec thread)."""

    _told: set[tuple[int, int]] = set()  # (stored, slab) sizes logged in this process

    def __init__(self, keys: Sequence[bytes], unit_bytes: int, corrupt: list[tuple[bytes, str]], raw: list[Any]) -> None:
        self._keys, self._unit_bytes, self._corrupt, self._raw = keys, unit_bytes, corrupt, raw

    def fits(self, i: int, head: memoryview, body: memoryview) -> bool:
        stored = codec.raw_len_of_head(head)
        if stored == self._unit_bytes:
            return True
        try:
            codec.verify_parts(head, body, self._keys[i])
        except CorruptBlockError as exc:
            self._corrupt.append((self._keys[i], str(exc)))
            return False
        if (stored, self._unit_bytes) not in self._told:
            self._told.add((stored, self._unit_bytes))
            logger.warning("ucm-db: a stored block of %d raw bytes was read into slabs of %d: read as a miss (a writer "
                           "stored another layout under this namespace: a bug to report)", stored, self._unit_bytes)
        return False

    def take(self, take: Callable[[int, memoryview, memoryview], bool]) -> Callable[[int, memoryview, memoryview], bool]:
        def fitting_take(i: int, head: memoryview, body: memoryview) -> bool:
            if self.fits(i, head, body):
                return take(i, head, body)
            self._raw[i] = False
            return True
        return fitting_take

    def decode(self, decode: Callable[[int, memoryview, memoryview], bool]) -> Callable[[int, memoryview, memoryview], bool]:
        return lambda i, head, body: self.fits(i, head, body) and decode(i, head, body)
