"""The fix of the review's undo finding (:mod:`ucm_db.remote.ancestry`): an
ancestor is uploaded again with an exclusive write, so another writer's
object that landed after the check stays (test_review_uploads_tombstone_reread.py);
this guards the other half: a *broken* object found by the check (damaged,
or of another namespace) is still replaced, as before, and what hangs under
it goes.

Real parts: two LMDB stores as nodes, a ``file://`` remote, a damaged
object written into the remote directory (as a torn copy or bit rot would
leave it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db.remote.tier import RemoteRoot

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_a_broken_parent_object_is_replaced_and_its_children_go(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    keys, payloads = chain(namespace, 3)
    opts = remote.store_options(remote_deadline_s=10)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **opts) as a, \
            ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **opts) as b:
        a.put(namespace, keys[:2], payloads[:2])
        a.flush(upload_timeout_s=30)
        assert b.get(namespace, keys[:2]) == payloads[:2]  # B holds block 1
        root = RemoteRoot.from_url(remote.url, dict(remote.options))
        Path(root.object_path(namespace.id, keys[1])).write_bytes(b"\0" * 200)  # broken in place
        b.put(namespace, keys[2:], payloads[2:], parent=keys[1])
        b.flush(upload_timeout_s=30)
        stats = b.stats().remote
    assert (stats["ancestors_reuploaded"], stats["ancestors_taken"], stats["dropped_under_retracted"]) == (1, 0, 0), stats
    with ucm_db.open(tmp_path / "fresh", capacity_bytes=CAP, **opts) as fresh:
        got = fresh.get(namespace, keys)
    assert [g is not None and bytes(g) == p for g, p in zip(got, payloads)] == [True, True, True]
