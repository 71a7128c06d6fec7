"""Checks of :meth:`ucm_db.keys.Namespace.block_keys`' arguments besides
the token ids: each returns the argument in the form the chain needs or
raises :class:`~ucm_db.errors.ConfigError` naming it and what it wants
(before, a str ``start``, a list as ``extras`` or mixed-type extra names
escaped as a TypeError from deep inside the chain)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from numbers import Integral
from typing import Any

from ucm_db.errors import ConfigError


def index_argument(name: str, value: Any) -> Any:
    """``start`` or ``stop`` as an int (None stays None for ``stop``), or a
    :class:`ConfigError` naming it: a str or float failed in a comparison."""
    if value is None and name == "stop":
        return None
    try:
        if isinstance(value, bool):
            raise TypeError(name)
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"block_keys: {name} must be an integer token index, got {type(value).__name__}",
                          hint=f"pass {name} as an int (a position in token_ids)") from None


def check_extras(extras: Any, block_extras: Any) -> None:
    """Refuses ``extras`` that is not a mapping of str names and
    ``block_extras`` that is not a mapping of int block indices (each was a
    TypeError from deep inside: sorting mixed keys, indexing a list)."""
    if extras is not None and (not isinstance(extras, Mapping) or not all(isinstance(k, str) for k in extras)):
        raise ConfigError(f"block_keys: extras must be a mapping of str names to values, got {_described(extras)}",
                          hint="pass e.g. extras={'cache_salt': salt} (None for no extras)")
    if block_extras is not None and (not isinstance(block_extras, Mapping) or not all(
            isinstance(k, Integral) and not isinstance(k, bool) for k in block_extras)):
        raise ConfigError(f"block_keys: block_extras must be a mapping of int block indices to bytes, got {_described(block_extras)}",
                          hint="pass e.g. block_extras={2: image_hash} (None for none)")


def _described(value: Any) -> str:
    if isinstance(value, Mapping):
        return "keys of type " + ", ".join(sorted({type(k).__name__ for k in value}))
    return f"a {type(value).__name__}"
