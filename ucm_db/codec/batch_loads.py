"""A read's units verified and written into a KV cache's slabs by one native call per thread, the GIL released.

``Store.get_into`` into :class:`~ucm_db.codec.slabs.ScatterSlabs` (a connector's
load straight into the KV cache) reads its units :data:`FLUSH_UNITS` at a
time inside its read transaction (``with_blocks``'s ``take_chunk``: three
list reads of the chunk's values), plans each chunk in one call
(``_native.plan_units``: every unit whose head the fast path of
:mod:`ucm_db.codec.raw_loads` takes, raw or zstd of shuffled frames small enough
for the caller's thread), then hands the plan to ``_native.load_units``: one
call that hashes and copies (or verifies, decompresses and merges) unit
after unit without the GIL. A codec thread
(:meth:`ucm_db.codec.pool.CodecPool.beside`) makes the same call beside the
caller; both claim units from one shared counter, so a busy helper costs the
caller nothing but the units it took. Per unit this leaves the LMDB lookups
and no Python call; a unit the plan declines goes through the per-unit
path (:meth:`Batch.taker`), and one the load declines to the Python path.

The native path needs XXH3-64 and zstd's decompressor as C functions:
the import binds them from the xxhash wheel's own shared object (it exports
its C API), a system ``libxxhash``, a system ``libzstd`` or the zstandard
wheel's cffi backend, and checks them against the Python modules on sample
data before :data:`AVAILABLE` turns True. XXH3's update is the library's
runtime-dispatched one (AVX2 or AVX-512 where the CPU has them) wherever it
is exported, not its SSE2 baseline. ``UCM_DB_BATCH_LOADS=0`` in the
environment turns the path off (for comparisons).

Invariants:
    * An accelerator only: a unit the native call loads has passed the same
      checks as on the Python path (the owning head here,
      ``raw_loads.batch_checksum``; the checksum over the same bytes, each
      frame's mode, bounds and exact decoded size there);
      every other unit, corrupt ones included, is handed back untouched to
      the Python path, which decides it as before and names the reason.
    * No view outlives the transaction: :meth:`Batch.finish` returns only
      after the helper's call has ended, or was cancelled before it began,
      and ``get_into`` calls it before its read transaction ends.
"""

from __future__ import annotations

import glob
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, Optional

import xxhash
import zstandard

from ucm_db.codec import checked_copy, header as codec_format, native
from ucm_db.codec.header import RAW_TABLES
from ucm_db.codec.raw_loads import batch_checksum
from ucm_db.codec.slabs import ScatterSlabs

_KIND_RAW, _KIND_SHUFFLED = 1, 2
#: The codec's constants ``_native.plan_units`` checks a head against.
_FORMAT = (codec_format.MAGIC, codec_format.CODEC_FORMAT_VERSION, codec_format.CODEC_IDS["none"],
           codec_format.CODEC_IDS["zstd"], codec_format.MAX_FRAMES, codec_format.MAX_RAW_BYTES)
_LOADED = 1
#: Units each thread claims at a time (a 64 KiB unit takes 10-30 us): a
#: helper that starts late or stalls leaves the caller at most this many.
CHUNK_UNITS = 4
#: Bytes hashed, then copied while still in cache (checked_copy's figure).
CHUNK_BYTES = 64 << 10
#: Fewest units worth waking a helper for (its start costs about a unit).
HELPER_MIN_UNITS = 16
#: Units read, planned and loaded at a time: a chunk keeps up to three
#: LMDB views per unit alive (each a memoryview and its managed buffer, both
#: tracked by the garbage collector), and past about 700 of them alive the
#: collector runs during a load (tests/test_scatter_slabs.py); 64 units of
#: 64 KiB are about 0.6 ms of work.
FLUSH_UNITS = 64


def _library_candidates() -> tuple[list[str], list[str]]:
    """Where XXH3 and zstd's decompressor may be found, in order of preference."""
    xxh = [xxhash._xxhash.__file__, "libxxhash.so.0"]  # type: ignore[attr-defined]
    zstd = ["libzstd.so.1", *sorted(glob.glob(os.path.join(os.path.dirname(zstandard.__file__), "_cffi*.so")))]
    return xxh, zstd


def _checked_binding() -> bool:
    """Binds the C functions and checks them against xxhash and zstandard."""
    ext = native.extension()
    if ext is None or os.environ.get("UCM_DB_BATCH_LOADS", "1") == "0" or not hasattr(ext, "plan_units"):
        return False
    ext.bind_loads(*_library_candidates())
    has_xxh3, has_zstd = ext.loads_bound()
    if not (has_xxh3 and has_zstd):
        return False
    sample = bytes(range(256)) * 300 + b"ucm-db"
    if ext.xxh3_parts((sample[:77], sample[77:])) != xxhash.xxh3_64(sample).intdigest():
        return False
    frame = zstandard.ZstdCompressor(level=3).compress(sample)
    return ext.zstd_decompress(frame, len(sample)) == sample and ext.zstd_decompress(frame, len(sample) + 1) is None


#: Whether the native path is in use (see the module docstring).
AVAILABLE: bool = _checked_binding()

Take = Callable[[int, memoryview, memoryview], bool]
Beside = Callable[[Callable[[], object]], Optional[Callable[[], None]]]


