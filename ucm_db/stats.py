"""Snapshots of a store's counters, as :meth:`ucm_db.Store.stats` returns them."""

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


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters (committed state plus this
    process's not yet flushed hits and misses)."""

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
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compression_ratio"] = self.compression_ratio
        return out
