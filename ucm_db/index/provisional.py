"""Provisional blocks: puts whose owner may still take them back.

A writer that commits blocks before it knows whether they are right (a
``kv_producer`` commits a save over a load within its step; a later step may
find the load failed and void the save) tags them (``Store.put_segments``'s
``provisional``). The put's own transaction records, in ``info``, one
marker per chain root the put stored under a tag (a stored block whose
parent was not stored by the same put under the same tag):

* ``prov/<owner id><seq><key>`` -> the block's namespace id, where the tag
  is the owner id (:data:`OWNER_ID_BYTES`) and a sequence number
  (:data:`SEQ_BYTES`, big-endian) the owner gives each save.

* ``held/<owner id><seq><key>`` -> the block's namespace id and its
  ``created_ns`` (8 bytes, big-endian), for every block the put stored
  under a tag where the store uploads to a write-back remote: the upload
  the put would have queued (``uploads``), held back.

Nothing else scans the prefixes. The owner removes a tag's markers once
the save stands (:func:`settle`, which queues its held uploads) or after its
void deleted the blocks; a sweep (:mod:`ucm_db.store.provisional`)
deletes, with their descendants, the marked blocks of an owner whose
process is gone, then its markers and held uploads.

Invariants:
    * A marker is written by the transaction that stores its block, never
      for a block found stored already (first writer wins: its blocks are
      another writer's), so a sweep deletes only what the owner stored and
      every descendant of it (those are computed over it too).
    * A marked root and its descendants are all the blocks one tag's put
      stored in its chain: a block of the tag whose parent the same put
      stored under the same tag needs no marker of its own.
    * With a write-back remote, a provisional block reaches the remote only
      once its tag is settled: its put holds its upload (no ``uploads``
      row), and the uploader's ancestor repair never sends a held block nor
      what hangs under it (:mod:`ucm_db.remote.ancestry`). Other nodes are
      never served what a dead owner stored, nor what its void took back.
      The settle queues the held uploads of blocks still stored as the put
      stored them (the same ``created_ns``: a key voided or evicted and
      stored again since is another block, held under its own tag or
      queued by its own put), in its own transaction. A retraction's
      confirmation never queues a held block (:mod:`retractions`). A write-through put uploads what it stores before it
      returns, tagged or not (its caller's contract: a ``kv_producer``
      publishing to the remote); a void or sweep retracts them there.
    * Markers may outlive their block (evicted, deleted, re-stored by
      someone else): a sweep then deletes what is stored under that key
      now, which loses a right block at worst, never keeps a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable

from ucm_db.engines.base import Txn
from ucm_db.index.damage import meta_or_none

INFO = "info"
PROVISIONAL_PREFIX = b"prov/"
HELD_PREFIX = b"held/"
#: A provisional owner's id: random bytes made by the owner.
OWNER_ID_BYTES = 16
#: A tag's sequence number, after the owner id.
SEQ_BYTES = 8
TAG_BYTES = OWNER_ID_BYTES + SEQ_BYTES


def mark(txn: Txn, tag: bytes, key: bytes, namespace_id: bytes) -> None:
    """Records ``key``, stored by this transaction under ``tag``, as provisional."""
    txn.put(INFO, PROVISIONAL_PREFIX + tag + key, namespace_id)


def hold(txn: Txn, tag: bytes, key: bytes, namespace_id: bytes, created_ns: int) -> None:
    """Holds back the upload of ``key``, stored by this transaction under
    ``tag`` at ``created_ns``, until the tag is settled."""
    txn.put(INFO, HELD_PREFIX + tag + key, namespace_id + created_ns.to_bytes(8, "big"))


def settle(txn: Txn, tags: Iterable[bytes]) -> tuple[int, int]:
    """Drops every marker of ``tags`` (their blocks stand) and queues their
    held uploads whose block is still the one the put stored (module
    invariants); returns ``(markers dropped, uploads queued)``."""
    dropped = queued = 0
    start = len(HELD_PREFIX) + TAG_BYTES
    for tag in tags:
        for name in [bytes(name) for name, _ in txn.scan(INFO, PROVISIONAL_PREFIX + tag)]:
            txn.delete(INFO, name)
            dropped += 1
        for name, value in [(bytes(n), bytes(v)) for n, v in txn.scan(INFO, HELD_PREFIX + tag)]:
            txn.delete(INFO, name)
            meta = meta_or_none(txn.get("meta", name[start:]))
            if meta is not None and meta.created_ns == int.from_bytes(value[16:24], "big"):  # else gone, or another
                txn.put("uploads", name[start:], value[:16])
                queued += 1
    return dropped, queued


def owners(txn: Txn) -> set[bytes]:
    """The owner ids that have markers (few: markers are settled within steps)."""
    found: set[bytes] = set()
    start = len(PROVISIONAL_PREFIX)
    for name, _ in txn.scan(INFO, PROVISIONAL_PREFIX):
        found.add(bytes(name[start:start + OWNER_ID_BYTES]))
    return found


def marked(txn: Txn, owner_id: bytes) -> tuple[dict[bytes, list[bytes]], list[bytes]]:
    """The marked keys of ``owner_id`` by namespace id, and the names of its
    markers and held uploads (a sweep drops those it read, never one
    written since: :func:`drop`)."""
    by_namespace: dict[bytes, list[bytes]] = {}
    names: list[bytes] = []
    start = len(PROVISIONAL_PREFIX) + TAG_BYTES
    for name, namespace_id in txn.scan(INFO, PROVISIONAL_PREFIX + owner_id):
        names.append(bytes(name))
        by_namespace.setdefault(bytes(namespace_id), []).append(bytes(name[start:]))
    names.extend(bytes(name) for name, _ in txn.scan(INFO, HELD_PREFIX + owner_id))
    return by_namespace, names


def drop(txn: Txn, names: Iterable[bytes]) -> None:
    """Drops the markers named ``names``."""
    for name in names:
        txn.delete(INFO, name)


def held_keys(txn: Txn) -> set[bytes]:
    """Every key whose upload is held (one scan: held uploads last a few
    steps)."""
    start = len(HELD_PREFIX) + TAG_BYTES
    return {bytes(name[start:]) for name, _ in txn.scan(INFO, HELD_PREFIX)}


def held_among(txn: Txn, keys: Iterable[bytes]) -> set[bytes]:
    """Those of ``keys`` whose upload is held."""
    held = held_keys(txn)
    return held.intersection(keys) if held else set()


def marked_keys(txn: Txn) -> set[bytes]:
    """Every marked key, of any owner (an export leaves their chains out)."""
    start = len(PROVISIONAL_PREFIX) + TAG_BYTES
    return {bytes(name[start:]) for name, _ in txn.scan(INFO, PROVISIONAL_PREFIX)}
