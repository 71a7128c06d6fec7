"""One open :class:`ucm_db.Store` per store path per process.

vLLM may run the scheduler-side and worker-side connectors in one process
(uni-process executor), and an LMDB environment can be open only once per
process: both halves therefore share one handle, reference-counted here.

Invariants:
    * ``acquire`` and ``release`` pair up; the store closes on the last
      release, after every holder's writes were handed to it.
    * Handles are keyed by resolved path and process id, so a forked child
      never reuses its parent's handle.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import ucm_db
from ucm_db.connector.settings import ConnectorSettings

_lock = threading.Lock()
_handles: dict[tuple[int, Path], list] = {}  # key -> [store, refcount]


def acquire(settings: ConnectorSettings) -> ucm_db.Store:
    """The process's store at ``settings.path`` (opened on first use)."""
    key = (os.getpid(), settings.path.expanduser().resolve())
    with _lock:
        entry = _handles.get(key)
        if entry is None:
            entry = [ucm_db.open(settings.path, **settings.store_options), 0]
            _handles[key] = entry
        entry[1] += 1
        return entry[0]


def release(store: ucm_db.Store) -> None:
    """Drops one reference; closes the store with the last one."""
    with _lock:
        for key, entry in list(_handles.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _handles[key]
                    store.close()
                return
