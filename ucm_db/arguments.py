"""Checks and normalisation of the arguments of the public store API.

Every function here either returns the argument in the one form the store
works with or raises :class:`~ucm_db.errors.ConfigError` naming the problem
and its fix; none of them touches stored data, so a refused call has
written nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ucm_db.codec import Framed, buffer_view
from ucm_db.errors import ConfigError
from ucm_db.keys import KEY_BYTES, BlockKeys, Namespace


class Unset:
    """Type of :data:`UNSET`: ``put``'s ``parent`` was not given."""

    __slots__ = ()


UNSET = Unset()


class ProbedKeys(Sequence[bytes]):
    """A view of ``keys`` that refuses a malformed key when it is read."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: Any) -> Any:
        key = self._keys[index]
        if isinstance(index, int) and (not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES):
            got = f"one of {len(key)}" if isinstance(key, (bytes, bytearray, memoryview)) else f"a {type(key).__name__}"
            raise ConfigError(f"block keys are {KEY_BYTES}-byte bytes objects, got {got}", hint="use Namespace.block_keys")
        return key


def require_namespace(namespace: Any, operation: str) -> None:
    """Refuses anything but a :class:`~ucm_db.keys.Namespace`."""
    if not isinstance(namespace, Namespace):
        raise ConfigError(
            f"{operation} takes a Namespace first, got {type(namespace).__name__}",
            hint="pass ucm_db.Namespace(model=..., kv_dtype=..., block_size=...), the namespace the keys were made in",
        )


def require_parent(parent: Any) -> bytes | None:
    """A parent key as ``bytes`` (or None), or a :class:`ConfigError`."""
    if parent is None:
        return None
    if not isinstance(parent, (bytes, bytearray, memoryview)) or len(parent) != KEY_BYTES:
        raise ConfigError(
            f"parent must be a {KEY_BYTES}-byte block key or None, got {type(parent).__name__}"
            + (f" of {len(parent)} bytes" if isinstance(parent, (bytes, bytearray, memoryview)) else ""),
            hint="pass the key of the block before keys[0], as returned by Namespace.block_keys",
        )
    return bytes(parent)


def key_list(keys: Any, operation: str) -> Sequence[bytes]:
    """``keys`` as a sequence of 32-byte ``bytes`` keys: an iterator is
    read into a list (never silently consumed), bytearray/memoryview keys
    become bytes, anything else is a :class:`ConfigError`."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Iterable):
        raise ConfigError(
            f"{operation} takes a sequence of block keys, got {type(keys).__name__}",
            hint="pass a list of 32-byte keys, e.g. from Namespace.block_keys (wrap a single key: [key])",
        )
    if not isinstance(keys, Sequence):
        keys = list(keys)
    if set(map(type, keys)) - {bytes}:
        for key in keys:
            if not isinstance(key, (bytes, bytearray, memoryview)):
                raise ConfigError(
                    f"block keys are 32-byte bytes objects, got a {type(key).__name__}", hint="use Namespace.block_keys",
                )
        converted = [bytes(key) for key in keys]
        keys = BlockKeys(converted, parent=keys.parent) if isinstance(keys, BlockKeys) else converted
    require_keys(keys)
    if isinstance(keys, BlockKeys) and keys.parent is not None:
        parent = require_parent(keys.parent)
        if type(keys.parent) is not bytes:
            keys = BlockKeys(keys, parent=parent)
    return keys


def segment_list(segments: Any) -> list[tuple[Any, Any]]:
    """``put_segments``' argument as a list of ``(keys, payloads)`` pairs."""
    if isinstance(segments, (bytes, bytearray, memoryview, str)) or not isinstance(segments, Iterable):
        raise ConfigError(
            f"put_segments takes a sequence of (keys, payloads) pairs, got {type(segments).__name__}",
            hint="pass e.g. [(keys_a, payloads_a), (keys_b, payloads_b)]",
        )
    pairs = list(segments)
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigError(
                f"each put_segments segment is a (keys, payloads) pair, got {type(pair).__name__}"
                + (f" of {len(pair)}" if isinstance(pair, (tuple, list)) else ""),
                hint="pass e.g. [(keys_a, payloads_a), (keys_b, payloads_b)]",
            )
    return [(keys, payloads) for keys, payloads in pairs]


