"""A callable's identity as a namespace input: the same in every process of
a deployment, different for callables that compute differently.

An ``hf_overrides`` function reaches configs ucm-db does not digest (vLLM
composes it onto a speculative draft's config too), so its name alone is no
key: two lambdas, two closures over other values, or two
``functools.partial`` of one function with other arguments share a name
(a review: ``tests/connector/test_review_drafts_fuzz.py``).

Invariants:
    * A function is named by its module and qualified name, and a digest of
      its code: bytecode, names, constants (nested code objects by their own
      digest), defaults and the values its closure captured, each where it
      is plain data (numbers, strings, and lists, tuples, dicts and sets of
      them); anything else by its type's name, never by ``repr`` (addresses
      differ between processes).
    * A ``functools.partial`` is its function's identity with the arguments
      bound, by the same rule.
    * Behaviour read from globals or from captured objects that are not plain
      data is not named (two such functions with one name share a key).
"""

from __future__ import annotations

import functools
import hashlib
import json
import types
from typing import Any


def callable_identity(value: Any) -> Any:
    """``value``'s identity as JSON-able data (module invariants)."""
    if isinstance(value, functools.partial):
        return {"partial": callable_identity(value.func), "args": _data(list(value.args)),
                "keywords": _data(dict(value.keywords))}
    name = _qualified_name(value)
    code = getattr(value, "__code__", None)
    if not isinstance(code, types.CodeType):
        return name
    digest = hashlib.blake2b(_code_digest(code).encode(), digest_size=16)
    captured = [cell.cell_contents for cell in getattr(value, "__closure__", None) or ()]
    for part in (getattr(value, "__defaults__", None), getattr(value, "__kwdefaults__", None), captured):
        digest.update(json.dumps(_data(part), sort_keys=True).encode())
    return {"function": name, "code": digest.hexdigest()}


def _code_digest(code: types.CodeType) -> str:
    digest = hashlib.blake2b(code.co_code, digest_size=16)
    digest.update(json.dumps([list(code.co_names), [_code_digest(c) if isinstance(c, types.CodeType) else _data(c)
                                                    for c in code.co_consts]]).encode())
    return digest.hexdigest()


def _data(value: Any) -> Any:
    """Plain data as it is; other objects by their type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _data(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_data(v) for v in value), key=repr)
    if callable(value):  # by name only: a function capturing itself would recurse
        return _qualified_name(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _qualified_name(value: Any) -> str:
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
