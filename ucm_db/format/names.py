"""The store format's constants: its version and the names in its info table.

A leaf: it imports nothing of ucm_db, so the tiers (which read and write
these records) and :mod:`ucm_db.format` (which opens the tiers' engines and
parses the records) share one definition without an import running up.
"""

from __future__ import annotations

#: On-disk format of the store's tables; migrations move stores between them.
STORE_FORMAT_VERSION = 3
#: Table holding the store's records about itself.
INFO_TABLE = "info"
FORMAT_VERSION_KEY = b"format_version"
#: JSON record of the code that created the store (format 2 on; see migrations).
CREATED_KEY = b"created"
#: JSON of the persisted settings (capacity, codec, durability, engine).
SETTINGS_KEY = b"settings"
#: Engines whose files live in a directory of their own name under the store.
ON_DISK_ENGINES = ("lmdb", "rocksdb")
#: Smallest LMDB map to ask for when opening an existing store (LMDB keeps a
#: store's larger recorded size).
MIN_MAP_BYTES = 1 << 20
