"""A block's bytes copied into the caller's buffers, checked on the way.

:func:`copy_verified` copies a body stored raw into the caller's buffer or
scatter list while its checksum is computed: ``native.copy_into`` hashes
each piece of at most :data:`VERIFY_CHUNK_BYTES` right before it copies it,
so the copy reads the piece from cache and each byte comes from memory once
(the read path's largest cost was reading it twice: once to verify, once to
copy). :func:`copy_out` places decoded bytes into a scatter list in one C
call, however many pieces.

Invariants:
    * A block whose checksum fails raises
      :class:`~ucm_db.errors.CorruptBlockError` after its bytes were copied:
      the caller's buffers then hold unverified bytes, and the read reports
      the block as not loaded (``get_into``'s flag False), as it does for any
      block that fails part way. Nothing unverified is reported as loaded.
    * Output buffers that cannot take the block raise
      :class:`~ucm_db.errors.ConfigError` before any byte is copied.
    * The checksum is the one the codec seals (xxh3-64 over head, then
      body): hashing the body in pieces in order gives the same digest.
"""

from __future__ import annotations

from collections.abc import Sequence


from ucm_db.buffers import Buffer
from ucm_db.codec import native
from ucm_db.errors import ConfigError, CorruptBlockError

#: Bytes hashed, then copied, at a time: small enough to stay in L2 between
#: the two (on a loaded 2-core host fused and two-pass copies of 64 KiB
#: units measured alike, about 7 GB/s per CPU second; larger pieces than
#: the cache would read memory twice).
VERIFY_CHUNK_BYTES = 64 << 10


def copy_verified(hasher: native.Hasher, body: Buffer, out: Buffer | Sequence[Buffer], checksum: int) -> int:
    """Copies ``body`` into ``out`` while ``hasher`` (the checksum's state
    after the head) takes it; returns the bytes copied.

    Raises:
        CorruptBlockError: the digest is not ``checksum`` (``out`` holds the
            unverified bytes).
        ConfigError: ``out`` cannot take ``body`` (nothing copied).
    """
    copied = copy_out(body, out, hasher)
    if hasher.intdigest() != checksum:  # type: ignore[attr-defined]
        raise CorruptBlockError("checksum mismatch")
    return copied


def slabs_error(body: Buffer, exc: ValueError) -> ConfigError:
    """The error of slabs that cannot take ``body`` (``copy_into_slabs``'s ValueError)."""
    return ConfigError(
        f"slabs smaller than the block's {memoryview(body).nbytes} bytes, or overlapping it: {exc}",
        hint="pass get_into slabs at least as large as the stored blocks",
    )


def copy_out(source: Buffer, out: Buffer | Sequence[Buffer], hasher: native.Hasher | None = None) -> int:
    """``source`` into ``out`` (one buffer, or a list or tuple filled one
    after another), hashed on the way if ``hasher`` is given."""
    try:
        return native.copy_into(source, out, hasher, VERIFY_CHUNK_BYTES)
    except ValueError as exc:
        raise ConfigError(
            f"output buffers smaller than the block's {memoryview(source).nbytes} bytes, or overlapping it: {exc}",
            hint="pass get_into buffers at least as large as the stored blocks",
        ) from exc
