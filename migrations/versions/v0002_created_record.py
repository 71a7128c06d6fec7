"""Format 2: the store records which ucm-db created it (``info/created``).

Stores created at format 2 or later get the record at creation
(:func:`ucm_db.format.creation_record`); this migration gives older stores
one saying that their creator is unknown, so every store at format 2 has it
and tools can rely on its presence. Blocks, metadata and accounting are
unchanged.
"""

from __future__ import annotations

import json

from ucm_db.migrations import Migration
from ucm_db.format import CREATED_KEY
from ucm_db.engines.base import Txn


def upgrade(txn: Txn) -> None:
    if txn.get("info", CREATED_KEY) is not None:
        return
    record = {"ucm_db_version": None, "created_ns": None, "format_version": 1, "note": "created before format 2; creator unknown"}
    txn.put("info", CREATED_KEY, json.dumps(record, sort_keys=True).encode())


MIGRATION = Migration(
    version=2,
    name="created_record",
    description="record which ucm-db version created the store (info/created)",
    upgrade=upgrade,
)
