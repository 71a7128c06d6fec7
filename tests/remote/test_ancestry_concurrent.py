"""The ancestor repair of a batch checks a long absent chain a round of
checks at a time, several levels per round, and keeps its rules: parents
land before their children are sent, and nothing is put back at or under a
tombstoned block.

The issue: before a batch, :class:`~ucm_db.remote.ancestry.AncestorRepair`
walked the absent ancestors of its roots one level per round of checks (an
envelope read and, absent, a tombstone read): about three round trips per
missing level with the uploads, slow over a slow link for a long chain
that gc removed. Now each round checks further up at once (1, 2, 4 ... up
to ``upload_concurrency`` levels), read from the local tier's chain.

Real parts: LMDB stores, a ``file://`` remote, gc with its clock moved on a
week. Rounds are counted by a spy on :meth:`UploadPool.run` (each call is
one wave of concurrent remote calls: one round trip), and the order of
uploads by a spy on :meth:`RemoteTier.store`; both call the real code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.remote.gc import gc
from ucm_db.remote.tier import RemoteRoot, RemoteTier
from ucm_db.remote.tombstones import write_tombstone
from ucm_db.remote.upload_pool import UploadPool

from .conftest import chain

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20
DAY_S = 86400.0
#: Blocks of the chain gc removes.
DEPTH = 24
CONCURRENCY = 4


def removed_chain(tmp_path: Path, namespace: ucm_db.Namespace) -> tuple[str, list[bytes], list[bytes]]:
    """A chain of DEPTH + 1 blocks, the first DEPTH uploaded by store ``a``
    and then removed by gc a week on (old and childless); the remote URL."""
    keys, payloads = chain(namespace, DEPTH + 1)
    url = f"file://{tmp_path}/remote"
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_mode="write_through") as a:
        a.put(namespace, keys[:DEPTH], payloads[:DEPTH])
    report = gc(RemoteRoot.from_url(url), older_than_s=7 * DAY_S, max_bytes=None, dry_run=False,
                now_s=time.time() + 8 * DAY_S)
    assert report["removed_by_rule"] == DEPTH, report
    return url, keys, payloads


def remote_keys(url: str, namespace: ucm_db.Namespace) -> set[bytes]:
    return set(RemoteRoot.from_url(url).tier(namespace.id).iterate())


class Spies:
    """Counts the waves of ancestor checks, and records the order in which
    uploads start and end (both wrap the real calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.check_waves = 0
        self.events: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        real_run, real_store = UploadPool.run, RemoteTier.store

        def run(pool: UploadPool, calls: list[Callable[[], Any]], *args: Any, **kwargs: Any) -> Any:
            if calls and isinstance(calls[0], partial) and calls[0].func.__name__ == "_check":
                self.check_waves += 1
            return real_run(pool, calls, *args, **kwargs)

        def store(tier: RemoteTier, key: bytes, parent: bytes | None, blob: Any) -> Any:
            self._event("start", key)
            try:
                return real_store(tier, key, parent, blob)
            finally:
                self._event("end", key)

        monkeypatch.setattr(UploadPool, "run", run)
        monkeypatch.setattr(RemoteTier, "store", store)

    def _event(self, what: str, key: bytes) -> None:
        with self._lock:
            self.events.append((what, key))

    def at(self, what: str, key: bytes) -> int:
        return self.events.index((what, key))


def test_a_long_removed_chain_is_checked_several_levels_a_round_and_sent_parents_first(
    tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The continuation of a 24-block chain gc removed: the store (opened
    again: it remembers no upload) finds the 24 absent ancestors in a few
    rounds of checks (it took 24), uploads them parents first, each only
    once its parent has landed, then the continuation; a reader gets it all."""
    url, keys, payloads = removed_chain(tmp_path, namespace)
    spies = Spies(monkeypatch)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, upload_concurrency=CONCURRENCY) as a:
        a.put(namespace, keys[DEPTH:], payloads[DEPTH:], parent=keys[DEPTH - 1])
        a.flush(upload_timeout_s=60)
        stats = a.stats().remote
    assert (stats["ancestors_reuploaded"], stats["ancestors_missing"]) == (DEPTH, 0), stats
    assert spies.check_waves <= DEPTH // 3, spies.check_waves  # 1, 2, then 4 levels a round: 8 rounds, not 24
    assert DEPTH <= stats["ancestor_checks"] < DEPTH + CONCURRENCY, stats  # at most a round's worth checked for nothing
    for parent, key in zip(keys, keys[1:]):
        assert spies.at("end", parent) < spies.at("start", key), "a block was sent before its parent landed"
    assert remote_keys(url, namespace) == set(keys)
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_deadline_s=10) as reader:
        assert reader.get(namespace, keys) == payloads


def test_checks_ahead_never_put_back_a_tombstoned_block_nor_what_is_above_or_under_it(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The same removed chain, with block 3 retracted by another node (its
    tombstone on the remote): the walk stops there. Its rounds also checked
    blocks above it ahead (absent too), yet nothing is uploaded: not block
    3, not the 20 blocks under it (computed over it), not blocks 0-2 (past
    where the walk stopped), and the continuation leaves the queue unsent.
    (The original walk, one level a round, checked 23 down to 3 only.)"""
    url, keys, payloads = removed_chain(tmp_path, namespace)
    write_tombstone(RemoteRoot.from_url(url), namespace.id, keys[3], time.time_ns())
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, upload_concurrency=CONCURRENCY) as a:
        a.put(namespace, keys[DEPTH:], payloads[DEPTH:], parent=keys[DEPTH - 1])
        a.flush(upload_timeout_s=60)
        stats = a.stats().remote
    assert (stats["ancestors_retracted"], stats["dropped_under_retracted"], stats["ancestors_reuploaded"]) == (1, 1, 0), stats
    assert stats["ancestor_checks"] > DEPTH - 3, stats  # 23 down to 3, and some of 0-2 checked ahead of the tombstone
    assert remote_keys(url, namespace) == set()
