"""Audit of a retraction's confirmation against a wall clock stepped back.

The finding: confirming a retraction queued the block again for upload when
it had been stored again since the delete (the remote delete may have taken
its new upload), judged by the wall clock: the block's ``created_ns`` after
the retraction's ``retracted_ns``. A clock stepped back between the delete
and the new put (an NTP step; the delete ran on a clock that was ahead) made
the recomputed block look older than its delete: the elected uploader's
pass deleted its object and never queued it again, so the remote lost it for
good while the queue was empty (``flush`` returned). A retraction is
recorded in the transaction that removes every block it names, so a block
stored under its key at confirmation was put after the delete, whatever the
clocks say: it is queued again whenever it is not queued.

Simulated: the clock at the delete (the time the retraction records is
60 s ahead). Real: LMDB store, election lock, ``memory://`` and ``file://``
remotes, a second store reading through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.components import local_tier
from ucm_db.index import retractions

from .conftest import Remote, chain
from .test_upload_ancestors import uploads_held

CAP = 64 << 20
AHEAD_NS = 60 * 10**9


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_a_block_put_again_after_its_delete_reaches_the_remote_though_the_clock_stepped_back(
    remote: Remote, tmp_path: Path, namespace: ucm_db.Namespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, payloads = chain(namespace, 3)
    again = payloads[:2] + [b"recomputed" + payloads[2][10:]]
    real_record = retractions.record_trees

    def ahead(txn: Any, roots: Any, now_ns: int) -> int:
        return real_record(txn, roots, now_ns + AHEAD_NS)

    with uploads_held(tmp_path / "a") as release, ucm_db.open(
            tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        store.put(namespace, keys, payloads)  # written through: another process of the store is the uploader
        with monkeypatch.context() as patch:
            patch.setattr(retractions, "record_trees", ahead)
            assert store.delete(namespace, [keys[2]], remote=True) == 1  # deleted remotely, not confirmed
        assert [r.key for r in local_tier(store).uploads.retractions_due()] == [keys[2]]
        store.put(namespace, keys[2:], again[2:], parent=keys[1])  # recomputed, written through
        release()  # this store's uploader is elected now: it deletes the object again and confirms
        store.flush(upload_timeout_s=30)
        assert local_tier(store).uploads.retractions_due() == []
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=10)) as other:
        got = other.get(namespace, keys)
        assert [g is not None and bytes(g) == p for g, p in zip(got, again)] == [True, True, True], \
            "the recomputed block never reached the remote"
