"""ucm-db: an embedded, crash-safe KV-cache block store for LLM inference.

Public API: :func:`open`, :class:`Store`, :class:`Namespace`, the config and
error types. Everything else is internal.
"""

from ucm_db.config import StoreConfig, load_config_file
from ucm_db.errors import (
    ClosedError,
    ConfigError,
    CorruptBlockError,
    FormatVersionError,
    LockedError,
    MigrationError,
    MissingAncestorError,
    StoreFullError,
    TierError,
    UcmDbError,
)
from ucm_db.codec import Framed
from ucm_db.events import BlockEventFields, ChangeBatch, ChangeRecord, EventInventory
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.store import STORE_FORMAT_VERSION, NamespaceStats, Store, StoreStats, open
from ucm_db.tiers.local import PutResult

from ucm_db.version import __version__

__all__ = [
    "STORE_FORMAT_VERSION", "BlockEventFields", "BlockKeys", "ChangeBatch", "ChangeRecord", "ClosedError", "ConfigError", "CorruptBlockError", "EventInventory", "FormatVersionError", "Framed",
    "LockedError", "MigrationError", "MissingAncestorError", "Namespace", "NamespaceStats", "PutResult",
    "Store", "StoreConfig", "StoreFullError", "StoreStats", "TierError", "UcmDbError", "load_config_file", "open",
]
