"""Uploads keep the remote's ancestor chains whole beside ``ucm-db gc``.

The left-out: gc sees only the remote. A node's continuation of an old
remote chain R, still entirely in its write-back queue, is invisible to it,
so R looked old and childless and went; the continuation landed later
under nothing (every other node missed all of it, and an hour on gc removed
it as orphaned). And a busy namespace stayed "held" run after run: nearly
every listing held objects whose parent was absent, in flight or landed
after the listing passed its path.

Now the uploader adds a batch's queued ancestors to it and, before the
batch goes, checks the parent of each batch root on the remote, uploading
it again (with its absent ancestors, parents first) from the local tier;
gc looks again for a parent its listing lacks before holding a namespace
(:mod:`ucm_db.remote.ancestry`, :func:`ucm_db.remote.gc_listing.landed_parents`).

Real parts throughout: LMDB stores, a ``memory://``, ``file://`` or moto S3
remote, the election lock a second process of the store would hold, gc
through ``maintenance`` or its module with a clock moved on instead of
aged objects (objects on S3 cannot be aged).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

import faultfs
import ucm_db
from ucm_db import codec
from ucm_db.components import UPLOADER_LOCK_NAME, local_tier
from ucm_db.index.entries import BlockEntry
from ucm_db.remote import uploader as uploader_module
from ucm_db.remote.gc import gc, landed_parents, list_objects, uploading_objects
from ucm_db.remote.tier import RemoteRoot, unpack_object
from ucm_db.remote.upload_plan import BatchPlanner
from ucm_db.remote.uploader import Uploader

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(180)
CAP = 64 << 20
DAY_S = 86400.0


@contextmanager
def uploads_held(store_dir: Path) -> Iterator[Callable[[], None]]:
    """Holds the store directory's uploader election (as another process of
    the store would, not draining): its blocks stay queued until the
    ``release`` it yields is called, or the block ends."""
    store_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(store_dir / UPLOADER_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    held = [fd]

    def release() -> None:
        while held:
            os.close(held.pop())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield release
    finally:
        release()


def remote_chains(remote: Remote, namespace: ucm_db.Namespace) -> dict[bytes, bytes | None]:
    """Every object of the namespace on the remote, verified: key -> parent."""
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    root.fs.invalidate_cache()
    tier = root.tier(namespace.id)
    return {key: unpack_object(root.fs.cat_file(tier.path(key)), key).parent for key in tier.iterate()}


def orphans(objects: dict[bytes, bytes | None]) -> list[str]:
    return [key.hex()[:12] for key, parent in objects.items() if parent is not None and parent not in objects]


def gc_days_later(remote: Remote, days: float, **limits: Any) -> dict[str, Any]:
    """gc run ``days`` from now (every object ``days`` older), the other rules' defaults off."""
    root = RemoteRoot.from_url(remote.url, dict(remote.options))
    return gc(root, older_than_s=limits.get("older_than_s"), max_bytes=limits.get("max_bytes"), dry_run=False,
              now_s=time.time() + days * DAY_S)


