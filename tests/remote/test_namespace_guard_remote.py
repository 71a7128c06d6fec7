"""A read through the remote never fails on a block it cannot promote
because its key is stored locally under another namespace (issue 26,
item 3): node B stored keys built for NS under NS2 (the remote holds them
under NS2); node A holds them locally under NS. A's lookup, get and
get_into under NS2 neither raise the put's namespace error nor mix the two
namespaces: a get serves such a block without promoting it (docs/api.md,
"Namespaces never mix"). A warm counts only the namespace's own blocks as
already local."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace

from .conftest import Remote, chain

CAP = 64 << 20


def _other() -> Namespace:
    return Namespace(model="test/remote", kv_dtype="bfloat16", block_size=4, layout="test", tp_rank=1, tp_size=2)


def _uploaded_under_other(remote: Remote, tmp_path: Path, keys: list[bytes], payloads: list[bytes]) -> None:
    """Node B stores the keys (built for `namespace`) under the other namespace, and uploads them there."""
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        node_b.put(_other(), keys, payloads)
        node_b.flush(upload_timeout_s=30)


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_read_through_skips_blocks_stored_locally_under_another_namespace(remote: Remote, tmp_path: Path, namespace) -> None:
    other = _other()
    keys, payloads = chain(namespace, 4)  # keys built for `namespace`
    _uploaded_under_other(remote, tmp_path, keys, payloads)  # B holds none of them under `namespace`
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_a:
        node_a.put(namespace, keys[:2], payloads[:2])
        # The remote has all 4 under `other`, but keys[0] is local under `namespace`: nothing promotable.
        assert node_a.lookup(other, keys) == 0
        assert node_a.lookup(namespace, keys, remote=False) == 2
        assert node_a._tier.check() == []


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_get_and_get_into_serve_remote_blocks_they_cannot_promote(remote: Remote, tmp_path: Path, namespace) -> None:
    """Audit U4: only the lookup was checked. No lookup runs first here: each read meets the refusal itself."""
    keys, payloads = chain(namespace, 4)
    _uploaded_under_other(remote, tmp_path, keys, payloads)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_a:
        node_a.put(namespace, keys[:2], payloads[:2])
        assert node_a.get(_other(), keys) == payloads, "served from the remote"
        assert node_a.stats().blocks == 2, "not promoted: keys[0] is local under `namespace`"
        buffers = [bytearray(len(p)) for p in payloads]
        assert node_a.get_into(_other(), keys, buffers) == [True] * 4
        assert [bytes(b) for b in buffers] == payloads
        assert node_a.stats().blocks == 2
        assert node_a.lookup(_other(), keys, remote=False) == 0
        assert node_a.lookup(namespace, keys, remote=False) == 2
        assert node_a._tier.check() == []


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_warm_counts_only_the_namespace_s_own_blocks_as_already_local(remote: Remote, tmp_path: Path, namespace) -> None:
    """Audit F10: warm(other, keys stored under `namespace`) reported them already local while lookup found 0."""
    keys, payloads = chain(namespace, 4)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        report = store.warm(_other(), keys=[keys])
        assert (report.already_local, report.fetched, report.missing) == (0, 0, 4)
        assert store.lookup(_other(), keys) == 0
        assert store.warm(namespace, keys=keys).already_local == 4
        assert store.stats().blocks == 4 and store._tier.check() == []
