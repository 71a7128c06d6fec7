"""Tombstones: what a retraction leaves on the remote where it deletes a
block's object, so no node uploads that block again as a lost ancestor.

A retraction (:mod:`ucm_db.remote.retraction`) deletes the object of a
block whose KV was wrong. Another node may have promoted that block into
its local tier before the delete (a reader in the step before a void), and
:mod:`ucm_db.remote.ancestry` uploads again, from the local tier, a parent
it finds absent from the remote: gc'd (old) and retracted (wrong) look the
same, so that node re-published the wrong block to the whole fleet when it
uploaded a continuation of it. The tombstone tells them apart.

Layout: ``ROOT/<namespace short id>/<key[0] hex>/<key hex>.retracted``,
beside the object's path; a small JSON document naming the key, its
namespace id and the time of the retraction. It is not an object: the
remote tier's listings skip the name (:meth:`~ucm_db.remote.tier.RemoteTier.iterate`
takes 64 hex digits only), gc lists it apart and never counts it as a
skipped entry (:mod:`ucm_db.remote.gc_listing`).

Invariants:
    * Written before the object is deleted (a failed write leaves the
      retraction pending and the object in place): whenever a retraction
      has taken an object, its tombstone is there, for
      :data:`TOMBSTONE_MAX_AGE_S`.
    * Read only for a parent found absent (rare): one ranged read.
    * A tombstone is whole (written as one object) and only a document
      naming its own key counts (another application's file of that name
      does not).
    * gc removes a tombstone once it is :data:`TOMBSTONE_MAX_AGE_S` old
      (:func:`ucm_db.remote.gc.gc`), never sooner, whatever ``--older-than``.

Trust: a tombstone is not signed. One planted by whoever can write the
remote stops the re-upload of that block as an ancestor (its continuations
are then not uploaded either): availability only, which such a writer
takes anyway by deleting objects.
"""

from __future__ import annotations

import json

from ucm_db.remote.files import write_whole
from ucm_db.remote.tier import RemoteRoot

TOMBSTONE_SUFFIX = ".retracted"
#: How long a tombstone stays (gc removes it after). The harm it stops
#: needs only that another node still holds the retracted block in its
#: local tier (for as long as it is used) and continues it; a tombstone
#: is ~200 bytes, one per retracted block: kept a week, far past any
#: write-back backlog.
TOMBSTONE_MAX_AGE_S = 7 * 86400.0
#: A tombstone is never larger (a larger file is not one).
MAX_TOMBSTONE_BYTES = 1024
_FIELD = "ucm_db_retracted"


def tombstone_path(root: RemoteRoot, namespace_id: bytes, key: bytes) -> str:
    """Where the tombstone of ``key`` goes: beside its object's path."""
    return root.object_path(namespace_id, key) + TOMBSTONE_SUFFIX


def tombstone_key(name: str) -> bytes | None:
    """The key a file name ``<key hex>.retracted`` names (lowercase hex, as
    written); None for any other name."""
    if not name.endswith(TOMBSTONE_SUFFIX):
        return None
    stem = name[: -len(TOMBSTONE_SUFFIX)]
    if len(stem) != 64 or stem.strip("0123456789abcdef"):
        return None
    return bytes.fromhex(stem)


def write_tombstone(root: RemoteRoot, namespace_id: bytes, key: bytes, retracted_ns: int) -> None:
    """Writes the tombstone of ``key`` (whole-object; one request)."""
    body = {_FIELD: key.hex(), "namespace_id": namespace_id.hex(), "retracted_ns": int(retracted_ns)}
    root.count(requests=1, puts=1)
    try:
        write_whole(root.fs, tombstone_path(root, namespace_id, key), json.dumps(body, sort_keys=True).encode())
    except BaseException:
        root.count(errors=1)
        raise


def parse_tombstone(data: bytes | bytearray, key: bytes) -> int | None:
    """The retraction time (ns) a tombstone of ``key`` states; None when
    ``data`` is not one."""
    if len(data) > MAX_TOMBSTONE_BYTES:
        return None
    try:
        body = json.loads(bytes(data))
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get(_FIELD) != key.hex():
        return None
    retracted_ns = body.get("retracted_ns")
    return retracted_ns if isinstance(retracted_ns, int) else 0


def has_tombstone(root: RemoteRoot, namespace_id: bytes, key: bytes) -> bool:
    """Whether the remote holds a tombstone of ``key`` (one ranged read)."""
    data = root.read_range(tombstone_path(root, namespace_id, key), 0, MAX_TOMBSTONE_BYTES + 1)
    return data is not None and parse_tombstone(data, key) is not None