def test_a_continuation_queued_while_gc_removes_its_old_root_lands_under_it(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The left-out end to end. Node A uploads chain R (3 blocks); node B
    reads R through and continues it with C (3 blocks, write-back), but its
    uploads wait (its election is held). A week on, gc sees R old and
    childless and removes it. B's queue drains: C used to land under
    nothing, so a fresh node found 0 of the 6 blocks (and gc later removed C
    as orphaned); now B uploads R again from its local tier before C."""
    keys, payloads = chain(namespace, 6)
    root_keys, cont_keys = keys[:3], keys[3:]
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a:
        a.put(namespace, root_keys, payloads[:3])
    assert set(remote_chains(remote, namespace)) == set(root_keys)

    with uploads_held(tmp_path / "b") as release, ucm_db.open(
            tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as b:
        assert b.get(namespace, root_keys) == payloads[:3]  # read through: R is local at B
        b.put(namespace, cont_keys, payloads[3:])  # queued, not uploaded
        report = gc_days_later(remote, 8, older_than_s=7 * DAY_S)
        assert report["removed_by_rule"] == 3 and report["held_namespaces"] == 0, report
        assert remote_chains(remote, namespace) == {}
        release()
        b.flush(upload_timeout_s=30)
        stats = b.stats().remote

    objects = remote_chains(remote, namespace)
    assert orphans(objects) == [], "the continuation landed under a removed root"
    assert set(objects) == set(keys)
    assert (stats["ancestors_reuploaded"], stats["ancestors_missing"]) == (3, 0), stats
    assert stats["ancestor_checks"] == 3, stats  # C's parent, then R's two others, one read each
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as reader:
        assert reader.lookup(namespace, keys) == 6
        assert reader.get(namespace, keys) == payloads


def test_a_write_through_put_continuing_a_removed_chain_uploads_it_first(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The same with ``write_through``: B read R through before gc removed
    it; B's next put, continuing R, uploaded its blocks under nothing. Now
    the put uploads R again first."""
    keys, payloads = chain(namespace, 4)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a:
        a.put(namespace, keys[:2], payloads[:2])
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP,
                     **remote.store_options(remote_mode="write_through", remote_deadline_s=10)) as b:
        assert b.lookup(namespace, keys[:2]) == 2
        assert gc_days_later(remote, 8, older_than_s=7 * DAY_S)["removed_by_rule"] == 2
        b.put(namespace, keys[2:], payloads[2:])
        stats = b.stats().remote
    assert orphans(remote_chains(remote, namespace)) == [] and stats["ancestors_reuploaded"] == 2, stats
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as reader:
        assert reader.lookup(namespace, keys) == 4