def segment_parent(keys: Sequence[bytes], parent: bytes | None | Unset) -> bytes | None:
    """The parent of ``keys[0]`` for a put: ``parent=`` if given (checked
    against a :class:`BlockKeys`'s own), else the ``BlockKeys``'s."""
    if isinstance(parent, Unset):
        if isinstance(keys, BlockKeys):
            return keys.parent
        if not keys:
            return None
        raise ConfigError(
            "put of a plain key list needs parent=: the key of the block before keys[0], or None if keys[0] "
            "is its chain's first block",
            hint="pass keys from Namespace.block_keys (its slices know their parent), or parent= explicitly",
        )
    parent = require_parent(parent)
    if isinstance(keys, BlockKeys) and keys and keys.parent != parent:
        raise ConfigError(
            "parent= disagrees with the keys' own parent (the key before keys[0] in Namespace.block_keys)",
            hint="omit parent= when passing a slice of Namespace.block_keys",
        )
    return parent


def require_payload(payload: Any) -> None:
    """Refuses payloads that are not C-contiguous byte buffers (or a
    list/tuple of them): a str, None, a dict, a strided or object-dtype
    numpy array would otherwise fail deep in the codec or, for object
    arrays, store raw pointers."""
    if isinstance(payload, Framed):
        payload = payload.buffer  # its own constructor checked the frames
    for frame in payload if isinstance(payload, (list, tuple)) else (payload,):
        view = buffer_view(frame, "a payload")
        if "O" in view.format:
            raise ConfigError("a payload holds Python objects (numpy dtype=object)", hint="pass numeric arrays, e.g. arr.astype(np.float16)")
        if not view.c_contiguous:
            raise ConfigError("a payload is not C-contiguous (a strided view)", hint="pass numpy.ascontiguousarray(payload)")


def require_writable(buffer: Any) -> None:
    try:
        view = memoryview(buffer)
    except (TypeError, ValueError):  # ValueError: a dtype with no buffer (datetime64)
        raise ConfigError(
            f"get_into writes into buffers (bytearray, numpy array), got {type(buffer).__name__}"
            + (f" of dtype {buffer.dtype}" if hasattr(buffer, "dtype") else ""),
            hint="pass writable buffers such as bytearray(size)",
        ) from None
    if view.readonly or not view.c_contiguous:
        raise ConfigError("get_into needs writable, C-contiguous buffers", hint="pass bytearray(size) or a contiguous numpy array")


def require_keys(keys: Sequence[bytes]) -> None:
    """Refuses keys that are not 32-byte block keys (map(len) runs in C: a
    lookup of 8192 keys stays cheap)."""
    try:
        lengths = set(map(len, keys))
    except TypeError:  # an int, None: no length
        bad_type = next(type(key).__name__ for key in keys if not hasattr(key, "__len__"))
        raise ConfigError(f"block keys are {KEY_BYTES}-byte bytes objects, got a {bad_type}",
                          hint="use Namespace.block_keys") from None
    if lengths - {KEY_BYTES}:
        bad = sorted(lengths - {KEY_BYTES})[0]
        raise ConfigError(f"block keys are {KEY_BYTES} bytes, got one of {bad}", hint="use Namespace.block_keys")


