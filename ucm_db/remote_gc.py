"""Garbage collection of a remote tier (layout of :mod:`ucm_db.tiers.remote`).

Objects are chosen oldest first (by the remote's modification time): all
older than ``--older-than``, and/or as many as needed to bring the total
under ``--max-bytes``. Then, to keep the remote's prefix invariant (a
stored block's ancestors are stored), every surviving object whose parent
chain reaches a removed object is removed too; the parent links come from
each survivor's verified envelope (one small ranged read per object).
Temp files of crashed uploads older than an hour are removed as well.

A parent that is simply absent from the listing is not a removal: the
write-back uploader sends a queue in key order, so a chain's deeper
blocks often land before their ancestors, which are on their way. Only
an object whose parent has been missing for longer than
:data:`ORPHAN_GRACE_S` (its own age) is taken for an orphan and removed
with its descendants.

Invariants:
    * Safe beside live servers: objects are immutable, and a deleted object
      is a miss for a reader, never wrong bytes.
    * Terminates on any remote: objects whose parent links form a cycle (no
      chain root) are treated as broken and removed with the victims.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from dataclasses import dataclass
from typing import Any

from ucm_db.errors import CorruptBlockError
from ucm_db.tiers.remote import MANIFEST_NAME, PROBE_BYTES, TEMP_PREFIX, RemoteRoot, parse_envelope

TEMP_MAX_AGE_S = 3600.0
#: An object whose parent is absent this long (by its own age) is an orphan.
ORPHAN_GRACE_S = 3600.0


@dataclass
class RemoteObjectInfo:
    path: str
    key: bytes
    size_bytes: int
    mtime_s: float


def _mtime_s(info: dict[str, Any]) -> float:
    for name in ("mtime", "LastModified", "last_modified", "created", "updated"):
        value = info.get(name)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def list_objects(root: RemoteRoot) -> tuple[list[RemoteObjectInfo], list[tuple[str, float]]]:
    """Block objects and temp files under the root."""
    try:
        found = root.fs.find(root.root, detail=True)
    except FileNotFoundError:
        return [], []
    objects, temps = [], []
    for path, info in found.items():
        name = os.path.basename(str(path))
        if name.startswith(TEMP_PREFIX):
            temps.append((str(path), _mtime_s(info)))
        elif len(name) == 64 and name != MANIFEST_NAME:
            try:
                key = bytes.fromhex(name)
            except ValueError:
                continue
            objects.append(RemoteObjectInfo(str(path), key, int(info.get("size", 0)), _mtime_s(info)))
    return objects, temps


def choose_victims(objects: list[RemoteObjectInfo], *, older_than_s: float | None, max_bytes: int | None, now_s: float) -> set[str]:
    """Paths to delete by age and/or size, oldest first."""
    ordered = sorted(objects, key=lambda o: (o.mtime_s, o.path))
    victims: set[str] = set()
    if older_than_s is not None:
        victims |= {o.path for o in ordered if now_s - o.mtime_s > older_than_s}
    if max_bytes is not None:
        remaining = sum(o.size_bytes for o in ordered if o.path not in victims)
        for o in ordered:
            if remaining <= max_bytes:
                break
            if o.path not in victims:
                victims.add(o.path)
                remaining -= o.size_bytes
    return victims


def orphaned_descendants(
    root: RemoteRoot, objects: list[RemoteObjectInfo], victims: set[str], *, now_s: float | None = None,
) -> set[str]:
    """Survivors whose parent chain reaches a victim, an unreadable object,
    a parent cycle, or a parent absent for longer than :data:`ORPHAN_GRACE_S`."""
    now_s = time.time() if now_s is None else now_s
    by_key = {o.key: o for o in objects}
    parent_of: dict[bytes, bytes | None] = {}
    for o in objects:
        if o.path in victims:
            continue
        try:
            data = root.read_range(o.path, 0, PROBE_BYTES)  # None: gone, or not a regular file (never opened)
            if data is None:
                raise FileNotFoundError(o.path)
            parent_of[o.key], _ns = parse_envelope(data, o.key)
        except (FileNotFoundError, CorruptBlockError):
            parent_of[o.key] = o.key  # unreadable: treated as broken, removed
    doomed = {o.key for o in objects if o.path in victims}
    status: dict[bytes, bool] = {}

    def broken(start: bytes) -> bool:
        chain: list[bytes] = []
        on_chain: set[bytes] = set()
        key = start
        while True:
            if key in status:
                result = status[key]
                break
            if key in on_chain:  # a parent cycle: no root to hold it up
                result = True
                break
            if key not in parent_of and key not in doomed:
                # Absent: on its way (a young child) or gone for good (an old
                # one); a child of unknown age (no mtime listed) counts as young.
                child_mtime_s = by_key[chain[-1]].mtime_s
                result = child_mtime_s > 0 and now_s - child_mtime_s > ORPHAN_GRACE_S
                break
            if key in doomed or parent_of[key] == key:
                result = True
                break
            parent = parent_of[key]
            chain.append(key)
            on_chain.add(key)
            if parent is None:
                result = False
                break
            key = parent
        for k in chain:
            status[k] = result
        return result

    return {by_key[k].path for k in parent_of if broken(k)}


def gc(root: RemoteRoot, *, older_than_s: float | None, max_bytes: int | None, dry_run: bool, now_s: float | None = None) -> dict[str, Any]:
    """Runs the collection (see module docstring); returns the report."""
    now_s = time.time() if now_s is None else now_s
    objects, temps = list_objects(root)
    victims = choose_victims(objects, older_than_s=older_than_s, max_bytes=max_bytes, now_s=now_s)
    cascade = orphaned_descendants(root, objects, victims, now_s=now_s) if victims else set()
    stale_temps = [p for p, m in temps if now_s - m > TEMP_MAX_AGE_S]
    doomed = sorted(victims | cascade)
    sizes = {o.path: o.size_bytes for o in objects}
    if not dry_run:
        for path in doomed + stale_temps:
            try:
                root.fs.rm_file(path)
            except FileNotFoundError:
                pass
    total = sum(sizes.values())
    freed = sum(sizes[p] for p in doomed)
    return {
        "objects_before": len(objects), "bytes_before": total, "removed_objects": len(doomed),
        "removed_by_rule": len(victims), "removed_descendants": len(cascade), "removed_bytes": freed,
        "bytes_after": total - freed, "temp_files_removed": len(stale_temps), "dry_run": dry_run,
    }
