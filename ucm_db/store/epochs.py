"""Namespace epochs: invalidating a model's blocks without deleting them.

A namespace's *epoch* is a number recorded in the store (the checked info
record ``epoch:<namespace id>``, 8 bytes little-endian, with its checksum
sidecar, :mod:`ucm_db.index.records`). Key chains are rooted at it
(:meth:`ucm_db.Namespace.block_keys` ``epoch=``), so moving it on
(:func:`bump`) makes every block stored before a miss for every process
that reads the epoch again: after a weight update, an engine's
``reset_cache``, or ``ucm-db invalidate``. Nothing is deleted: the old
blocks are never found again and leave the store through normal LRU
eviction (or ``compact``).

Invariants:
    * A namespace without a record is at epoch 0 (the keys ucm-db gave
      before epochs existed).
    * :func:`bump` reads and writes the record in one write transaction, so
      two bumps at once (two engines, an engine and the CLI) give two
      different epochs, and then makes it durable (``Engine.sync``) whatever
      the store's durability: a power cut after a bump returned never
      brings old KV back.
    * A damaged record (checksum or length) is never used as an epoch:
      :func:`read` raises :class:`~ucm_db.errors.TierError`, and :func:`bump`
      replaces it with a random epoch in ``[2**32, 2**63)``, far above any
      count a store reaches, so it differs from every epoch used before with
      overwhelming probability.
"""

from __future__ import annotations

import secrets

from ucm_db.errors import TierError
from ucm_db.index import records
from ucm_db.engines.base import Engine, Txn

#: Info record name prefix; the 16-byte namespace id follows.
EPOCH_PREFIX = b"epoch:"
_EPOCH_BYTES = 8
_NAMESPACE_ID_BYTES = 16


def _name(namespace_id: bytes) -> bytes:
    if len(namespace_id) != _NAMESPACE_ID_BYTES:
        raise ValueError(f"namespace id must be {_NAMESPACE_ID_BYTES} bytes, got {len(namespace_id)}")
    return EPOCH_PREFIX + bytes(namespace_id)


def _get(txn: Txn, namespace_id: bytes) -> int:
    """The recorded epoch (0 if none); raises DamagedRecord."""
    value = records.get_checked(txn, _name(namespace_id), size=_EPOCH_BYTES)
    return 0 if value is None else int.from_bytes(bytes(value), "little")


def read(engine: Engine, namespace_id: bytes) -> int:
    """The namespace's epoch: one read transaction (one LMDB lookup)."""
    try:
        return engine.read(lambda txn: _get(txn, namespace_id))
    except records.DamagedRecord as exc:
        raise TierError(
            f"the epoch record of namespace {namespace_id.hex()} is damaged ({exc.reason})",
            hint=f"run `ucm-db invalidate PATH --namespace {namespace_id.hex()}` to record a new epoch",
        ) from exc


def bump(engine: Engine, namespace_id: bytes) -> int:
    """Moves the namespace's epoch on; returns the new epoch (durable)."""
    def run(txn: Txn) -> int:
        try:
            epoch = _get(txn, namespace_id) + 1
        except records.DamagedRecord:
            epoch = (1 << 32) + secrets.randbelow((1 << 63) - (1 << 32))
        records.put_checked(txn, _name(namespace_id), epoch.to_bytes(_EPOCH_BYTES, "little"))
        return epoch

    epoch = engine.write(run)
    engine.sync()
    return epoch
