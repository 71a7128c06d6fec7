"""Bounded work over a large engine table: prefix partitions and random probes.

:class:`~ucm_db.engines.base.Txn` scans by key prefix only, which is enough to
cut a table of a million keys into pieces that one short transaction each
can handle, and to pick random keys without listing the table:

* :func:`partitions` yields key prefixes that each held at most ``limit``
  keys when counted. A prefix with more keys is split into its 256
  one-byte-longer prefixes (only the non-empty ones go on), so the split
  follows the keys: random block keys split at the first byte or two, LRU
  keys (a timestamp first) after their shared leading bytes.
* :func:`sample_keys` picks keys by probing random prefixes of the length
  at which a prefix holds about one key or more: O(count) probes of O(1)
  expected keys each, whatever the table's size.

Invariants:
    * Every key that stays in the table while :func:`partitions` runs lies
      under exactly one yielded prefix (the prefixes are disjoint and cover
      the key space); keys written meanwhile may or may not be covered.
    * Counting and splitting run in read transactions of at most about
      ``limit`` keys or 256 probes each: they never hold the writer lock.
    * :func:`sample_keys` returns distinct keys in byte order, the same ones
      for the same seed and table contents.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import islice

from ucm_db.engines.base import Engine, Txn

#: Probes per read transaction of :func:`sample_keys`.
PROBES_PER_TXN = 256
#: Probes :func:`sample_keys` may spend per key asked for (plus a constant).
PROBES_PER_KEY = 16


def count_upto(txn: Txn, table: str, prefix: bytes, limit: int) -> int:
    """Keys under ``prefix``, counted up to ``limit`` (more reads as ``limit``)."""
    return sum(1 for _ in islice(txn.scan(table, prefix), limit))


def partitions(engine: Engine, table: str, limit: int) -> Iterator[bytes]:
    """Disjoint prefixes covering ``table``, each holding at most ``limit``
    keys when counted, in key order (see the module's invariants). Empty
    prefixes are not yielded."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    stack = [b""]
    while stack:
        prefix = stack.pop()
        count = engine.read(lambda txn: count_upto(txn, table, prefix, limit + 1))
        if count == 0:
            continue
        if count <= limit:
            yield prefix
            continue
        children = engine.read(lambda txn: _nonempty_children(txn, table, prefix))
        stack.extend(reversed(children))


def _nonempty_children(txn: Txn, table: str, prefix: bytes) -> list[bytes]:
    """The one-byte extensions of ``prefix`` that have keys. A key equal to
    ``prefix`` itself would belong to none of them: the tables split here
    hold keys of one length, longer than any prefix that needs a split."""
    out = []
    for byte in range(256):
        child = prefix + bytes([byte])
        if next(txn.scan(table, child), None) is not None:
            out.append(child)
    return out


def probe_bytes(total_keys: int) -> int:
    """Prefix length whose prefixes hold about one key or more on average
    in a table of ``total_keys`` uniformly spread keys (0: scan it all)."""
    length = 0
    while 256 ** (length + 1) <= total_keys:
        length += 1
    return length


def sample_keys(engine: Engine, table: str, count: int, *, total_keys: int, seed: int = 0) -> list[bytes]:
    """About ``count`` distinct random keys of ``table`` (all of them if it
    holds no more than ``2 * count``), sorted.

    Each probe takes a random prefix of :func:`probe_bytes` bytes and one
    of the keys under it at random: uniform over keys that are hashes
    (block keys), at O(1) expected reads per probe. Stops after
    ``PROBES_PER_KEY * count + 256`` probes, so a table much smaller than
    ``total_keys`` claims returns fewer keys instead of spinning.
    """
    if count <= 0:
        return []
    rng = random.Random(seed)
    length = probe_bytes(total_keys)
    if length == 0 or total_keys <= 2 * count:
        keys = engine.read(lambda txn: [bytes(k) for k, _ in txn.scan(table)])
        return sorted(rng.sample(keys, count)) if count < len(keys) else keys
    found: set[bytes] = set()
    budget = PROBES_PER_KEY * count + 256

    def probe_some(txn: Txn) -> int:
        probes = 0
        while probes < PROBES_PER_TXN and len(found) < count:
            probes += 1
            under = [k for k, _ in txn.scan(table, rng.randbytes(length))]
            if under:
                found.add(bytes(rng.choice(under)))
        return probes

    while len(found) < count and budget > 0:
        budget -= engine.read(probe_some)
    return sorted(found)
