"""A process that has listed the remote still sees what other nodes write
after it (real S3 on moto).

fsspec filesystems may keep directory listings, and s3fs answers ``exists``
and ``ls`` from them: an object another node uploaded after this process
listed its directory would read as absent, until the listing is dropped.
``open_filesystem`` turns the listing cache off unless the caller's
``remote_options`` set ``use_listings_cache`` themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from ucm_db import codec
from ucm_db.remote.manifests import list_namespaces
from ucm_db.remote.tier import RemoteRoot, open_filesystem

from .conftest import make_remote

pytestmark = [pytest.mark.timeout(60), pytest.mark.s3]
NS_ID, OTHER_NS_ID = bytes(range(16)), bytes(range(16, 32))


def _blob(key: bytes) -> bytes:
    return codec.encode(key, os.urandom(1000), codec="none")


def _other_node(here: RemoteRoot, options: dict) -> RemoteRoot:
    """The same root through a filesystem of its own, as another host has."""
    return RemoteRoot(fsspec.filesystem("s3", skip_instance_cache=True, **options), here.root)


def test_objects_written_by_another_node_after_a_listing_are_seen(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    remote = make_remote("s3", tmp_path, request)
    here = RemoteRoot.from_url(remote.url, remote.options)
    tier = here.tier(NS_ID)
    first, second = os.urandom(32), os.urandom(32)
    tier.store(first, None, _blob(first))
    assert set(tier.iterate()) == {first}  # lists the namespace's directories
    assert list_namespaces(here).entries == [NS_ID[:8].hex()]
    assert tier.exists([second]) == [False]

    other = _other_node(here, remote.options)
    other.tier(NS_ID).store(second, None, _blob(second))
    other.tier(OTHER_NS_ID).store(first, None, _blob(first))

    assert set(tier.iterate()) == {first, second}
    assert sorted(list_namespaces(here).entries) == sorted([NS_ID[:8].hex(), OTHER_NS_ID[:8].hex()])
    assert here.fs.exists(here.object_path(NS_ID, second))
    assert tier.delete([second]) == 1  # asks exists() first: a cached listing would skip it
    assert not other.fs.exists(other.object_path(NS_ID, second))


def test_a_caller_that_asks_for_the_listing_cache_keeps_it(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    remote = make_remote("s3", tmp_path, request)
    fs, _root = open_filesystem(remote.url, {**remote.options, "use_listings_cache": True})
    assert fs.dircache.use_listings_cache
    fs, _root = open_filesystem(remote.url, remote.options)
    assert not fs.dircache.use_listings_cache