class Batch:
    """The units of one ``get_into`` the native path is offered, loaded
    :data:`FLUSH_UNITS` at a time as they are read."""

    def __init__(self, keys: Sequence[bytes], slabs: ScatterSlabs, below_frame_bytes: int | None, beside: Beside,
                 declined: Take, results: list[bool | None], namespace_id: bytes = b"") -> None:
        self._keys = keys if isinstance(keys, list) else list(keys)
        self._namespace_id = namespace_id
        self._slabs = slabs
        self._below_frame_bytes = below_frame_bytes
        self._beside = beside
        self._declined = declined
        self._results = results
        self._clear()

    def _clear(self) -> None:
        self._ids: list[int] = []
        self._heads: list[memoryview] = []
        self._bodies: list[memoryview] = []
        self._kinds = bytearray()
        self._checksums = bytearray()
        self._indices: list[int] = []

    def taker(self, fallback: Take) -> Take:
        """``take(i, head, body)`` for ``with_blocks``: plans a unit the
        native path can take (loading the plan once it is
        :data:`FLUSH_UNITS` long), else offers it to ``fallback``."""
        keys, indices, below = self._keys, self._slabs.indices, self._below_frame_bytes
        pack = struct.Struct("<Q").pack

        def take(i: int, head: memoryview, body: memoryview) -> bool:
            checked = batch_checksum(head, len(body), keys[i], below)
            if checked is None:
                return fallback(i, head, body)
            shuffled, checksum = checked
            self._ids.append(i)
            self._heads.append(head)
            self._bodies.append(body)
            self._kinds.append(_KIND_SHUFFLED if shuffled else _KIND_RAW)
            self._checksums.extend(pack(checksum))
            self._indices.append(indices[i])
            if len(self._ids) >= FLUSH_UNITS:
                self.finish()
            return True

        return take

    def take_chunk(self, start: int, stored: list[Any], heads: list[Any], metas: list[Any] | None) -> Sequence[int]:
        """``take_chunk`` for ``with_blocks``: plans a chunk of the read's
        units in one native call (``_native.plan_units``: the checks of
        ``with_blocks`` and :func:`~ucm_db.codec.raw_loads.batch_checksum`), loads
        those it takes (a codec thread beside the caller for a large chunk),
        hands any the load declines to the Python path, and returns the
        positions it did not plan, for the per-unit path."""
        n = len(stored)
        ext = native.extension()
        assert ext is not None  # AVAILABLE
        below = -1 if self._below_frame_bytes is None else self._below_frame_bytes
        kinds, checksums = ext.plan_units(self._keys[start : start + n], stored, heads, metas, self._namespace_id, RAW_TABLES,
                                          below, _FORMAT)
        skipped = kinds.count(0)
        if skipped == n:
            return range(n)
        state = bytearray(8 + n)
        slabs = self._slabs
        args = (heads, stored, kinds, checksums, slabs.views, slabs.slab_bytes, slabs.indices[start : start + n], state,
                CHUNK_UNITS, CHUNK_BYTES)
        self._load(args, n - skipped >= HELPER_MIN_UNITS)
        results = self._results
        if not skipped and state.count(_LOADED, 8) == n:  # the common case, without a pass per unit
            results[start : start + n] = [True] * n
            return ()
        for k in range(n):
            if not kinds[k]:
                continue
            if state[8 + k] == _LOADED:
                results[start + k] = True
            else:
                self._declined(start + k, memoryview(heads[k]), memoryview(stored[k]))
        return [k for k in range(n) if not kinds[k]]

    def _load(self, args: tuple[Any, ...], helped: bool) -> None:
        """``_native.load_units(*args)`` on the caller's thread, and beside
        it on a codec thread if ``helped``; slabs it refuses (more views
        than it takes: a bare ValueError escaped ``get_into``) are a
        :class:`~ucm_db.errors.ConfigError`, as on the per-unit path."""
        ext = native.extension()
        assert ext is not None  # AVAILABLE
        join = self._beside(lambda: ext.load_units(*args)) if helped else None
        try:
            try:
                ext.load_units(*args)
            finally:
                if join is not None:
                    join()
        except ValueError as exc:
            raise checked_copy.slabs_error(args[1][0], exc) from exc

    def finish(self) -> None:
        """Loads the units planned so far (the caller, and a codec thread
        through ``beside`` for a large plan): ``results[i]`` becomes True
        for each loaded, and every other goes to ``declined``."""
        n = len(self._ids)
        if not n:
            return
        state = bytearray(8 + n)
        slabs = self._slabs
        args = (self._heads, self._bodies, bytes(self._kinds), bytes(self._checksums), slabs.views, slabs.slab_bytes,
                self._indices, state, CHUNK_UNITS, CHUNK_BYTES)
        self._load(args, n >= HELPER_MIN_UNITS)
        ids, heads, bodies = self._ids, self._heads, self._bodies
        self._clear()
        for k, i in enumerate(ids):
            if state[8 + k] == _LOADED:
                self._results[i] = True
            else:
                self._declined(i, heads[k], bodies[k])


def batch_for(keys: Sequence[bytes], buffers: Any, below_frame_bytes: int | None, beside: Beside, declined: Take,
              results: list[bool | None], namespace_id: bytes = b"") -> Batch | None:
    """A :class:`Batch` for a read into ``buffers`` (``beside`` starts a
    helper, ``declined(i, head, body)`` takes a unit back to the Python
    path, ``results`` gets True for each unit loaded), or None where the
    native path does not apply (not slabs, fewer than two units, not
    :data:`AVAILABLE`)."""
    if not AVAILABLE or not isinstance(buffers, ScatterSlabs) or len(keys) < 2:
        return None
    return Batch(keys, buffers, below_frame_bytes, beside, declined, results, namespace_id)
