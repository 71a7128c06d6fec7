"""The namespace guard of the block index: a chain never spans namespaces.

The block index is keyed by the block key alone; a block's metadata records
its namespace id (:class:`~ucm_db.index.entries.BlockMeta`, first 16
bytes). Keys are seeded by their namespace's digest, so two namespaces
meet on one key only when a caller passes keys built for another namespace.
Such a put is refused (:class:`ForeignNamespaceError`), whether the key
itself or the parent it continues is stored under the other namespace.

Invariants:
    * Every stored block's parent is stored under the block's own
      namespace: a chain's namespace is its first block's. So a namespace's
      presence along a chain is monotone (lookup's binary search holds) and
      a delete's cascade over descendants never leaves its namespace.
    * The check costs one 16-byte comparison per metadata record the put
      reads anyway (presence, parent depth); the descriptions in the error
      message are read only when it is raised.
"""

from __future__ import annotations

from typing import Any

from ucm_db.errors import ConfigError
from ucm_db.index import records
from ucm_db.index.accounting import NS_DESC_PREFIX, parse_description
from ucm_db.engines.base import Buffer, Txn
from ucm_db.index.entries import BlockMeta, DamagedMeta

NAMESPACE_ID_BYTES = 16


class ForeignNamespaceError(ConfigError):
    """A put names a block (or a parent) stored under another namespace."""

    default_hint = (
        "the keys were built for another namespace: build them with this namespace's "
        "Namespace.block_keys (or put them under the namespace they were built for)"
    )


def in_namespace(meta: Buffer, namespace_id: bytes) -> bool:
    """Whether a block's ``meta`` record names ``namespace_id``."""
    return bytes(meta[:NAMESPACE_ID_BYTES]) == namespace_id


def is_foreign(meta: Buffer, namespace_id: bytes) -> bool:
    """Whether ``meta`` is a whole record of another namespace's block: a
    damaged one (wrong length, impossible sizes) is damage, left to the
    quarantine (:mod:`ucm_db.index.damage`), never read as a namespace.
    Unpacks only a record whose first 16 bytes differ (the rare path)."""
    if in_namespace(meta, namespace_id):
        return False
    try:
        BlockMeta.unpack(meta)
    except DamagedMeta:
        return False
    return True


def require_same(
    txn: Txn, meta: Buffer, namespace_id: bytes, key: bytes, role: str, *, description: bytes | None = None,
) -> None:
    """Raises :class:`ForeignNamespaceError` unless the stored block
    ``key`` (its ``meta`` record) belongs to ``namespace_id``.

    Args:
        role: what ``key`` is to the put, e.g. ``"block"`` or ``"parent"``.
        description: the JSON description of ``namespace_id`` if the
            caller has it (a namespace's first put has not recorded it yet).
    """
    if in_namespace(meta, namespace_id):
        return
    stored_id = bytes(meta[:NAMESPACE_ID_BYTES])
    wanted = parse_description(description) if description is not None else describe(txn, namespace_id)
    stored = describe(txn, stored_id)
    differ = sorted(k for k in set(wanted) | set(stored) if wanted.get(k) != stored.get(k)) if wanted and stored else []
    detail = ", ".join(f"{k}: {wanted.get(k)!r} vs {stored.get(k)!r}" for k in differ if k != "damaged")
    raise ForeignNamespaceError(
        f"put into namespace {namespace_id.hex()} {_summary(wanted)} refused: its {role} {key.hex()[:16]} is stored "
        f"under namespace {stored_id.hex()} {_summary(stored)}" + (f" (they differ in {detail})" if detail else "")
        + "; nothing was stored"
    )


def require_tree_in_namespace(txn: Txn, key: bytes, namespace_id: bytes) -> None:
    """Raises :class:`ForeignNamespaceError` if a descendant of ``key`` is
    stored under another namespace than ``namespace_id``: a delete's
    cascade then would cross namespaces. Only a store written before puts
    were guarded can hold such a chain; the delete is refused whole."""
    stack = [key]
    while stack:
        current = stack.pop()
        for child, _ in txn.scan("children", current):
            child_key = bytes(child[len(current):])
            meta = txn.get("meta", child_key)
            if meta is not None and is_foreign(meta, namespace_id):
                stored_id = bytes(meta[:NAMESPACE_ID_BYTES])
                raise ForeignNamespaceError(
                    f"delete of block {key.hex()[:16]} from namespace {namespace_id.hex()} refused: its descendant "
                    f"{child_key.hex()[:16]} is stored under namespace {stored_id.hex()} "
                    f"{_summary(describe(txn, stored_id))} (a chain written before ucm-db refused such puts); "
                    "nothing was deleted",
                    hint="delete the other namespace's blocks first (store.delete(Namespace.from_dict(<its description "
                    "in `ucm-db inspect`>), keys)), or `ucm-db evict-to` / move the store aside",
                )
            stack.append(child_key)


def describe(txn: Txn, namespace_id: bytes) -> dict[str, Any]:
    """The recorded description of ``namespace_id`` ({} if none is recorded)."""
    try:
        value = records.get_checked(txn, NS_DESC_PREFIX + namespace_id)
    except records.DamagedRecord:
        return {"damaged": "checksum mismatch"}
    return {} if value is None else parse_description(value)


def _summary(description: dict[str, Any]) -> str:
    if "model" not in description:
        return "(not described)"
    return f"(model {description['model']!r})"