def test_a_turn_continuing_this_nodes_own_recent_upload_checks_nothing(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The cost: a batch whose roots continue what this process uploaded in
    the last minute (a conversation's next turn) makes no request for its
    ancestors; one continuing another node's chain makes one."""
    keys, payloads = chain(namespace, 9)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as a:
        a.put(namespace, keys[:3], payloads[:3])
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as b:
        assert b.lookup(namespace, keys[:3]) == 3
        b.put(namespace, keys[3:6], payloads[3:6])
        b.flush(upload_timeout_s=30)
        assert b.stats().remote["ancestor_checks"] == 1  # A's last block, once
        b.put(namespace, keys[6:], payloads[6:])
        b.flush(upload_timeout_s=30)
        stats = b.stats().remote
    assert (stats["ancestor_checks"], stats["ancestors_reuploaded"], stats["uploaded"]) == (1, 0, 6), stats
    assert orphans(remote_chains(remote, namespace)) == []


def queued_chain(store: ucm_db.Store, namespace: ucm_db.Namespace, n_blocks: int) -> list[bytes]:
    """Puts a chain straight into the local tier's upload queue (a store
    without a remote: nothing drains it behind the test's back)."""
    keys, payloads = chain(namespace, n_blocks, seed=7)
    entries = [BlockEntry.of_blob(k, keys[i - 1] if i else None, codec.encode(k, p), len(p), namespace.id)
               for i, (k, p) in enumerate(zip(keys, payloads))]
    desc = (namespace.id, json.dumps(namespace.to_dict()).encode())
    local_tier(store).put_blocks(entries, namespace_desc=desc, enqueue_upload=True)
    return list(keys)


def test_a_batch_holds_the_queued_ancestors_of_its_blocks(tmp_path: Path, namespace: ucm_db.Namespace) -> None:
    """The queue is read in key order, BATCH_KEYS at a time: of a chain of
    300 queued blocks, the first batch took 256 scattered over the chain, so
    most landed before their parents (gc then held the namespace, and took
    the parents' absence for in-flight uploads). Now a batch takes its
    blocks' queued ancestors first: the chain lands as a growing prefix."""
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as store:
        keys = queued_chain(store, namespace, 300)
        root = RemoteRoot.from_url(f"memory://ucm-closure-{tmp_path.name}")
        uploader = Uploader(local_tier(store), root, store.path, concurrency=4)
        try:
            assert uploader.drain_batch() == (uploader_module.BATCH_KEYS, 0)
            assert sorted(root.tier(namespace.id).iterate()) == sorted(keys[: uploader_module.BATCH_KEYS])
            assert uploader.drain_batch() == (300 - uploader_module.BATCH_KEYS, 0)
            assert uploader.drain_batch() == (0, 0)
            assert uploader.ancestry.checks == 0  # every batch root's parent was in an earlier batch of this process
        finally:
            uploader.stop()


def test_a_plan_passes_over_remembered_blocks_that_left_the_queue(tmp_path: Path, namespace: ucm_db.Namespace) -> None:
    """A plan remembers the queued ancestors it walked and did not take (so
    a deep backlog is walked once); blocks that left the queue meanwhile
    (another process's write-through uploaded them) are passed over, never
    sent again nor taken for an empty batch."""
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as store:
        keys = queued_chain(store, namespace, 300)
        local = local_tier(store)
        planner = BatchPlanner(local)
        chosen, gone, stored_ns = planner.plan(local.pending_uploads(limit=8), max_keys=8, max_bytes=1 << 30)
        assert (chosen, gone, set(stored_ns)) == (keys[:8], [], set(keys[:8]))
        local.mark_uploaded(keys[:40])  # this batch's 8, and 32 more another process uploaded
        chosen, gone, _ = planner.plan(local.pending_uploads(limit=8), max_keys=8, max_bytes=1 << 30)
        assert (chosen, gone) == (keys[40:48], [])


def test_a_parent_the_local_tier_no_longer_holds_is_counted_and_the_children_go(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A batch root whose parent is absent from the remote and not stored
    here (nothing to upload again) goes anyway, as it always did, counted
    in ``ancestors_missing``."""
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as store:
        keys = queued_chain(store, namespace, 2)
        root = RemoteRoot.from_url(f"memory://ucm-missing-{tmp_path.name}")
        uploader = Uploader(local_tier(store), root, store.path, concurrency=2)
        try:
            lost_parent = b"\x5a" * 32
            repair = uploader.ancestry.before_batch([(keys[1], lost_parent, namespace.id, 1, b"")])
            assert repair is not None and repair.held_back == frozenset() and repair.errors == []
            assert (uploader.ancestry.checks, uploader.ancestry.reuploaded, uploader.ancestry.missing) == (1, 0, 1)
            assert uploader_module.describe(uploader)["ancestors_missing"] == 1
        finally:
            uploader.stop()


def test_a_failed_check_holds_back_the_batch_root_and_its_descendants(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A check that fails (the remote refuses reads) sends nothing under
    that parent: the batch root and its descendants in the batch stay
    queued for a later batch, and the failure is the batch's error."""
    keys, payloads = chain(namespace, 5)
    target = tmp_path / "remote"
    url = f"file://{target}"
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_mode="write_through") as a:
        a.put(namespace, keys[:2], payloads[:2])
    plan = faultfs.FaultPlan(read_error_rate=1.0, seed=3)
    faulty = RemoteRoot.from_url(f"ucmfault://{target}", {"target_protocol": "file", "plan": plan})
    with uploads_held(tmp_path / "b"), ucm_db.open(tmp_path / "b", capacity_bytes=CAP, remote=url, remote_deadline_s=10) as b:
        assert b.lookup(namespace, keys[:2]) == 2
        b.put(namespace, keys[2:], payloads[2:])
        uploader = Uploader(local_tier(b), faulty, b.path, concurrency=2)
        try:
            work = [(k, keys[i + 1], namespace.id, i + 2, b"") for i, k in enumerate(keys[2:])]
            repair = uploader.ancestry.before_batch(work)
            assert repair is not None and repair.held_back == frozenset(keys[2:]), repair
            assert len(repair.errors) == 1 and "ConnectionError" in repair.errors[0]
            faulty.manifest_written(namespace.id)  # A wrote it: the batch goes on to its check
            assert uploader.drain_batch() == (0, 1)
            assert uploader.ancestry.checks == 2 and "ConnectionError" in str(uploader.last_error)
            assert set(local_tier(b).pending_uploads()) == set(keys[2:])  # all still queued
        finally:
            uploader.stop()


def test_landed_parents_reads_a_parent_written_after_the_listing(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """gc's second look, on each kind of remote: a parent written (by
    another node) after the listing is read where it belongs, with its
    size, time and parent; its own listed parent ends the walk."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "w", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as w:
        w.put(namespace, keys, payloads)
    root = RemoteRoot.from_url(remote.url, {**remote.options, "use_listings_cache": True})  # gc's, caching listings
    b_path = root.object_path(namespace.id, keys[1])
    b_bytes = root.fs.cat_file(b_path)
    root.fs.rm_file(b_path)
    listing = list_objects(root)
    assert sorted(o.key for o in listing.objects) == sorted([keys[0], keys[2]])
    RemoteRoot.from_url(remote.url, {**remote.options, "skip_instance_cache": True}).fs.pipe_file(b_path, b_bytes)

    found = landed_parents(root, listing.objects, uploading_objects(listing.objects, time.time()))

    assert [(o.key, o.parent, o.size_bytes, o.broken) for o in found] == [(keys[1], keys[0], len(b_bytes), False)]
    assert abs(found[0].mtime_s - time.time()) < 600


class LateLandingFileSystem(LocalFileSystem):  # type: ignore[misc]
    """A local directory whose listing is no snapshot: ``landing`` (path ->
    bytes) lands just after a ``find`` passed it, as an upload does while a
    long listing of an object store walks on."""

    def __init__(self, landing: dict[str, bytes]) -> None:
        super().__init__(skip_instance_cache=True)
        self.landing = landing

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        found = super().find(path, *args, **kwargs)
        for target, data in list(self.landing.items()):
            if target.startswith(path.rstrip("/") + "/"):
                Path(target).write_bytes(data)
                del self.landing[target]
        return found


def test_gc_looks_again_for_a_parent_that_landed_after_its_listing_passed(
    tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """Chain A -> B -> C: A a month old, B and C seconds; D, a chain of
    the same namespace nobody continued, 10 days. B lands just after the
    listing passed its path: gc saw C without its parent and held the whole
    namespace (D stayed, run after run on a busy remote). Now it reads B
    where it belongs, knows A -> B -> C is young, and removes D only. A
    parent that is truly still absent holds the namespace as before (a node
    running an older ucm-db never uploads again an ancestor gc removed)."""
    keys, payloads = chain(namespace, 3)
    other_keys, other_payloads = chain(namespace, 2, seed=11)
    target = tmp_path / "remote"
    with ucm_db.open(tmp_path / "w", capacity_bytes=CAP, remote=f"file://{target}", remote_mode="write_through") as w:
        w.put(namespace, keys, payloads)
        w.put(namespace, other_keys, other_payloads)
    tier = RemoteRoot(LocalFileSystem(), str(target)).tier(namespace.id)
    now_s = time.time()
    for key, age_s in [(keys[0], 30 * DAY_S), (keys[1], 5.0), (keys[2], 5.0), (other_keys[0], 10 * DAY_S),
                       (other_keys[1], 10 * DAY_S)]:
        os.utime(tier.path(key), (now_s - age_s, now_s - age_s))
    b_path, b_bytes = tier.path(keys[1]), Path(tier.path(keys[1])).read_bytes()

    os.unlink(b_path)  # still in flight: lands after this run
    held = gc(RemoteRoot(LocalFileSystem(skip_instance_cache=True), str(target)), older_than_s=7 * DAY_S, max_bytes=None,
              dry_run=False)
    assert (held["held_namespaces"], held["held_by_rule"], held["removed_objects"]) == (1, 3, 0), held

    late = RemoteRoot(LateLandingFileSystem({b_path: b_bytes}), str(target))
    report = gc(late, older_than_s=7 * DAY_S, max_bytes=None, dry_run=False)
    os.utime(b_path, (now_s - 5, now_s - 5))

    assert [os.path.exists(tier.path(k)) for k in keys + other_keys] == [True, True, True, False, False], report
    assert (report["held_namespaces"], report["removed_by_rule"], report["removed_descendants"]) == (0, 2, 0), report
    assert report["landed_after_listing"] == 1, report
