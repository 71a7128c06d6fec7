"""Namespaces and chained block keys.

A :class:`Namespace` names everything that makes two KV caches incompatible:
model identity, KV dtype and layout, block size, parallel ranks, format.
Its :attr:`Namespace.digest` seeds every key chain, so blocks of different
namespaces can never collide or hit each other.

Invariants:
    * Keys are deterministic across processes, interpreter runs and
      platforms: they depend only on the namespace fields, the token ids and
      the request extras (no ``hash()``, no PYTHONHASHSEED).
    * ``key[i] = H(key[i-1] || tokens of block i)`` with
      ``key[-1] = H(namespace digest || canonical extras)``; a key therefore
      names its whole prefix, and only full blocks get keys.
    * A block with a block extra ``e`` (a multimodal item or prompt
      embeddings inside it) is chained from ``H(key[i-1] || e)`` instead of
      ``key[i-1]``: the blocks before it keep the keys of a plain prompt with
      the same tokens, so prefixes are shared up to the first block whose
      extras differ, and every key after it differs.
    * ``epoch`` (a namespace's invalidation count, :mod:`ucm_db.store.epochs`)
      is mixed into the root key when it is not 0, so every key of a chain
      rooted at another epoch differs: bumping the epoch makes every block
      stored before it a miss. Epoch 0 gives the keys ucm-db always gave.
    * Keys are 32-byte BLAKE2b digests (unkeyed, no salt or person) over
      the parent key and the block's token ids as little-endian uint32.
      :func:`ucm_db.keys.chain.chain_keys` computes the chain with hashlib's
      BLAKE2b, the one implementation behind every key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, SupportsIndex, Union, overload

from ucm_db.keys import chain as key_chain
from ucm_db.keys import inputs as key_inputs
from ucm_db.errors import ConfigError

KEY_BYTES = 32
#: Bumped when the way keys are derived changes (old keys become misses).
KEY_SCHEME_VERSION = 1

ExtraValue = Union[str, int, bytes, None]


@dataclass(frozen=True)
class Namespace:
    """Identity of a KV cache; blocks of different namespaces never mix.

    Attributes:
        model: model identity (name or path, plus revision if it matters).
        kv_dtype: KV cache element type, e.g. ``"bfloat16"``.
        block_size: tokens per block.
        tp_rank, tp_size: tensor-parallel rank and world size.
        pp_rank, pp_size: pipeline-parallel rank and world size.
        layout: KV layout descriptor (backend and tensor shapes per block).
        key_scheme: version of the key derivation.
        extra: free-form identity (e.g. quantisation config); empty if none.
    """

    model: str
    kv_dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layout: str = ""
    key_scheme: int = KEY_SCHEME_VERSION
    extra: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("Namespace.model must be a non-empty string", hint="pass the model name or path")
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise ConfigError("Namespace.kv_dtype must be a non-empty string", hint="pass e.g. kv_dtype='bfloat16'")
        for name in ("block_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Namespace.{name} must be a positive integer, got {value!r}", hint=f"pass {name}=1 or more")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            value = getattr(self, rank)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < getattr(self, size):
                raise ConfigError(f"Namespace.{rank} must be in [0, {size}), got {value!r}", hint=f"check {rank} and {size}")
        # A description read from JSON (an archive, a remote manifest) may
        # hold anything: a dict here hashed into an id, then failed deep in
        # a put (unhashable), after the store was created.
        for name in ("layout", "extra"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"Namespace.{name} must be a string, got {type(value).__name__}",
                                  hint=f"pass {name} as a string ('' if none); encode structured data as JSON text")
        if isinstance(self.key_scheme, bool) or not isinstance(self.key_scheme, int) or self.key_scheme < 0:
            raise ConfigError(f"Namespace.key_scheme must be a non-negative integer, got {self.key_scheme!r}",
                              hint=f"leave it out (the current scheme is {KEY_SCHEME_VERSION})")
        object.__setattr__(self, "_digest", _namespace_digest(self))

    @property
    def digest(self) -> bytes:
        """32-byte stable digest of all fields."""
        return self._digest  # type: ignore[attr-defined,no-any-return]

    @property
    def id(self) -> bytes:  # noqa: A003 - the namespace's id is what the store and the remote name it by
        """The 16-byte namespace id the store, its records, the remote tier
        and archives name the namespace by: the digest's first 16 bytes
        (the one place this is spelled)."""
        return self.digest[:16]

    @property
    def short_id(self) -> str:
        """16 hex characters identifying the namespace in paths and reports."""
        return self.digest[:8].hex()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def description_json(self) -> bytes:
        """The description a store records with the namespace's blocks
        (``nsdesc:<id>``): :meth:`to_dict` as JSON with sorted keys, which
        :meth:`from_dict` turns back into this namespace (so it hashes to
        :attr:`id`). Every writer of a description (a put, a promotion from
        a remote) records exactly this."""
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Namespace:
        """The namespace a description (:meth:`to_dict`, e.g. read from
        JSON) names; a ConfigError naming the field for anything else."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a namespace description is a mapping of its fields, got {type(data).__name__}",
                              hint="pass Namespace.to_dict()'s form: a JSON object")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConfigError(f"unknown Namespace field(s) {', '.join(unknown)}", hint=f"valid fields: {', '.join(sorted(valid))}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"a namespace description lacks field(s) {', '.join(missing)}",
                              hint="pass Namespace.to_dict()'s form: model, kv_dtype and block_size at least")
        return cls(**dict(data))

    def root_key(self, extras: Mapping[str, ExtraValue] | None = None, *, epoch: int = 0) -> bytes:
        """The virtual parent of a chain's first block, for these extras, at
        the namespace's ``epoch`` (see module invariants)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 1 << 64:
            raise ConfigError(f"epoch must be an integer in [0, 2**64), got {epoch!r}", hint="pass Store.epoch(namespace)")
        key_inputs.check_extras(extras, None)
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"ucm-db/root")
        h.update(self.digest)
        canonical = _canonical_extras(extras) if extras else b""
        if canonical:
            h.update(canonical)
        if epoch:
            # After the fixed-size digest and the JSON extras (never a NUL
            # byte): no extras can spell an epoch's bytes.
            h.update(b"\0epoch" + epoch.to_bytes(8, "little"))
        return h.digest()

    def block_keys(
        self,
        token_ids: Sequence[int] | Iterable[int],
        extras: Mapping[str, ExtraValue] | None = None,
        *,
        parent: bytes | None = None,
        start: int = 0,
        stop: int | None = None,
        block_extras: Mapping[int, bytes] | None = None,
        epoch: int = 0,
    ) -> BlockKeys:
        """Keys of the full blocks of ``token_ids[start:stop]``.

        Args:
            token_ids: token ids (a list, tuple or 1-D integer array; an
                iterator is read into a list); a trailing partial block gets
                no key. Text, bytes, bools, arrays of another shape or dtype
                are a :class:`ConfigError`.
            extras: per-request identity mixed into the chain's root: LoRA
                name, ``cache_salt``, multimodal hashes, prompt-embedding
                digest. Values are str, int, bytes or None.
            parent: continue an existing chain from this key (the key of the
                block just before ``token_ids[0]``); ``extras`` must then be
                None because the parent already carries them.
            start, stop: the tokens to hash, as a slice would pick them but
                without copying a long list (``parent`` is then the key of
                the block ending at ``start``).
            block_extras: bytes that change one block's KV beyond its token
                ids (e.g. the hash of an image whose placeholder tokens it
                holds), keyed by block index in ``token_ids`` (block ``k``
                holds ``token_ids[k * block_size : (k + 1) * block_size]``);
                ``start`` must then be a multiple of ``block_size``.
            epoch: the namespace's epoch (:meth:`ucm_db.Store.epoch`), mixed
                into the root key; ignored with ``parent`` (which already
                carries it).

        Returns:
            One 32-byte key per full block, in order, as a :class:`BlockKeys`
            that knows the key before its first one (``parent``), so
            ``store.put(ns, keys[i:j], ...)`` needs no ``parent=``.
        """
        token_ids = _token_sequence(token_ids)
        start, stop = key_inputs.index_argument("start", start), key_inputs.index_argument("stop", stop)
        key_inputs.check_extras(extras, block_extras)
        if parent is not None:
            if extras:
                raise ConfigError("block_keys: pass either parent= or extras=, not both", hint="the parent key already includes the extras")
            if not isinstance(parent, (bytes, bytearray, memoryview)) or len(parent) != KEY_BYTES:
                raise ConfigError(f"parent must be a {KEY_BYTES}-byte key (bytes), got {type(parent).__name__}",
                                  hint="pass a key returned by block_keys, or None for a chain's first block")
            prev = bytes(parent)
        else:
            prev = self.root_key(extras, epoch=epoch)
        block_size = self.block_size
        end = len(token_ids) if stop is None else min(stop, len(token_ids))
        if start < 0 or end < 0:
            raise ConfigError(f"start and stop must be >= 0, got {start} and {stop}", hint="pass indices into token_ids")
        n_blocks = max(0, end - start) // block_size
        if n_blocks == 0:
            return BlockKeys(parent=bytes(parent) if parent is not None else None)
        first_block = start // block_size
        if block_extras and start % block_size:
            raise ConfigError(f"block_extras needs start at a block boundary, got start={start}", hint=f"pass a multiple of {block_size}")
        tokens: key_chain.TokenSource
        if isinstance(token_ids, (list, tuple)):
            tokens = token_ids  # converted (and checked) by chain_keys
        else:
            tokens = _as_chain_tokens(token_ids[start:end], n_blocks * block_size)
            start = 0
        marked = sorted(k - first_block for k in block_extras or () if first_block <= k < first_block + n_blocks)
        chain_parent = bytes(parent) if parent is not None else None
        try:
            if not marked:
                return BlockKeys(key_chain.chain_keys(prev, tokens, block_size, n_blocks, start), parent=chain_parent)
            assert block_extras is not None
            keys: list[bytes] = []
            done = 0
            for index in [*marked, n_blocks]:
                if index > done:  # a run of plain blocks
                    keys.extend(key_chain.chain_keys(prev, tokens, block_size, index - done, start + done * block_size))
                    prev = keys[-1]
                    done = index
                if index < n_blocks:  # one block with extras
                    prev = _mix_block_extra(prev, block_extras[first_block + index])
                    keys.extend(key_chain.chain_keys(prev, tokens, block_size, 1, start + index * block_size))
                    prev = keys[-1]
                    done = index + 1
            return BlockKeys(keys, parent=chain_parent)
        except (OverflowError, TypeError) as exc:
            raise ConfigError(_BAD_TOKENS, hint="pass the prompt's token ids") from exc


class BlockKeys(list):  # type: ignore[type-arg]
    """A run of consecutive chain keys that knows where it starts.

    ``parent`` is the key of the block before the first one, or None when
    the first key is a chain's first block. A contiguous slice keeps the
    rule (``keys[i:j].parent == keys[i - 1]`` for ``i > 0``), so a store
    always knows a segment's parent and can refuse one whose parent is not
    stored (the prefix invariant). Concatenation and other list operations
    give plain lists, which carry no parent.
    """

    __slots__ = ("parent",)

    def __init__(self, keys: Iterable[bytes] = (), *, parent: bytes | None = None) -> None:
        super().__init__(keys)
        self.parent = parent

    @overload
    def __getitem__(self, index: SupportsIndex) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> BlockKeys | list[bytes]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        if not isinstance(index, slice):
            return super().__getitem__(index)
        items = super().__getitem__(index)
        start, _stop, step = index.indices(len(self))
        if step != 1:
            return items
        if not items:
            return BlockKeys(parent=None)
        return BlockKeys(items, parent=super().__getitem__(start - 1) if start > 0 else self.parent)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_block_keys, (list(self), self.parent))

    def __repr__(self) -> str:
        parent = self.parent.hex()[:16] if self.parent is not None else None
        return f"BlockKeys({len(self)} keys, parent={parent})"


def _rebuild_block_keys(keys: list[bytes], parent: bytes | None) -> BlockKeys:
    return BlockKeys(keys, parent=parent)


def _mix_block_extra(parent: bytes, extra: bytes) -> bytes:
    """The parent a block with ``extra`` is chained from (see invariants)."""
    if not isinstance(extra, (bytes, bytearray)):
        raise ConfigError(f"block extras must be bytes, got {type(extra).__name__}", hint="hash the item to bytes first")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"ucm-db/blockx")
    h.update(parent)
    h.update(len(extra).to_bytes(8, "little"))
    h.update(extra)
    return h.digest()


_BAD_TOKENS = "token ids must be non-negative integers < 2**32"
_TOKENS_HINT = "pass one prompt's token ids: a list of ints or a 1-D integer numpy array"


def _token_sequence(token_ids: Any) -> Sequence[int]:
    """``token_ids`` as a sequence of ids, or a :class:`ConfigError` naming
    what it is instead.

    Refused: text and byte strings (their characters or bytes would be
    taken as ids), arrays that are not 1-D (a 2-D batch gave 0 keys) or not
    of an integer dtype, unordered collections, and a list or tuple whose
    first or last id is a bool (a mask passed by mistake; the ends only: a
    scan of every id would cost half of what building the keys costs). An
    iterator or generator is read into a list.
    """
    if isinstance(token_ids, (list, tuple)):
        if token_ids and (type(token_ids[0]) is bool or type(token_ids[-1]) is bool):
            raise ConfigError("token ids must be integers, got bools (True/False would be taken as ids 1/0)", hint=_TOKENS_HINT)
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray)) or (isinstance(token_ids, memoryview) and token_ids.itemsize == 1):
        raise ConfigError(
            f"token ids must be integers, got {type(token_ids).__name__} (its characters or bytes would be taken as ids)",
            hint=_TOKENS_HINT + " (tokenize text first; packed little-endian uint32 ids: numpy.frombuffer(data, '<u4'))",
        )
    ndim = getattr(token_ids, "ndim", None)
    if isinstance(ndim, int) and ndim != 1:
        raise ConfigError(
            f"token ids must be 1-D, got an array of shape {tuple(getattr(token_ids, 'shape', ()))}",
            hint="pass one prompt's ids (e.g. batch[i]); key each prompt of a batch with its own block_keys call",
        )
    kind = getattr(getattr(token_ids, "dtype", None), "kind", None)
    if isinstance(kind, str) and kind not in ("i", "u"):
        raise ConfigError(f"token ids must be integers, got an array of dtype {token_ids.dtype}", hint=_TOKENS_HINT)
    if isinstance(token_ids, (set, frozenset, Mapping)):
        raise ConfigError(f"token ids must be in prompt order, got a {type(token_ids).__name__}", hint=_TOKENS_HINT)
    if hasattr(token_ids, "__len__") and hasattr(token_ids, "__getitem__"):
        return token_ids  # type: ignore[no-any-return]
    if isinstance(token_ids, Iterable):
        return list(token_ids)
    raise ConfigError(f"block_keys takes a sequence of token ids, got {type(token_ids).__name__}", hint=_TOKENS_HINT)


def _as_chain_tokens(token_ids: Sequence[int], count: int) -> key_chain.TokenSource:
    """The first ``count`` ids in a form :func:`ucm_db.keys.chain.chain_keys`
    takes: a numpy integer array as little-endian uint32 bytes (no Python
    loop), any other sequence as a list (converted and checked there)."""
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None and hasattr(token_ids, "astype") and str(dtype) in ("int32", "uint32", "int64", "uint64"):
        as_array: Any = token_ids[:count]
        # The same rule as for a list: ids outside [0, 2**32) are refused,
        # never wrapped into another id's key (astype would wrap them).
        if str(dtype) in ("int32", "int64", "uint64") and len(as_array) and (
            int(as_array.min()) < 0 or int(as_array.max()) >= 1 << 32
        ):
            raise ConfigError(_BAD_TOKENS, hint="pass the prompt's token ids")
        return as_array.astype("<u4").tobytes()  # type: ignore[no-any-return]
    return list(token_ids[:count])


def _canonical_extras(extras: Mapping[str, ExtraValue]) -> bytes:
    items: list[list[Any]] = []
    for name in sorted(extras):
        value = extras[name]
        if value is None:
            continue
        if isinstance(value, bytes):
            items.append([name, "b", value.hex()])
        elif isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"extra {name!r} must be str, int, bytes or None, got {type(value).__name__}", hint="hash it to bytes first")
        else:
            items.append([name, "s" if isinstance(value, str) else "i", value])
    if not items:
        return b""
    return json.dumps(items, separators=(",", ":"), ensure_ascii=True).encode()


def _namespace_digest(namespace: Namespace) -> bytes:
    body = json.dumps(asdict(namespace), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"ucm-db/namespace\0" + body.encode()).digest()
