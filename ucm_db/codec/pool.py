"""Batch encoding and decoding of blocks on the store's codec threads.

Invariants:
    * Results come back in input order, whatever thread produced them.
    * Uncompressed work (codec ``none``: a header and at most one memcpy per
      block) stays on the caller's thread; only zstd work, only batches of
      two or more blocks, and only blocks whose frames average
      :data:`POOL_MIN_FRAME_BYTES` or more go to the pool, where the
      GIL-free compressor runs in parallel. Smaller frames are mostly
      per-frame Python, which holds the GIL: threads only add hand-offs.
    * Decoding runs inside the caller's read transaction, straight from the
      stored bytes: the pool is joined before :meth:`CodecPool.decode_blocks`
      returns, so no view outlives the transaction.
    * Blocks fetched one by one (a read-through) are decoded through
      :class:`PendingDecodes`: the pool's share runs while the caller goes on
      fetching and promoting, and :meth:`PendingDecodes.join` returns only
      when every decode has finished, so no result lands after the read
      that asked for it has returned.
    * Work handed to the pool once it is shut down (the store closed) raises
      :class:`~ucm_db.errors.ClosedError`, never the executor's
      ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar, Union, cast

from ucm_db import codec
from ucm_db.cpu_placement import place_current_thread
from ucm_db.engines.base import Buffer
from ucm_db.errors import ClosedError

T = TypeVar("T")

#: Smallest mean frame (raw bytes) a block needs to go to the pool. 2
#: threads against the caller's thread alone on 16 MiB of bf16 blocks
#: (`ucm-db bench codec-pool --force-pool`, 2-core host, BENCHMARKS.md):
#: decode 0.64x at 8 KiB frames (a vLLM-CPU layer unit), 0.95x at 64 KiB,
#: 1.14-1.22x from 256 KiB to 2 MiB; encode 0.85x, 0.80x, then 1.1-1.2x.
POOL_MIN_FRAME_BYTES = 512 << 10
Payload = Union[Buffer, Sequence[Buffer], codec.Framed]


class CodecPool:
    """The codec threads of one store in one process (none if ``threads``
    is 0: everything then runs on the caller's thread)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, "ucm-db-codec", initializer=place_current_thread) if threads else None
        self._threads = _Submitter(self._pool)

    @property
    def inline_frame_bytes(self) -> int | None:
        """Mean raw frame size below which a zstd block is decoded on the
        caller's thread (None: every block is, there is no pool)."""
        return POOL_MIN_FRAME_BYTES if self._pool is not None else None

    def encode_many(
        self, items: Sequence[tuple[bytes, Payload]], *, codec_name: str, element_bytes: int, level: int,
    ) -> list[codec.EncodedBlock]:
        """Encodes ``(key, payload)`` pairs; a list or tuple payload is
        per-layer frames, a :class:`~ucm_db.codec.Framed` one buffer cut
        into frames, anything else (bytes, numpy array, memoryview) one
        buffer."""
        def encode_one(item: tuple[bytes, Payload]) -> codec.EncodedBlock:
            key, payload = item
            frames: Any = payload if isinstance(payload, codec.Framed) else list(payload) if isinstance(payload, (list, tuple)) else [payload]
            return codec.encode_parts(key, frames, codec=codec_name, element_bytes=element_bytes, level=level)

        if self._pool is None or len(items) < 2 or codec_name == "none" or _mean_frame_bytes(items[0][1]) < POOL_MIN_FRAME_BYTES:
            return [encode_one(item) for item in items]
        return self._threads.map(encode_one, items)

    def decode_blocks(
        self, blocks: Sequence[tuple[memoryview, memoryview] | None], decode: Callable[[int, memoryview, memoryview], T],
    ) -> list[T | None]:
        """``decode(i, head, body)`` for each present block (None where
        absent); compressed blocks of a batch on the pool. Every decode has
        ended when this returns or raises (the blocks are views of the
        caller's read transaction)."""
        results: list[T | None] = [None] * len(blocks)
        compressed: list[int] = []
        for i, block in enumerate(blocks):
            if block is None:
                continue
            if self._pool is not None and _wants_pool(block[0]):
                compressed.append(i)
            else:
                results[i] = decode(i, *block)
        if len(compressed) == 1:
            results[compressed[0]] = decode(compressed[0], *blocks[compressed[0]])  # type: ignore[misc]
        elif compressed:
            assert self._pool is not None  # only blocks for the pool were listed
            futures: list[Future[T]] = []
            try:
                for i in compressed:
                    futures.append(self._threads.submit(decode, i, *blocks[i]))  # type: ignore[misc]
            finally:
                wait(futures)  # all end before any error is raised: none reads the blocks after the caller's read ends
            for i, future in zip(compressed, futures):
                results[i] = future.result()
        return results

    def beside(self, fn: Callable[[], object]) -> Callable[[], None] | None:
        """Starts ``fn()`` on one codec thread beside the caller (None if
        there is no pool); returns ``join()``, which cancels ``fn`` if it
        has not started yet, else waits for it and re-raises its error. A
        caller sharing work with ``fn`` (:mod:`ucm_db.codec.batch_loads`) joins
        once its own share is done, so it never waits for a thread that is
        busy elsewhere. A cancelled ``fn`` is dropped at once: the queue
        keeps only an empty shell until a thread reaches it, so nothing
        ``fn`` holds (a chunk's views of a read transaction) outlives the
        join."""
        if self._pool is None:
            return None
        held = [fn]
        future = self._threads.submit(lambda: held[0]())

        def join() -> None:
            if future.cancel():
                held.clear()  # never runs now
            else:
                future.result()

        return join

    def pending(self) -> PendingDecodes:
        """A set of decodes of blocks that arrive one by one (see
        :class:`PendingDecodes`)."""
        return PendingDecodes(self._threads)

    def shutdown(self) -> None:
        self._threads.shutdown()


class PendingDecodes:
    """Decodes of fetched blocks, started as each block arrives.

    A zstd block with large frames is decoded on the pool, so its decode
    overlaps the caller's next fetch and promotion; anything else is decoded
    at once on the caller's thread (the same split as
    :meth:`CodecPool.decode_blocks`). A block handed in must stay unchanged
    until :meth:`join` returns (a fetched object's bytes do).
    """

    def __init__(self, pool: ThreadPoolExecutor | _Submitter | None) -> None:
        self._threads = pool if isinstance(pool, _Submitter) else _Submitter(pool)
        self._futures: list[Future[None]] = []

    def add(self, blob: Buffer, decode: Callable[[], None]) -> None:
        """Runs ``decode()`` for ``blob`` now or on the pool."""
        if self._threads.pooled and _wants_pool(blob):
            self._futures.append(self._threads.submit(decode))
        else:
            decode()

    def join(self) -> None:
        """Waits for every decode; re-raises the first one's error (in the
        order they were added), after all of them have finished."""
        futures, self._futures = self._futures, []
        wait(futures)
        for future in futures:
            future.result()


class _Submitter:
    """The pool's door: work handed to it after :meth:`shutdown` (or at
    interpreter exit) raises :class:`ClosedError` (module invariants)."""

    def __init__(self, pool: ThreadPoolExecutor | None) -> None:
        self._pool = pool
        self.pooled = pool is not None
        self._shut = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        assert self._pool is not None  # only called with a pool
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError as exc:
            if self._shut or "shutdown" in str(exc):  # the executor's words for a pool shut down
                raise ClosedError("the store's codec threads are shut down: the store was closed") from exc
            raise

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """``[fn(item) ...]`` on the pool, in order; on an error the work
        not started yet is dropped (as ``Executor.map`` does)."""
        futures: list[Future[T]] = []
        try:
            for item in items:
                futures.append(self.submit(fn, item))
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    def shutdown(self) -> None:
        self._shut = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _wants_pool(head: Buffer) -> bool:
    """Whether a block (its head, or the whole blob: only the header is
    read) is zstd with frames large enough for the pool to pay."""
    return codec.codec_of_head(head) == "zstd" and codec.mean_frame_bytes_of_head(head) >= POOL_MIN_FRAME_BYTES


def _mean_frame_bytes(payload: Payload) -> int:
    """Raw bytes per frame of a payload to encode (a batch's first stands
    for the batch: a caller's blocks share one layout)."""
    if isinstance(payload, codec.Framed):
        return sum(payload.frame_bytes) // max(1, len(payload.frame_bytes))
    if isinstance(payload, (list, tuple)):
        return sum(memoryview(frame).nbytes for frame in payload) // max(1, len(payload))
    return memoryview(cast(Buffer, payload)).nbytes
