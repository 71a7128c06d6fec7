"""A read through the remote never fails on a block it cannot promote
because its key is stored locally under another namespace (issue 26,
item 3): node B stored keys built for NS under NS2 (the remote holds them
under NS2); node A holds them locally under NS. A's lookup and get under
NS2 neither raise the put's namespace error nor mix the two namespaces."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace

from .conftest import Remote, chain

CAP = 64 << 20


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_read_through_skips_blocks_stored_locally_under_another_namespace(remote: Remote, tmp_path: Path, namespace) -> None:
    other = Namespace(model="test/remote", kv_dtype="bfloat16", block_size=4, layout="test", tp_rank=1, tp_size=2)
    keys, payloads = chain(namespace, 4)  # keys built for `namespace`
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        node_b.put(other, keys, payloads)  # B holds none of them: stored (and uploaded) under `other`
        node_b.flush(upload_timeout_s=30)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_a:
        node_a.put(namespace, keys[:2], payloads[:2])
        # The remote has all 4 under `other`, but keys[0] is local under `namespace`: nothing promotable.
        assert node_a.lookup(other, keys) == 0
        assert node_a.lookup(namespace, keys, remote=False) == 2
        assert node_a._tier.check() == []
