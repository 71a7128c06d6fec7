"""KV cache event value types: what the store records of a block for vLLM's
KV cache events, and the change feed's records (public API).

A block put with :class:`BlockEventFields` (``Store.put(..., event_fields=)``)
is *evented*: the store keeps its fields beside it and logs, in the same
transaction as the change, a ``stored`` :class:`ChangeRecord` when it is put
and a ``removed`` one when it leaves the store, whoever removes it (eviction
by any process, ``delete``, quarantine, ``compact``, ``gc``, an archive
import's eviction). Blocks put without fields (``ucm-db warm``, ``import``,
remote promotion, plain API puts) never appear in events.

Invariants:
    * Sequence numbers grow by one per record, across every process on the
      store, from a random start (a multiple of 2**32 below 2**52) that a
      new store draws; records ``[first_seq, next_seq)`` are kept, older ones trimmed
      by the writer that appends (the feed keeps at most
      :data:`FEED_MAX_RECORDS` by default).
    * A reader at ``seq < first_seq`` (it fell behind the trim point) gets a
      :class:`ChangeBatch` with ``resync=True`` and no records: it must
      clear its view and replay the inventory (``Store.event_inventory``),
      whose snapshot names the seq to follow from.
    * Packing is a pure function of the fields: no pickle, no eval; a
      malformed record raises :class:`~ucm_db.errors.CorruptBlockError`.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from ucm_db.errors import ConfigError, CorruptBlockError

#: vLLM's ``ExternalBlockHash``: sha256 bytes, or an int with
#: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
BlockHash = Union[bytes, int]
#: Records the feed keeps by default. A record holds its block's token ids
#: (4 bytes each) and fields: about 20 MB at block size 16, about 400 MB at
#: block size 1024, beside the blocks and outside ``capacity_bytes``.
FEED_MAX_RECORDS = 100_000
#: vLLM's medium name for external storage (``vllm.distributed.kv_events.MEDIUM_STORAGE``).
MEDIUM_STORAGE = "STORAGE"

_FIELDS = struct.Struct("<BBIIQqIHHH")
#: Where the epoch sits in packed fields (:func:`packed_epoch`).
_EPOCH_AT = 10
_VERSION = 1
#: Records with vLLM's extra keys: version 1's fields, then a u32 length and their JSON.
_VERSION_EXTRA_KEYS = 2
_EXTRA_LEN = struct.Struct("<I")
_MAX_EXTRA_BYTES = 1 << 16
_HASH_INT, _HAS_PARENT, _PARENT_INT, _HAS_LORA_ID, _HAS_LORA_NAME = 1, 2, 4, 8, 16
_INT_BYTES = 16
_MAX_HASH_BYTES = 1024
_MAX_NAME_BYTES = 4096


@dataclass(frozen=True, slots=True)
class BlockEventFields:
    """What vLLM's ``BlockStored``/``BlockRemoved`` need of one block,
    given when the block is put (the store cannot derive them: vLLM's block
    hash is not ucm-db's key).

    Attributes:
        block_hash: vLLM's hash of the block (bytes, or an int).
        parent_block_hash: the previous block's vLLM hash; None for a first block.
        token_ids: the block's token ids.
        block_size: tokens per block.
        lora_id: the LoRA adapter id, or None.
        lora_name: the LoRA adapter name, or None.
        group_idx: the KV cache group index.
        epoch: the namespace epoch the block's key chain is rooted at
            (:mod:`ucm_db.store.epochs`): a block of an older epoch is never
            served, so readers leave it out.
        extra_keys: the block's entry of vLLM's ``BlockStored.extra_keys``
            (LoRA name, ``(mm identifier, offset)`` pairs, cache salt,
            prompt-embeds digests, untagged as vLLM publishes them), or None.
            Packed as record version 2 (JSON of str, int, float, bytes and
            tuples); a record without them stays version 1, as older code
            wrote and reads it.
    """

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    group_idx: int = 0
    epoch: int = 0
    extra_keys: tuple[Any, ...] | None = None

    def pack(self) -> bytes:
        """The fields as bytes (see module invariants).

        Raises:
            ConfigError: a field of the wrong type or out of range.
        """
        flags = 0
        block_hash = _hash_bytes(self.block_hash, "block_hash")
        flags |= _HASH_INT if isinstance(self.block_hash, int) else 0
        parent = b""
        if self.parent_block_hash is not None:
            parent = _hash_bytes(self.parent_block_hash, "parent_block_hash")
            flags |= _HAS_PARENT | (_PARENT_INT if isinstance(self.parent_block_hash, int) else 0)
        if self.lora_id is not None:
            flags |= _HAS_LORA_ID
        name = b""
        if self.lora_name is not None:
            if not isinstance(self.lora_name, str):
                raise ConfigError(f"lora_name must be a str or None, got {type(self.lora_name).__name__}", hint="pass the adapter's name")
            name = self.lora_name.encode()
            flags |= _HAS_LORA_NAME
        extra = b""
        if self.extra_keys is not None:
            extra = _pack_extra_keys(self.extra_keys)
        try:
            tokens = array("I", self.token_ids)
            head = _FIELDS.pack(_VERSION if self.extra_keys is None else _VERSION_EXTRA_KEYS, flags, self.group_idx, self.block_size, self.epoch, self.lora_id or 0, len(tokens),
                                len(block_hash), len(parent), len(name))
        except (TypeError, OverflowError, struct.error) as exc:
            raise ConfigError(f"event fields out of range: {exc}",
                              hint="token ids, block_size and group_idx are non-negative ints; lora_id a 64-bit int") from exc
        if len(name) > _MAX_NAME_BYTES:
            raise ConfigError(f"lora_name is {len(name)} bytes", hint=f"use a name under {_MAX_NAME_BYTES} bytes")
        if sys.byteorder == "big":
            tokens.byteswap()
        trailer = b"" if self.extra_keys is None else _EXTRA_LEN.pack(len(extra)) + extra
        return b"".join((head, block_hash, parent, name, tokens.tobytes(), trailer))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> BlockEventFields:
        """Fields from :meth:`pack`'s bytes.

        Raises:
            CorruptBlockError: the bytes are not a whole record.
        """
        try:
            version, flags, group_idx, block_size, epoch, lora_id, n_tokens, n_hash, n_parent, n_name = _FIELDS.unpack_from(data)
            body = _FIELDS.size + n_hash + n_parent + n_name + 4 * n_tokens
            extra_keys = None
            if version == _VERSION_EXTRA_KEYS and len(data) >= body + _EXTRA_LEN.size:
                (n_extra,) = _EXTRA_LEN.unpack_from(data, body)
                if len(data) != body + _EXTRA_LEN.size + n_extra:
                    raise ValueError(f"version {version}, {len(data)} bytes")
                extra_keys = _unpack_extra_keys(bytes(data[body + _EXTRA_LEN.size:]))
                data = memoryview(data)[:body]
            elif version != _VERSION or len(data) != body:
                raise ValueError(f"version {version}, {len(data)} bytes")
            at = _FIELDS.size
            block_hash = _hash_value(bytes(data[at:at + n_hash]), flags & _HASH_INT)
            at += n_hash
            parent = _hash_value(bytes(data[at:at + n_parent]), flags & _PARENT_INT) if flags & _HAS_PARENT else None
            at += n_parent
            name = bytes(data[at:at + n_name]).decode() if flags & _HAS_LORA_NAME else None
            at += n_name
            tokens = array("I")
            tokens.frombytes(data[at:])
        except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CorruptBlockError(f"event fields record is malformed: {exc}") from exc
        if sys.byteorder == "big":
            tokens.byteswap()
        return cls(block_hash, parent, tuple(tokens), block_size, lora_id if flags & _HAS_LORA_ID else None, name, group_idx, epoch,
                   extra_keys)


def _pack_extra_keys(extra_keys: Any) -> bytes:
    """JSON of a tuple of str, int, float, bytes (``{"x": hex}``) and tuples."""
    def encode(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return [encode(v) for v in value]
        if isinstance(value, (bytes, bytearray)):
            return {"x": bytes(value).hex()}
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"extra_keys hold str, int, float, bytes and tuples, got {type(value).__name__}",
                              hint="pass vLLM's BlockStored extra_keys entry of the block")
        return value

    if not isinstance(extra_keys, tuple):
        raise ConfigError(f"extra_keys must be a tuple or None, got {type(extra_keys).__name__}", hint="pass a tuple")
    packed = json.dumps(encode(extra_keys), separators=(",", ":")).encode()
    if len(packed) > _MAX_EXTRA_BYTES:
        raise ConfigError(f"extra_keys take {len(packed)} bytes packed", hint=f"keep them under {_MAX_EXTRA_BYTES} bytes")
    return packed


def _unpack_extra_keys(data: bytes) -> tuple[Any, ...]:
    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(decode(v) for v in value)
        if isinstance(value, dict):
            if set(value) != {"x"} or not isinstance(value["x"], str):
                raise ValueError("an extra key object is not bytes")
            return bytes.fromhex(value["x"])
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"an extra key of type {type(value).__name__}")
        return value

    if len(data) > _MAX_EXTRA_BYTES:
        raise ValueError(f"extra keys of {len(data)} bytes")
    decoded = decode(json.loads(data))
    if not isinstance(decoded, tuple):
        raise ValueError("extra keys are not a list")
    return decoded


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    """One entry of the change feed, or of an inventory replay.

    Attributes:
        seq: the record's sequence number (in an inventory: the snapshot's
            ``next_seq``, the same for every record).
        kind: ``"stored"`` or ``"removed"``.
        namespace_id: the block's namespace id (16 bytes, ``Namespace.id``).
        key: the block's ucm-db key (32 bytes).
        fields: the event fields given when the block was put.
        depth: the block's depth in its chain (0 for a first block).
    """

    seq: int
    kind: Literal["stored", "removed"]
    namespace_id: bytes
    key: bytes
    fields: BlockEventFields
    depth: int

    def to_json(self) -> dict[str, object]:
        """The record as vLLM's event fields (JSON-ready: a bytes hash is
        hex), plus ``seq``, ``namespace`` and ``key`` (hex)."""
        f = self.fields
        out: dict[str, object] = {"type": "BlockStored" if self.kind == "stored" else "BlockRemoved",
                                  "block_hashes": [_json_hash(f.block_hash)]}
        if self.kind == "stored":
            out.update(parent_block_hash=None if f.parent_block_hash is None else _json_hash(f.parent_block_hash),
                       token_ids=list(f.token_ids), block_size=f.block_size, lora_id=f.lora_id, lora_name=f.lora_name)
        out.update(medium=MEDIUM_STORAGE, group_idx=f.group_idx, seq=self.seq, namespace=self.namespace_id.hex(), key=self.key.hex(),
                   epoch=f.epoch)
        return out


def json_line(seq: int, kind: str, namespace_id: bytes, key: bytes, packed_fields: bytes, feed_id: str | None = None) -> str:
    """:meth:`ChangeRecord.to_json` as one compact JSON line, straight from
    packed fields (5x faster than decoding and ``json.dumps``: what makes a
    100k-block inventory replay take about a second), with a ``feed_id``
    field last where one is given.

    Raises:
        CorruptBlockError: the fields are malformed.
    """
    try:
        _, flags, group_idx, block_size, epoch, lora_id, n_tokens, n_hash, n_parent, n_name = _FIELDS.unpack_from(packed_fields)
        if len(packed_fields) != _FIELDS.size + n_hash + n_parent + n_name + 4 * n_tokens:
            raise ValueError(f"{len(packed_fields)} bytes")
        at = _FIELDS.size
        block_hash = _json_text(packed_fields[at:at + n_hash], flags & _HASH_INT)
        feed = "" if feed_id is None else _feed_field(feed_id)
        tail = f',"medium":"STORAGE","group_idx":{group_idx},"seq":{seq},"namespace":"{_hex(namespace_id)}","key":"{key.hex()}","epoch":{epoch}{feed}}}'
        if kind != "stored":
            return f'{{"type":"BlockRemoved","block_hashes":[{block_hash}]{tail}'
        at += n_hash
        parent = _json_text(packed_fields[at:at + n_parent], flags & _PARENT_INT) if flags & _HAS_PARENT else "null"
        at += n_parent
        name = json.dumps(packed_fields[at:at + n_name].decode()) if flags & _HAS_LORA_NAME else "null"
        at += n_name
        tokens = array("I")
        tokens.frombytes(packed_fields[at:])
        if sys.byteorder == "big":
            tokens.byteswap()
        token_text = ",".join(map(str, tokens))
    except (struct.error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptBlockError(f"event fields record is malformed: {exc}") from exc
    lora = str(lora_id) if flags & _HAS_LORA_ID else "null"
    return (f'{{"type":"BlockStored","block_hashes":[{block_hash}],"parent_block_hash":{parent},"token_ids":[{token_text}],'
            f'"block_size":{block_size},"lora_id":{lora},"lora_name":{name}{tail}')


def packed_epoch(packed_fields: bytes) -> int:
    """The ``epoch`` of packed fields, without decoding the rest."""
    return int.from_bytes(packed_fields[_EPOCH_AT:_EPOCH_AT + 8], "little")


@functools.lru_cache(maxsize=64)
def _hex(namespace_id: bytes) -> str:
    return namespace_id.hex()


@functools.lru_cache(maxsize=8)
def _feed_field(feed_id: str) -> str:
    return f',"feed_id":{json.dumps(feed_id)}'


def _json_text(data: bytes, is_int: int) -> str:
    return str(int.from_bytes(data, "big", signed=True)) if is_int else f'"{data.hex()}"'


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    """What :meth:`ucm_db.Store.changes_since` returns.

    Attributes:
        records: the records from the asked seq on, in seq order.
        next_seq: the seq to ask from next time.
        resync: the asked seq was trimmed, is ahead of the feed, or belongs
            to another feed (the ``feed_id`` asked with is not this one's):
            clear the view and replay the inventory.
        feed_id: the feed's identity (hex; ``""`` for a store of ucm-db
            before feed ids not opened writable since): a seq means
            something only in the feed it came from. A reader that keeps
            ``next_seq`` across opens or processes keeps this with it and
            passes it back (``changes_since(seq, feed_id=...)``). Not
            compared by ``==`` (batches compared as before feed ids).
    """

    records: tuple[ChangeRecord, ...]
    next_seq: int
    resync: bool = False
    feed_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class EventInventory:
    """What :meth:`ucm_db.Store.event_inventory` returns: every evented
    block stored at one snapshot, parents before children, the feed's
    ``next_seq`` at that snapshot and the feed's id (:class:`ChangeBatch`)."""

    records: tuple[ChangeRecord, ...]
    next_seq: int
    feed_id: str = field(default="", compare=False)


