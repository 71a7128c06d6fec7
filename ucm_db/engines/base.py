"""Tier and engine interfaces.

Two levels live here:

* :class:`Tier` is the block-level interface every tier offers (local or
  remote): batch get, exists, delete, iterate, capabilities (each tier puts
  through its own method, which knows parents and namespaces). A miss
  is ``None``, never an exception.
* :class:`Engine` is the transactional table store a *local* tier is built
  on (LMDB, RocksDB, memory). It knows nothing of blocks: it runs a function
  inside a read or write transaction over named tables of sorted bytes keys.

Invariants:
    * ``Engine.write(fn)`` is atomic: either every change ``fn`` made is
      committed or none is (an exception aborts). ``fn`` may be re-run after
      the engine grows its map, so it must not have side effects outside the
      transaction.
    * Buffers returned by ``Txn.get``/``Txn.scan`` are valid only inside the
      transaction; copy them out before returning.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from ucm_db.buffers import Buffer

T = TypeVar("T")

#: Tables every local engine provides.
TABLES = ("blocks", "heads", "meta", "lru", "children", "info", "quarantine", "uploads", "migrations")
#: The table of the store's info records (its format version and settings among them): every ucm-db store has it.
INFO = "info"
NEVER_INITIALISED_HINT = "open it once without read_only (that completes it; nothing was stored in it), or check the path"


def never_initialised(store: object) -> str:
    """The message for a store whose creating open stopped before it recorded its format (read-only opens refuse it)."""
    return (f"the store at {store} was never initialised: it records no format version (the open that created it "
            "stopped early: a full disk, a killed process)")


@dataclass(frozen=True, slots=True)
class TierCapabilities:
    """What a tier can promise.

    Attributes:
        persistent: survives a process restart.
        transactional: a batch put is atomic.
        multi_process: several processes may open it at once.
        sorted_iteration: iterate() yields keys in byte order.
    """

    persistent: bool
    transactional: bool
    multi_process: bool
    sorted_iteration: bool


class Tier(ABC):
    """Block-level tier: keys are 32-byte block keys, values encoded blobs."""

    @property
    @abstractmethod
    def capabilities(self) -> TierCapabilities: ...

    @abstractmethod
    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Encoded blobs of ``keys``; ``None`` for a miss."""

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Deletes keys; returns how many were present."""

    @abstractmethod
    def iterate(self) -> Iterator[bytes]:
        """Yields every stored key."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources."""


class Txn(Protocol):
    """One transaction over an engine's tables."""

    def get(self, table: str, key: bytes) -> Buffer | None: ...

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[Buffer | None]:
        """``[get(table, key) for key in keys]``, with less Python per key
        where the engine allows (a batch's reads on the load path)."""
        ...

    def put(self, table: str, key: bytes, value: Buffer) -> None: ...

    def delete(self, table: str, key: bytes) -> bool: ...

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Buffer]]:
        """Yields ``(key, value)`` in key order for keys starting with prefix."""
        ...


class Engine(ABC):
    """A transactional store of named tables (see module invariants)."""

    name: str = ""
    multi_process: bool = False
    persistent: bool = True

    @abstractmethod
    def read(self, fn: Callable[[Txn], T]) -> T: ...

    @abstractmethod
    def write(self, fn: Callable[[Txn], T]) -> T: ...

    @abstractmethod
    def sync(self) -> None:
        """Makes every committed transaction durable."""

    def sync_round(self) -> bool:
        """A background round's sync (group durability): as :meth:`sync`,
        except that what cannot be made durable against an OS crash now
        may be left to a later round instead of raising; returns False
        then (the store counts it as a failed sync)."""
        self.sync()
        return True

    @abstractmethod
    def close(self) -> None: ...

    def file_bytes(self) -> int:
        """Bytes the engine's files take on disk (0 if not on disk)."""
        return 0

    def free_page_bytes(self) -> int | None:
        """Bytes of the data file's pages that hold nothing now (reusable
        free space), or None where the engine has no such figure."""
        return None

    def used_extent_bytes(self) -> int | None:
        """How far into its data file the engine's pages reach now (its high
        water mark), or None where the engine has no such figure. Cheap
        enough to ask after every commit."""
        return None


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on ``path``'s file system; None if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(path: str | Path) -> int:
    """Bytes of every file under ``path`` (one removed meanwhile by a
    compaction or a writer's deletion counts 0)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
