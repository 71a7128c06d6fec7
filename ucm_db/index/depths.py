"""Depth repair of the block index: a block's depth rewritten to its
parent's plus one (a first block's: 0), and its descendants' after it.

A block's depth orders its LRU entry (tails go first) and bounds every
walk to its ancestors: a pin's walk stops where a parent's depth is not
one less (:mod:`ucm_db.index.pins`). Altered metadata leaves a wrong depth,
and a put under such a block gives its child that depth plus one.
``ucm-db verify --fix`` rewrites them (:func:`restore_in`), parents first.

Invariants:
    * Each block is judged inside the write transaction that rewrites it,
      from the records as they are then, and its LRU entry moves with its
      depth.
    * After a block is rewritten its children are judged through their
      child links, before anything else: a child a live writer put under it
      between the caller's scan and the rewrite (the old depth plus one) is
      rewritten too (a review found one left behind, and the next check
      named it); one put after the rewrite committed reads the new depth.
    * A block is rewritten at most once per repair (a cycle of damaged
      parent links ends; ``verify --fix`` quarantines cycles), and a
      transaction judges at most ``budget`` blocks, handing back the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from ucm_db.engines.base import Txn
from ucm_db.index.damage import stored_meta
from ucm_db.index.entries import lru_key


def restore_depth(txn: Txn, key: bytes) -> bool:
    """Rewrites ``key``'s depth to its parent's plus one (a first block's: 0)
    where it differs, moving its LRU entry; judged here from the records as
    they are now (call parents first). Returns whether it rewrote."""
    meta = stored_meta(txn, key)
    if meta is None:
        return False
    parent = None if meta.parent is None else stored_meta(txn, meta.parent)
    if meta.parent is not None and parent is None:
        return False
    depth = 0 if parent is None else parent.depth + 1
    if meta.depth == depth:
        return False
    txn.delete("lru", lru_key(meta.access_ns, meta.depth, key))
    meta.depth = depth
    txn.put("meta", key, meta.pack())
    txn.put("lru", lru_key(meta.access_ns, depth, key), b"")
    return True


def restore_in(txn: Txn, keys: Sequence[bytes], budget: int, rewritten: Collection[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
    """Judges ``keys`` in order (parents first), and right after each one it
    rewrites, that block's children (recursively), at most ``budget`` blocks
    in all; blocks in ``rewritten`` (earlier transactions') are not judged
    again. Returns (the blocks rewritten, those left to judge, in order).
    Changes nothing but ``txn``: a transaction run again gives the same."""
    queue = deque(keys)
    done: list[bytes] = []
    seen: set[bytes] = set()  # this transaction's; ``rewritten`` is only read (a copy a transaction costs O(n) each)
    for _ in range(max(1, budget)):
        if not queue:
            break
        key = queue.popleft()
        if key in seen or key in rewritten or not restore_depth(txn, key):
            continue
        seen.add(key)
        done.append(key)
        queue.extendleft(reversed([bytes(link[len(key):]) for link, _ in txn.scan("children", key)]))
    return done, list(queue)
