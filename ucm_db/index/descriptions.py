"""Namespace description records (``info/nsdesc:<id>``, checksummed,
:mod:`ucm_db.index.records`): their repair, and the placeholder a repair
leaves where a description cannot be rebuilt.

A description says what a namespace is (model, dtypes, layout: its
:meth:`~ucm_db.keys.Namespace.description_json`), and its presence is how
the store knows it holds the namespace (:func:`ucm_db.store.epochs.held`):
a sealed store reads a lost epoch record as unknown, never served, only
while it is there. A review found ``verify --fix`` deleting damaged ones:
the lost epoch then read as 0 and the KV of before an invalidation was
served again. So a damaged description is never deleted (:func:`repair`):

* one whose JSON still rebuilds the namespace it is filed under
  (:meth:`Namespace.from_dict <ucm_db.keys.Namespace.from_dict>` hashes to
  its id: only its checksum sidecar was damaged, say) is resealed as it is;
* any other is replaced by :data:`PLACEHOLDER`, a whole record naming no
  namespace. Readers of descriptions take the namespace as undescribed
  (:meth:`IndexReader.namespace_descriptions
  <ucm_db.index.reads.IndexReader.namespace_descriptions>` leaves it out),
  and the namespace's next put or promotion writes its description over it
  (:func:`needs_writing`).

Invariants:
    * An ``nsdesc:`` record, once written, stays: a description or the
      placeholder. The store never forgets a namespace it held.
    * :func:`repair` judges each record inside its write transaction and
      changes only those :func:`~ucm_db.index.accounting.damaged_records`
      reports.
"""

from __future__ import annotations

import json

from ucm_db.engines.base import Buffer, Txn
from ucm_db.index import records
from ucm_db.index.accounting import NS_DESC_PREFIX, parse_description
from ucm_db.keys import Namespace

INFO = "info"
#: What a damaged description that does not rebuild its namespace becomes.
PLACEHOLDER = json.dumps({"placeholder": (
    "this namespace's description was damaged and could not be rebuilt (ucm-db verify --fix); "
    "its next put or promotion records it again")}, sort_keys=True).encode()


def is_placeholder(value: Buffer | None) -> bool:
    """Whether a description record's value is :data:`PLACEHOLDER` (a length
    and a comparison: a put asks once per batch)."""
    return value is not None and len(value) == len(PLACEHOLDER) and bytes(value) == PLACEHOLDER


def needs_writing(txn: Txn, namespace_id: bytes) -> bool:
    """Whether a put or promotion of ``namespace_id`` writes its description:
    none is recorded, or the placeholder is."""
    value = txn.get(INFO, NS_DESC_PREFIX + namespace_id)
    return value is None or is_placeholder(value)


def rebuilds(namespace_id: bytes, value: Buffer) -> bool:
    """Whether ``value`` is a description of the namespace ``namespace_id``
    (its id is a digest of the description, so this needs no checksum)."""
    try:
        return Namespace.from_dict(json.loads(bytes(value))).id == namespace_id
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):  # ConfigError is a ValueError
        return False


def repair(txn: Txn) -> tuple[int, int]:
    """Reseals every damaged description that rebuilds its namespace and
    replaces every other damaged one by :data:`PLACEHOLDER` (module
    docstring); returns (resealed, replaced)."""
    damaged = [name for name, value in records.scan_checked(txn, NS_DESC_PREFIX) if "damaged" in parse_description(value)]
    resealed = 0
    for name in damaged:
        value = bytes(txn.get(INFO, name) or b"")
        whole = rebuilds(name[len(NS_DESC_PREFIX):], value)
        records.put_checked(txn, name, value if whole else PLACEHOLDER)
        resealed += whole
    return resealed, len(damaged) - resealed
