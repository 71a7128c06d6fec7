"""The block entries a put hands the local tier, made from what the caller
gave: blobs encoded already (``put_encoded``, :func:`verified_entries`),
blocks the codec encoded (:func:`encoded_entries`) or staged units of codec
``none`` (:func:`raw_entries`, sealed here without the codec's per-block
layers).

Invariants:
    * An encoded blob becomes an entry only once it verifies under its key
      (header, owning key, checksum); one that does not refuses the whole
      put (nothing is written).
    * A raw entry's head and body are the bytes
      ``codec.encode_parts(key, payload, codec="none")`` gives, and its body
      is the caller's buffer itself (no copy): the put reads it before it
      returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ucm_db import codec
from ucm_db.arguments import key_list, require_parent
from ucm_db.codec.encoding import Framed, seal_framed_raw
from ucm_db.codec.pool import Payload
from ucm_db.errors import ConfigError, CorruptBlockError
from ucm_db.index.local import BlockEntry


def verified_entries(blocks: object, namespace_id: bytes) -> list[BlockEntry]:
    """``put_encoded``'s blocks as entries, each blob verified under its key
    (:func:`ucm_db.codec.verify_sound`: its frames must decode too)."""
    if isinstance(blocks, (bytes, bytearray, memoryview, str)) or not isinstance(blocks, Sequence):
        raise ConfigError(f"put_encoded takes a sequence of (key, parent, blob), got {type(blocks).__name__}",
                          hint="pass e.g. [(key, None, blob), (child_key, key, child_blob)]")
    entries = []
    for block in blocks:
        if not isinstance(block, (tuple, list)) or len(block) != 3:
            raise ConfigError(f"each put_encoded block is a (key, parent, blob) triple, got {type(block).__name__}",
                              hint="pass e.g. [(key, None, blob), (child_key, key, child_blob)]")
        [key] = key_list([block[0]], "put_encoded")
        parent, blob = require_parent(block[1]), block[2]
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ConfigError(f"an encoded block is a bytes-like blob, got {type(blob).__name__}",
                              hint="pass each block as its store holds it, e.g. an archive's member bytes")
        if isinstance(blob, memoryview) and not (blob.c_contiguous and blob.itemsize == 1):
            raise ConfigError(f"an encoded block is a contiguous view of bytes, got one of format {blob.format!r}"
                              f"{'' if blob.c_contiguous else ', strided'}",
                              hint="pass bytes(view), or a view cast to bytes (view.cast('B'))")
        try:
            header = codec.verify_sound(blob, key)
        except CorruptBlockError as exc:
            why = exc.message
            raise CorruptBlockError(f"block {key.hex()[:16]} does not verify under its key ({why}); nothing was written",
                                    hint="pass blobs as a store holds them (e.g. export's members), each with its own key") from exc
        entries.append(BlockEntry.of_blob(key, parent, blob, header.raw_len, namespace_id))
    return entries


def encoded_entries(
    namespace_id: bytes, keys: Sequence[bytes], parents: Sequence[bytes | None], todo: list[int],
    encoded: Sequence[codec.EncodedBlock], packed: Mapping[bytes, bytes] | None,
) -> list[BlockEntry]:
    """The entries of blocks ``todo`` (indices into ``keys`` and
    ``parents``) the codec encoded (``encoded``, in that order).
    ``packed``: evented blocks' packed event fields by key."""
    return [
        BlockEntry(keys[i], parents[i], block.head, block.body_buffer(), block.raw_len, namespace_id,
                   None if packed is None else packed.get(keys[i]))
        for i, block in zip(todo, encoded)
    ]


def raw_entries(
    namespace_id: bytes, keys: Sequence[bytes], payloads: Sequence[Payload], parents: Sequence[bytes | None], todo: list[int],
    packed: Mapping[bytes, bytes] | None,
) -> list[BlockEntry] | None:
    """The entries of codec ``none`` blocks ``todo`` (indices into ``keys``,
    ``payloads`` and ``parents``) where their payloads are all
    :class:`~ucm_db.codec.Framed` (a connector's staged units): what the
    codec's ``encode_parts`` gives them, sealed without its per-block
    layers (:func:`~ucm_db.codec.encoding.seal_framed_raw`); None where
    one is not (the codec encodes them then). ``packed``: evented blocks'
    packed event fields by key."""
    if not all(type(payloads[i]) is Framed for i in todo):
        return None
    entries = []
    for i in todo:
        key = keys[i]
        head, body = seal_framed_raw(key, payloads[i])  # type: ignore[arg-type]  # Framed, as checked above
        entries.append(BlockEntry(key, parents[i], head, body, len(body), namespace_id, None if packed is None else packed.get(key)))
    return entries