def pack_event_fields(fields: Mapping[bytes, BlockEventFields] | None) -> dict[bytes, bytes] | None:
    """Packs a put's ``event_fields`` argument (None stays None).

    Raises:
        ConfigError: not a mapping of keys to :class:`BlockEventFields`.
    """
    if fields is None:
        return None
    if not isinstance(fields, Mapping):
        raise ConfigError(f"event_fields must map block keys to BlockEventFields, got {type(fields).__name__}",
                          hint="pass {key: ucm_db.BlockEventFields(...)} for the keys to event")
    out: dict[bytes, bytes] = {}
    for key, value in fields.items():
        if not isinstance(value, BlockEventFields):
            raise ConfigError(f"event_fields values must be BlockEventFields, got {type(value).__name__}",
                              hint="build them with ucm_db.BlockEventFields(block_hash=..., ...)")
        out[bytes(key)] = value.pack()
    return out


def _hash_bytes(value: object, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (bytes, int)):
        raise ConfigError(f"{name} must be bytes or an int, got {type(value).__name__}", hint="pass vLLM's block hash")
    if isinstance(value, int):
        try:
            return value.to_bytes(_INT_BYTES, "big", signed=True)
        except OverflowError as exc:
            raise ConfigError(f"{name} {value} does not fit 128 bits", hint="pass vLLM's 64-bit int hash") from exc
    if len(value) > _MAX_HASH_BYTES:
        raise ConfigError(f"{name} is {len(value)} bytes", hint=f"pass a hash under {_MAX_HASH_BYTES} bytes")
    return bytes(value)


def _hash_value(data: bytes, is_int: int) -> BlockHash:
    return int.from_bytes(data, "big", signed=True) if is_int else data


def _json_hash(value: BlockHash) -> str | int:
    return value if isinstance(value, int) else value.hex()
