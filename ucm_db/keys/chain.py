"""The chained BLAKE2b over token blocks: the one hash behind every block key.

``chain_keys(prev, tokens, block_size, n_blocks)`` returns ``n_blocks`` keys,
``key[i] = BLAKE2b-256(key[i-1] || little-endian uint32 ids of block i)``
with ``key[-1] = prev``. :mod:`ucm_db.keys` builds namespaces, roots and
block extras around it.

Invariants:
    * The hash is hashlib's BLAKE2b (unkeyed, no salt or person, 32-byte
      digest): a maintained implementation, the same one ``keys.py`` uses
      for roots and block extras. There is no second BLAKE2b anywhere.
    * The output is permanent: every stored block is named by it, and
      ``tests/test_key_chain.py`` pins known answers.
    * Token ids are checked, never wrapped: a negative id or one of
      2**32 or more raises ``OverflowError``, a non-integer ``TypeError``;
      a buffer must hold bytes or little-endian uint32 (else ``TypeError``).
      Ids past the last full block are not read.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Union
from ucm_db.buffers import Buffer

KEY_BYTES = 32
#: Token ids: a list or tuple of ints, or a buffer of little-endian uint32.
TokenSource = Union[list[int], tuple[int, ...], Buffer]

#: Unkeyed, unsalted BLAKE2b with a 32-byte digest, copied per key: copying a
#: ready hasher skips the constructor's keyword parsing and parameter block.
_KEY_HASHER = hashlib.blake2b(digest_size=KEY_BYTES)
_LE_UINT32_FORMATS = ("<I",) + (("I", "@I", "=I") if sys.byteorder == "little" else ())
_BYTE_FORMATS = ("B", "b", "c", "@B", "=B", "<B")


def chain_keys(prev: Buffer, tokens: TokenSource, block_size: int, n_blocks: int, start: int = 0) -> list[bytes]:
    """``n_blocks`` chained keys of the ids from index ``start`` (see the module docstring).

    Raises:
        ValueError: ``prev`` is not 32 bytes, sizes are out of range, or
            ``tokens`` holds fewer than ``start + n_blocks * block_size`` ids.
        OverflowError, TypeError: a token id that is not a uint32.
    """
    if len(prev) != KEY_BYTES:
        raise ValueError(f"prev must be {KEY_BYTES} bytes, got {len(prev)}")
    if block_size < 1 or n_blocks < 0 or start < 0:
        raise ValueError("block_size must be >= 1, n_blocks and start >= 0")
    stride = block_size * 4
    raw = le_uint32_bytes(tokens, n_blocks * block_size, start)
    new_hasher = _KEY_HASHER.copy
    key = bytes(prev)
    out: list[bytes] = []
    append = out.append
    # Two update() calls instead of hashing key + chunk: no concatenation.
    for chunk in [raw[at : at + stride] for at in range(0, n_blocks * stride, stride)]:
        hasher = new_hasher()
        hasher.update(key)
        hasher.update(chunk)
        key = hasher.digest()
        append(key)
    return out


def le_uint32_bytes(tokens: TokenSource, count: int, start: int = 0) -> bytes:
    """``count`` ids from index ``start`` as little-endian uint32 bytes."""
    if isinstance(tokens, (list, tuple)):
        if len(tokens) - start < count:
            raise ValueError(f"tokens holds {len(tokens)} ids, fewer than start + n_blocks * block_size = {start + count}")
        ids = array("I", tokens[start : start + count])  # OverflowError / TypeError for a bad id
        if ids.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte unsigned int
            raise RuntimeError("unsigned int is not 4 bytes on this platform")
        if sys.byteorder != "little":  # pragma: no cover
            ids.byteswap()
        return ids.tobytes()
    view = memoryview(tokens)
    if not (view.itemsize == 1 and view.format in _BYTE_FORMATS or view.itemsize == 4 and view.format in _LE_UINT32_FORMATS):
        raise TypeError(f"tokens buffer must hold bytes or little-endian uint32, not format {view.format!r}")
    if not view.c_contiguous:
        raise BufferError("tokens buffer is not C-contiguous")
    raw = view.cast("B")
    if len(raw) // 4 - start < count:
        raise ValueError(f"tokens buffer holds {len(raw)} bytes, fewer than 4 * (start + n_blocks * block_size) = {4 * (start + count)}")
    return raw[4 * start : 4 * (start + count)].tobytes()