def require_namespace_selectors(selectors: Any, operation: str) -> tuple[str, ...]:
    """Namespace selectors (id hex prefixes or model names, ``--namespace``)
    as a tuple of strings. An empty or whitespace-only one is refused: as a
    prefix it matches every namespace (``--namespace "$MODEL"`` with MODEL
    unset invalidated every model, issue 48); so is a bare string, whose
    characters would each be read as a selector."""
    if isinstance(selectors, (str, bytes)) or not isinstance(selectors, Iterable):
        raise ConfigError(f"{operation} takes a tuple of namespace selectors, got {type(selectors).__name__}",
                          hint="pass e.g. namespaces=('Qwen/Qwen2.5-0.5B',) or an id prefix such as ('3f2a9c',)")
    checked = tuple(selectors)
    for selector in checked:
        if not isinstance(selector, str) or not selector.strip():
            raise ConfigError(
                f"{operation}: namespace selector {selector!r} is empty; an empty id prefix would match every namespace",
                hint="pass --namespace with a namespace id prefix or a model name (`ucm-db inspect PATH` lists them); "
                "an unset shell variable (--namespace \"$MODEL\") expands to an empty one")
    return checked


def namespaces_selected(selector: str, models: Mapping[bytes, Any]) -> set[bytes]:
    """The ids among ``models`` (namespace id -> its model name, None where
    unknown) that the one ``selector`` names: those whose model is exactly
    ``selector``, or, only where no model is, those whose id's hex starts
    with it (case-insensitive). A model's name wins over id prefixes, so a
    model named ``bf`` never also selects a namespace whose id starts
    ``bf...``; a longer prefix or the full id names that one. The one rule
    of every ``--namespace`` (the store's commands and ``warm``)."""
    named = {ns for ns, model in models.items() if model == selector}
    return named or {ns for ns in models if ns.hex().startswith(selector.lower())}


def require_remote_url(url: Any, operation: str) -> str:
    """A remote tier's fsspec URL (``scheme://...``), as the store's
    ``remote`` option takes it: an empty one (an unset ``"$REMOTE"``) or a
    bare path would name the current directory, which ``gc`` then cleans."""
    if not isinstance(url, str) or "://" not in url or not url.split("://", 1)[1].strip():
        raise ConfigError(f"{operation} needs a remote URL such as s3://bucket/prefix or file:///abs/dir, got {url!r}",
                          hint="pass the URL the store's `remote` option names (an unset shell variable expands to '')")
    return url


def require_limit(name: str, value: Any, *, integer: bool) -> None:
    """A size or age limit of a maintenance call: a finite number >= 0
    (an int where ``integer``), never a bool; ``None`` (no limit) passes.
    A negative limit would evict or delete everything it covers."""
    if value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be {'an integer' if integer else 'a finite number'} >= 0, got {value!r}",
                          hint=f"pass {name}=<{'bytes' if integer else 'seconds'}>, or None for no limit")


def require_count(name: str, value: Any, *, minimum: int, hint: str) -> None:
    """An integer argument of a maintenance call at least ``minimum`` (never a
    bool or a str); ``None`` passes. ``verify(sample=0)`` checked no block
    and reported a clean store; ``since_seq=-5`` ended in a struct.error."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ConfigError(f"{name} must be an integer >= {minimum} (or None), got {value!r}", hint=hint)


def require_token_sequences(token_sequences: Any, operation: str) -> list[Any]:
    """The prompts of a maintenance call as a list (an iterator is read once:
    the prompts are walked twice); each prompt's ids are checked by
    :meth:`~ucm_db.keys.Namespace.block_keys`."""
    if isinstance(token_sequences, (str, bytes, bytearray, memoryview)) or not isinstance(token_sequences, Iterable):
        raise ConfigError(f"{operation} takes a list of prompts, got {type(token_sequences).__name__}",
                          hint="pass one list of token ids per prompt, e.g. [[151644, 8948, 198], [151644, 872]]")
    return list(token_sequences)


def require_distinct_keys(keys: Sequence[bytes], operation: str) -> None:
    """Refuses a key given twice in one call: in a put, the second copy
    would name the first as its parent and its payload be dropped."""
    if len(set(keys)) != len(keys):
        seen: dict[bytes, int] = {}
        for index, key in enumerate(keys):
            if key in seen:
                raise ConfigError(f"{operation}: keys[{index}] repeats keys[{seen[key]}] ({key.hex()[:16]})",
                                  hint="pass each block once, in chain order (Namespace.block_keys gives distinct keys)")
            seen[key] = index
