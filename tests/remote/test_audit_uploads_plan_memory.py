"""Audit of the upload planner's memory: a batch never holds a block
without its queued ancestors, even when an ancestor was queued again after
the planner remembered the block.

The finding: a plan remembers the blocks it walked and left queued
(:class:`ucm_db.remote.upload_plan.BatchPlanner`, so a deep backlog is walked
once), and never walks a remembered block's ancestors again. An ancestor
taken by an earlier batch (so not remembered), then deleted with its
descendants and put again (a void, then the recomputed chain), is queued
again; when the upload queue's first keys (read in key order, 256 at a time)
did not include it, the next plan took the remembered child alone: the
child went before its parent, and with the parent's object retracted it
landed under nothing. Now a plan whose blocks have a queued parent it did
not take forgets what it remembered and walks again.

Real parts: an LMDB store whose uploads are queued (its election held, as
another process of the store would), the planner the uploader uses. The
queue's first keys are passed to ``plan`` as the uploader passes them; the
test picks which, as the key order of a large backlog would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db.components import local_tier
from ucm_db.remote.upload_plan import BatchPlanner

from .conftest import Remote, chain
from .test_upload_ancestors import uploads_held

CAP = 64 << 20


@pytest.mark.parametrize("remote", ["memory"], indirect=True)
def test_a_block_the_planner_remembered_never_goes_before_its_parent_queued_again(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    keys, payloads = chain(namespace, 3)
    with uploads_held(tmp_path / "a"), ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        local = local_tier(store)
        store.put(namespace, keys, payloads)
        local.mark_uploaded([keys[0]])  # block 0 went with an earlier batch
        planner = BatchPlanner(local)
        taken, _gone, stored_ns = planner.plan([keys[2]], max_keys=1, max_bytes=1 << 30)
        assert taken == [keys[1]]  # block 2 walked, left queued and remembered
        local.mark_uploaded(stored_ns)
        assert store.delete(namespace, [keys[1]]) == 2  # blocks 1 and 2 go (their rows too)
        store.put(namespace, keys[1:], payloads[1:], parent=keys[0])  # and come back, queued again
        assert local.uploads.queued(keys) == {keys[1], keys[2]}
        taken, _gone, _stored_ns = planner.plan([keys[2]], max_keys=1, max_bytes=1 << 30)
        assert taken == [keys[1]], "the planner sent block 2 before its queued parent"
