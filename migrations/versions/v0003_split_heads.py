"""Format 3: block heads live in their own table (``heads``).

From format 3 the ``blocks`` table holds a block's body and ``heads`` its
head (header + frame table), so a put hands an uncompressed payload to the
engine as the caller's buffer instead of first copying it behind a header.
This migration gives every block of an older store its ``heads`` entry, a
copy of the head at the front of its ``blocks`` value. The ``blocks`` values
stay as they are (head and body joined); readers find the body after the
head (:func:`ucm_db.index.local.body_of`), so no payload is rewritten and the
migration writes about 100 bytes per block, in one transaction.

A block whose head cannot be parsed gets no ``heads`` entry; reads then find
it corrupt and quarantine it, as they would have before.
"""

from __future__ import annotations

from ucm_db import codec
from ucm_db.errors import CorruptBlockError
from ucm_db.migrations import Migration
from ucm_db.engines.base import Txn


def upgrade(txn: Txn) -> None:
    heads: list[tuple[bytes, bytes]] = []
    for key, blob in txn.scan("blocks"):
        if txn.get("heads", key) is not None:
            continue
        try:
            head, _body = codec.split(blob)
        except CorruptBlockError:
            continue
        heads.append((key, bytes(head)))
    for key, head in heads:
        txn.put("heads", key, head)


MIGRATION = Migration(
    version=3,
    name="split_heads",
    description="keep each block's head in its own table (heads), so puts store payloads without a copy",
    upgrade=upgrade,
)
