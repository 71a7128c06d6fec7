"""Garbage collection of a remote tier (layout of :mod:`ucm_db.remote.tier`).

Objects are removed from the tails of their chains. Objects are immutable
and a hit never refreshes one, so the blocks of a shared prefix (a system
prompt) are always the oldest on the remote: ranked by its own upload time
(the remote's modification time), such a block would take every
conversation under it along (the cascade below), however young (an audit
saw a 5% ``--max-bytes`` trim empty a remote). So an object's age for the
rules is that of the youngest object in its subtree (itself and every
object whose parent chain reaches it): a shared block is old only when
nothing under it is young.

* ``--older-than``: every object whose subtree is older than that. This
  set holds every descendant of each of its objects, so it removes whole
  subtrees, never a young object's ancestor.
* ``--max-bytes``: if the remote (less what the age rule and the cascade
  remove) holds more, leaves are removed, oldest first (a leaf's parent
  becomes a leaf in turn, with its own age), until it holds at most that
  much: no more than needed, and a shared block only after everything
  under it.
* An object whose listing states no time gc reads counts as young for both
  (:func:`age_time_s`): never old by age, taken last by size.

Then, to keep the remote's prefix invariant (a stored block's ancestors are
stored), every surviving object whose parent chain reaches a removed, broken
or cyclic object, or a long-absent parent (below), is removed too: the
cascade, counted against ``--max-bytes``. The parent links come from each
object's verified envelope (one small ranged read per object). Objects are
deleted children first, so a gc stopped midway (killed, a remote failing)
leaves no object whose parent it removed. Temp files of crashed uploads
older than an hour are removed as well, and retractions' tombstones
(:mod:`ucm_db.remote.tombstones`) once they are
:data:`~ucm_db.remote.tombstones.TOMBSTONE_MAX_AGE_S` old (a week), whatever
the rules: no object depends on them, and they must outlive any node's
local copy of a retracted block as long as is reasonable.

Only what ucm-db wrote is ever touched (:func:`~ucm_db.remote.gc_listing.list_objects`): paths of its
own layout, ``ROOT/<namespace short id: 16 hex>/<key[0]: 2 hex>/<key: 64 hex>``
(temp files: ``ROOT/<namespace short id>/[<key[0]>/].tmp-*``), under a namespace
directory whose ``manifest.json`` is ucm-db's (names that namespace id),
and, for an object, whose first bytes are a ucm-db object's (the envelope's
magic; one ranged read of the head per object). Anything else under the
root (another application's files, even named by 64 hex digits; a FIFO or
link in an object's place) is left alone and counted in ``skipped_entries``.

A parent absent from the listing is looked for where it belongs first
(:func:`~ucm_db.remote.gc_listing.landed_parents`, counted in
``landed_after_listing``): a listing is no snapshot, and a parent that
landed after it passed its path is read then, so the youth of what hangs
under it is carried up its chain like any other. A parent still absent is
not a removal either: it may be on its way. Only an object whose parent
has been missing for longer than :data:`ORPHAN_GRACE_S` (its own age) is
taken for an orphan and removed with its descendants. A younger one is
uploading, and its youth cannot be carried up past the absent parent: an
object names only its parent, so any object of its namespace may be its
ancestor (an old one, or a "leaf" whose child is in flight). So the rules
remove nothing in such a namespace this run: they choose as if nothing
were held, and their choices there wait (``held_*`` in the report): the
other namespaces lose no more for it.

An object whose head gc cannot read, twice (an archived object: S3
GLACIER refuses GetObject; a refused read; a flaky link:
:mod:`~ucm_db.remote.gc_listing`), has an unknown parent: it is present, so
its children are never orphans, but any object of its namespace may be its
ancestor. It is never removed (nor taken for broken: its bytes are
unknown), so the size rule steps over it to the next tails, its bytes
never counted as freed (a lifecycle rule archives the *oldest* objects,
reached first: counted as freed, they made ``--max-bytes`` remove nothing);
a target left unmet says why (``max_bytes_shortfall_*``). If the rules
reach it, with its whole subtree (the age rule found everything under it
old; the size rule stepped over it after its descendants), its ancestors
may go too: the rules wanted its chain gone, and it stays an orphan until
it can be read and collected. Otherwise its namespace is held like one
with an upload in flight (its youth cannot be carried up past the unknown
parent). It is reported (``unreadable``, ``unreadable_examples``,
``unreadable_hint``); the rest of the run goes on.

Why the hold stays namespace-wide: a node running a ucm-db older than the
uploaders' ancestor repair (:mod:`ucm_db.remote.ancestry`) sends its queue
in key order, so a chain's deeper blocks land before their ancestors, for
as long as its backlog lasts, and never uploads again an ancestor gc
removed meanwhile: only holding every possible ancestor keeps its chains
whole. A current node sends a block's ancestors in an earlier batch or the
same one (whose uploads run at once): its parents are absent only for a
moment, mostly found by the second look, so a busy namespace is no longer
held run after run. What gc cannot see it cannot hold: a continuation
still entirely in a node's queue. The old chain it continues may go; a
current node uploads that chain again from its local tier before the
continuation, an older one leaves the continuation an orphan.

Invariants:
    * Safe beside live servers: objects are immutable, and a deleted object
      is a miss for a reader, never wrong bytes.
    * An object whose head read fails (twice; an error other than "not
      found") is never taken for absent, which orphaned the live chains
      under it, nor removed: it stays, parent unknown, and its namespace
      loses nothing by rule unless the rules reach it and its whole subtree
      (:func:`plan_removals`); nor counted as freed. One such object stops
      no run; heads that all fail do (:mod:`~ucm_db.remote.gc_listing`).
    * Never a possible ancestor of an upload in flight: a rule removes
      nothing in a namespace with an object whose parent is absent for less
      than :data:`ORPHAN_GRACE_S` (or of unknown age).
    * A rule never leaves a descendant of what it removes behind: the age
      rule takes whole subtrees, the size rule leaves; the cascade
      (``removed_descendants``) is what no chain root holds up (broken,
      cyclic, orphaned objects and what hangs under them).
    * Terminates on any remote: objects whose parent links form a cycle (no
      chain root) are treated as broken and removed with the victims.
    * A file of the layout that starts like a ucm-db object but whose
      envelope fails its checksum is a broken object of ucm-db's: removed
      with the victims when there are any.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ucm_db.remote.gc_listing import (  # noqa: F401 - RemoteListing, list_objects re-exported
    RemoteListing, RemoteObjectInfo, landed_parents, list_objects, require_bucket, stale_tombstones,
)
from ucm_db.remote.files import remove_all
from ucm_db.remote.tier import RemoteRoot

TEMP_MAX_AGE_S = 3600.0
#: An object whose parent is absent this long (by its own age) is an orphan.
ORPHAN_GRACE_S = 3600.0


@dataclass
class Removals:
    """:func:`plan_removals`' paths (``held``: victims that wait), the
    namespaces held (``frozen``: of :func:`uploading_objects` or of an
    unreadable object's; ``blind``: of the latter), the unreadable
    objects (``unreadable``: paths, never removed) and the excess the size
    rule found nothing removable for (``short_bytes``: unreadable objects)."""

    victims: set[str]
    cascade: set[str]
    held: set[str]
    frozen: set[str]
    uploading: int
    blind: set[str] = field(default_factory=set)
    unreadable: list[str] = field(default_factory=list)
    short_bytes: int = 0


def subtree_youngest_mtimes(objects: list[RemoteObjectInfo]) -> dict[str, float]:
    """Each object's age for the rules, by path: the newest modification time
    in its subtree (itself and every object whose parent chain reaches it).

    Visits objects youngest first and carries each one's time up its parent
    chain until an ancestor already holds a time as young (which a younger
    descendant carried further up before): each link is walked about once,
    and a parent cycle ends the walk where it began."""
    by_key = {o.key: o for o in objects}
    youngest: dict[bytes, float] = {}
    for o in sorted(objects, key=age_time_s, reverse=True):
        key: bytes | None = o.key
        while key is not None and key in by_key and youngest.get(key, float("-inf")) < age_time_s(o):
            youngest[key] = age_time_s(o)
            holder = by_key[key]
            key = None if holder.broken else holder.parent
    return {o.path: youngest.get(o.key, age_time_s(o)) for o in objects}


def age_time_s(obj: RemoteObjectInfo) -> float:
    """The time the rules age ``obj`` by: its listed time, or +inf (young)
    where the listing stated none (an object of unknown age, and every
    ancestor of one, is never old: it counted as written in 1970, and
    ``--older-than`` removed every object of such a remote)."""
    return obj.mtime_s if obj.mtime_s > 0 else math.inf


def choose_victims(objects: list[RemoteObjectInfo], *, older_than_s: float | None, max_bytes: int | None,
                   now_s: float) -> tuple[set[str], set[str]]:
    """Paths to delete: (by the rules, the cascade); :func:`plan_removals`."""
    plan = plan_removals(objects, older_than_s=older_than_s, max_bytes=max_bytes, now_s=now_s)
    return plan.victims, plan.cascade


def uploading_objects(objects: list[RemoteObjectInfo], now_s: float) -> list[RemoteObjectInfo]:
    """Objects whose parent is absent for under :data:`ORPHAN_GRACE_S` (or of unknown age): on its way."""
    keys = {o.key for o in objects}
    return [o for o in objects if o.parent is not None and not o.broken and o.parent not in keys
            and not (o.mtime_s > 0 and now_s - o.mtime_s > ORPHAN_GRACE_S)]


def plan_removals(objects: list[RemoteObjectInfo], *, older_than_s: float | None, max_bytes: int | None,
                  now_s: float) -> Removals:
    """The rules' victims, less those in a namespace with an upload in
    flight or an unreadable object the rules keep (``held``), less the
    unreadable objects, and the cascade of :func:`orphaned_descendants`:
    both empty when no rule removes anything (broken objects and orphans
    then wait for a run that does, as they always have).

    The rules choose with an unreadable object as a chain root (its parent
    unknown); the size rule steps over it (never freed: ``short_bytes`` when
    nothing else is left), and it is never among the victims."""
    uploading = uploading_objects(objects, now_s)
    unreadable = {o.path for o in objects if o.read_error is not None}
    frozen = {o.namespace_dir for o in uploading}
    victims: set[str] = set()
    reached: set[str] = set()  # unreadable objects the rules would remove (with everything under them)
    short_bytes = 0
    if older_than_s is not None:
        victims = {path for path, mtime_s in subtree_youngest_mtimes(objects).items() if now_s - mtime_s > older_than_s}
    total_bytes = sum(o.size_bytes for o in objects)
    if max_bytes is not None and (victims or total_bytes > max_bytes):
        gone = victims | orphaned_descendants(objects, victims, now_s=now_s)
        excess_bytes = total_bytes - sum(o.size_bytes for o in objects if o.path in gone - unreadable) - max_bytes
        if excess_bytes > 0:
            tails, reached, short_bytes = oldest_tails(objects, gone, excess_bytes)
            victims |= tails
    reached |= victims & unreadable
    victims -= unreadable
    # An unreadable object the rules keep may hang from any object of its namespace: hold them all.
    blind = {o.namespace_dir for o in objects if o.path in unreadable - reached}
    frozen |= blind
    # Chosen as if nothing were held, so a hold never makes the size rule take more elsewhere.
    held = {o.path for o in objects if o.path in victims and o.namespace_dir in frozen}
    victims -= held
    cascade = orphaned_descendants(objects, victims, now_s=now_s) if victims else set()
    return Removals(victims, cascade, held, frozen, len(uploading), blind, sorted(unreadable), short_bytes)


def oldest_tails(objects: list[RemoteObjectInfo], gone: set[str], excess_bytes: int) -> tuple[set[str], set[str], int]:
    """Leaves of the objects not in ``gone``, oldest first (a parent whose
    last child went is a leaf in turn), until they free ``excess_bytes``:
    (the leaves taken, the unreadable leaves stepped over, the excess left).

    An unreadable leaf is stepped over: never taken, its bytes never counted
    as freed (gc never removes it). The survivors of :func:`orphaned_descendants`
    form a forest (no broken object, no cycle, no removed parent), so removing
    a leaf orphans nothing and every survivor is reached: excess is left only
    where what is left is unreadable."""
    survivors = {o.key: o for o in objects if o.path not in gone}
    children = Counter(o.parent for o in survivors.values() if o.parent is not None and o.parent in survivors)
    leaves = [(age_time_s(o), o.path, o.key) for o in survivors.values() if children[o.key] == 0]
    heapq.heapify(leaves)
    chosen, passed = set[str](), set[str]()
    while excess_bytes > 0 and leaves:
        _, path, key = heapq.heappop(leaves)
        if survivors[key].read_error is not None:
            passed.add(path)
            continue
        chosen.add(path)
        excess_bytes -= survivors[key].size_bytes
        parent = survivors[key].parent
        if parent is not None and parent in survivors:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(leaves, (age_time_s(survivors[parent]), survivors[parent].path, parent))
    return chosen, passed, max(excess_bytes, 0)


def removal_order(objects: list[RemoteObjectInfo], doomed: set[str]) -> list[str]:
    """``doomed`` with every object before its parent (deepest first), so
    whatever a stopped gc removed, the objects left keep their parents."""
    by_key = {o.key: o for o in objects if o.path in doomed}
    depth: dict[bytes, int] = {}
    for start in by_key:
        chain: list[bytes] = []
        on_chain: set[bytes] = set()  # a parent cycle ends the walk
        key: bytes | None = start
        while key is not None and key in by_key and key not in depth and key not in on_chain:
            chain.append(key)
            on_chain.add(key)
            key = None if by_key[key].broken else by_key[key].parent
        below = depth.get(key, 0) if key is not None else 0
        for k in reversed(chain):
            below += 1
            depth[k] = below
    depth_by_path = {o.path: depth.get(o.key, 0) for o in objects if o.path in doomed}
    return sorted(doomed, key=lambda path: (-depth_by_path.get(path, 0), path))


def orphaned_descendants(objects: list[RemoteObjectInfo], victims: set[str], *, now_s: float | None = None) -> set[str]:
    """Survivors whose parent chain reaches a victim, a broken object, a
    parent cycle, or a parent absent for longer than :data:`ORPHAN_GRACE_S`
    (parents as :func:`list_objects` read them)."""
    now_s = time.time() if now_s is None else now_s
    by_key = {o.key: o for o in objects}
    parent_of: dict[bytes, bytes | None] = {}
    for o in objects:
        if o.path not in victims:
            parent_of[o.key] = o.key if o.broken else o.parent  # broken: its own parent, so removed
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
    listing = list_objects(root)
    if not (listing.objects or listing.temps or listing.tombstones or listing.skipped_entries):
        require_bucket(root)  # a mistyped bucket lists as an empty remote (exit 0, "0 objects", every run)
    landed = landed_parents(root, listing.objects, uploading_objects(listing.objects, now_s))
    objects = listing.objects + landed
    plan = plan_removals(objects, older_than_s=older_than_s, max_bytes=max_bytes, now_s=now_s)
    stale_temps = [p for p, m in listing.temps if now_s - m > TEMP_MAX_AGE_S]
    old_tombstones = stale_tombstones(root, listing.tombstones, now_s)
    doomed = removal_order(objects, plan.victims | plan.cascade)
    sizes = {o.path: o.size_bytes for o in objects}
    if not dry_run:
        remove_all(root.fs, doomed + stale_temps + old_tombstones)  # durable on a directory remote (files.py)
    total = sum(sizes.values())
    freed = sum(sizes[p] for p in doomed)
    return {
        "objects_before": len(objects), "bytes_before": total, "removed_objects": len(doomed),
        "removed_by_rule": len(plan.victims), "removed_descendants": len(plan.cascade), "removed_bytes": freed,
        "bytes_after": total - freed, "temp_files_removed": len(stale_temps), "skipped_entries": listing.skipped_entries,
        "landed_after_listing": len(landed), "tombstones": len(listing.tombstones),
        "tombstones_removed": len(old_tombstones),
        "held_by_rule": len(plan.held), "held_namespaces": len(plan.frozen), "held_reason": held_reason(plan), "dry_run": dry_run,
        "unreadable": len(plan.unreadable), "unreadable_examples": unreadable_examples(objects, plan),
        "unreadable_hint": UNREADABLE_HINT if plan.unreadable else None,
        "max_bytes_shortfall_bytes": None if max_bytes is None else max(total - freed - max_bytes, 0),
        "max_bytes_shortfall_reason": shortfall_reason(objects, plan, total - freed, max_bytes),
    }


#: What to do about objects whose head gc could not read (the CLI exits 1 with it).
UNREADABLE_HINT = ("gc kept them (their parents unknown) and did the rest; likely causes: an archive storage class "
                   "(S3 GLACIER/DEEP_ARCHIVE: restore them or exclude the prefix from the lifecycle rule), credentials "
                   "without read access to them, or a flaky link (run gc again)")


def unreadable_examples(objects: list[RemoteObjectInfo], plan: Removals, count: int = 3) -> list[str]:
    """The first ``count`` unreadable objects as ``"path: error"``."""
    errors = {o.path: o.read_error for o in objects if o.read_error is not None}
    return [f"{path}: {errors[path]}" for path in plan.unreadable[:count]]


def shortfall_reason(objects: list[RemoteObjectInfo], plan: Removals, bytes_after: int, max_bytes: int | None) -> str | None:
    """Why the remote still holds more than ``max_bytes`` after the run (None: it does not, or no size rule)."""
    if max_bytes is None or bytes_after <= max_bytes:
        return None
    why = [f"{len(plan.held)} objects held (see held_reason)"] if plan.held else []
    if plan.short_bytes:
        kept_bytes = sum(o.size_bytes for o in objects if o.read_error is not None)
        why.append(f"{len(plan.unreadable)} unreadable objects ({kept_bytes} bytes), which gc never removes, are all "
                   f"that is left for the size rule ({plan.short_bytes} bytes short)")
    return f"{bytes_after - max_bytes} bytes over --max-bytes after this run: {'; '.join(why) or 'no removable object left'}"


def held_reason(plan: Removals) -> str | None:
    """Why the rules removed nothing in ``plan.frozen`` (None: none held)."""
    if not plan.frozen:
        return None
    why = []
    if plan.uploading:
        why.append(f"{plan.uploading} objects have a parent absent for under {ORPHAN_GRACE_S / 60:.0f} min (still uploading): "
                   "rerun gc once the nodes' upload queues have drained")
    if plan.blind:
        why.append(f"{len(plan.blind)} namespaces hold an object gc cannot read (parent unknown) "
                   "that the rules keep")
    return (f"{'; '.join(why)}; any object of these {len(plan.frozen)} namespaces may be their ancestor: no rule "
            f"removes anything there this run ({len(plan.held)} objects wait)")
