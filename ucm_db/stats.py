"""Snapshots of a store's counters, as :meth:`ucm_db.Store.stats` returns
them, and what a pin or unpin did (:meth:`ucm_db.Store.pin`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    description: dict[str, Any]
    blocks: int
    raw_bytes: int
    stored_bytes: int
    last_use_ns: int
    #: Blocks pinned (:meth:`ucm_db.Store.pin`) and their stored bytes.
    pinned_blocks: int = 0
    pinned_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PinReport:
    """What :meth:`ucm_db.Store.pin` or :meth:`~ucm_db.Store.unpin` did.

    Attributes:
        chains: per chain given, its leading blocks pinned after the call
            (pin: its stored prefix; unpin: what pins on other chains still
            hold, usually 0).
        changed_blocks: blocks that became pinned (pin) or stopped being
            pinned (unpin); changed_bytes: their stored bytes.
        namespace_blocks, namespace_bytes: the namespace's pinned blocks
            and stored bytes after the call.
        store_bytes: pinned stored bytes of every namespace after the call.
        max_pinned_bytes: the cap the call ran under.
    """

    chains: tuple[int, ...]
    changed_blocks: int
    changed_bytes: int
    namespace_blocks: int
    namespace_bytes: int
    store_bytes: int
    max_pinned_bytes: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["chains"] = list(self.chains)
        return out


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters (committed state plus this
    process's not yet flushed hits and misses). Known limit: hits and
    misses a flush is writing at that moment are in neither, so those two
    may read low (never high) for one call; the next call counts them."""

    path: str
    engine: str
    format_version: int
    settings: dict[str, Any]
    capacity_bytes: int
    blocks: int
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    hits: int
    misses: int
    evictions: int
    quarantined: int
    pending_uploads: int
    maintenance_errors: int = 0
    #: Stored bytes pinned in all namespaces, and the cap on them.
    pinned_bytes: int = 0
    max_pinned_bytes: int = 0
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compression_ratio"] = self.compression_ratio
        return out
