"""ucm-db: an embedded, crash-safe KV-cache block store for LLM inference.

Public API: the names in ``__all__`` (:func:`open`, :class:`Store`,
:class:`Namespace`, the config, event and error types) and the modules in
:data:`PUBLIC_MODULES`. Everything else is internal: the connector and the
CLI use nothing else (``tests/test_layering.py`` checks it, and
``docs/architecture.md`` lists the same modules).
"""

from ucm_db.config import StoreConfig
from ucm_db.config.file import load_config_file
from ucm_db.errors import (
    ClosedError,
    CommitProcessError,
    ConfigError,
    CorruptBlockError,
    DamagedPageError,
    DamagedRecordError,
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
from ucm_db.codec.slabs import ScatterSlabs
from ucm_db.store import STORE_FORMAT_VERSION, NamespaceStats, Store, StoreStats, open
from ucm_db.index.local import PutResult
from ucm_db.store.provisional import ProvisionalOwner

from ucm_db.version import __version__

#: The public modules besides this one (``ucm_db.migrations`` with every
#: submodule; ``ucm_db.components`` is the door for measuring code).
PUBLIC_MODULES = (
    "ucm_db.errors", "ucm_db.events", "ucm_db.keys", "ucm_db.keys.units", "ucm_db.config", "ucm_db.maintenance",
    "ucm_db.cpu_placement", "ucm_db.components", "ucm_db.migrations", "ucm_db.committer",
)

__all__ = [
    "STORE_FORMAT_VERSION", "BlockEventFields", "BlockKeys", "ChangeBatch", "ChangeRecord", "ClosedError", "CommitProcessError", "ConfigError", "CorruptBlockError", "DamagedPageError", "DamagedRecordError", "EventInventory", "FormatVersionError", "Framed",
    "LockedError", "MigrationError", "MissingAncestorError", "Namespace", "NamespaceStats", "ProvisionalOwner", "PutResult",
    "ScatterSlabs", "Store", "StoreConfig", "StoreFullError", "StoreStats", "TierError", "UcmDbError", "load_config_file", "open",
]
