"""gc never takes a live chain for an orphan because one read failed
(audit: a transient error reading one object's head while gc listed the
remote, a ConnectionError or TimeoutError, both OSErrors, made gc take the
object for "not ucm-db's"; its children then had an absent parent, old
enough to be an orphan, and the cascade deleted the whole live subtree under
it, young conversations included, on any run whose rules removed anything).

A real LMDB store writes the chains through to a real ``file://`` directory;
gc reads it through a wrapper that fails the reads of one object's path
(``ucmaudflaky://``): a transient network error on one object, which the
real remotes of the tests cannot be made to produce on a chosen path. Now
such an error stops gc before it removes anything (a ``TierError`` naming
the remote), and the next run, once the remote answers, collects as usual.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

import faultfs
import ucm_db
from ucm_db import maintenance
from ucm_db.errors import TierError
from ucm_db.keys import Namespace
from ucm_db.remote.tier import RemoteRoot

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/audit-gc-read-errors", kv_dtype="bfloat16", block_size=4, layout="test")
DAY_S = 86400.0
PROTOCOL = "ucmaudflaky"


class FlakyPathFileSystem(faultfs.FaultyFileSystem):  # type: ignore[misc]
    """``ucmfault://`` whose reads of paths ending in ``fail_suffix`` (``*``:
    of every object, a name of 64 characters) raise ``ConnectionError``
    (``fail_reads`` times; -1: always)."""

    protocol = (PROTOCOL,)
    cachable = False

    def __init__(self, fail_suffix: str = "", fail_reads: int | str = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_suffix = fail_suffix
        self.fail_reads = int(fail_reads)  # a CLI --option gives a string
        self.failed = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        name = str(path).rsplit("/", 1)[-1]
        hit = len(name) == 64 if self.fail_suffix == "*" else bool(self.fail_suffix) and name.endswith(self.fail_suffix)
        if hit and self.fail_reads != 0:
            self.fail_reads -= 1
            self.failed += 1
            raise ConnectionError("injected: connection reset reading one object")
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation(PROTOCOL, FlakyPathFileSystem, clobber=True)


def written(tmp_path: Path) -> tuple[Path, list[bytes], bytes]:
    """A live chain of 4 blocks (three uploaded 2 h ago, its last block now)
    and a stale one-block chain 30 days old; returns the remote directory,
    the live chain's keys and the stale key."""
    remote = tmp_path / "remote"
    remote.mkdir()
    live = NS.block_keys(list(range(16)))
    stale = NS.block_keys(list(range(500, 504)))
    with ucm_db.open(tmp_path / "writer", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through") as store:
        store.put(NS, live, [bytes([i]) * 400 for i in range(len(live))])
        store.put(NS, stale, [b"s" * 400])
    tier = RemoteRoot.from_url(f"file://{remote}").tier(NS.id)
    now_s = time.time()
    for key, mtime_s in [(live[0], now_s - 7200), (live[1], now_s - 7200), (live[2], now_s - 7200), (stale[0], now_s - 30 * DAY_S)]:
        os.utime(tier.path(key), (mtime_s, mtime_s))
    return remote, live, stale[0]


def present(remote: Path, keys: list[bytes]) -> list[bool]:
    tier = RemoteRoot.from_url(f"file://{remote}").tier(NS.id)
    return [os.path.exists(tier.path(k)) for k in keys]


def flaky(remote: Path, key: bytes, fail_reads: int = -1) -> tuple[str, dict[str, Any]]:
    return f"{PROTOCOL}://{remote}", {"target_protocol": "file", "fail_suffix": key.hex(), "fail_reads": fail_reads}


def test_a_read_error_on_a_live_object_removes_nothing_under_it(tmp_path: Path) -> None:
    remote, live, stale = written(tmp_path)
    url, options = flaky(remote, live[1])
    with pytest.raises(TierError, match="injected: connection reset") as caught:
        maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert "rerun" in caught.value.hint
    assert present(remote, live) == [True] * 4  # before: [True, True, False, False] (the young block too)
    assert present(remote, [stale]) == [True]  # nothing removed on a run that could not read the remote


def test_dry_run_with_a_read_error_also_fails_rather_than_report_a_wrong_plan(tmp_path: Path) -> None:
    remote, live, _stale = written(tmp_path)
    url, options = flaky(remote, live[2])
    with pytest.raises(TierError):
        maintenance.gc_remote(url, options, older_than_s=7 * DAY_S, dry_run=True)
    assert present(remote, live) == [True] * 4


def test_once_the_remote_answers_gc_collects_only_the_stale_chain(tmp_path: Path) -> None:
    remote, live, stale = written(tmp_path)
    url, options = flaky(remote, live[1], fail_reads=0)
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert report["removed_objects"] == 1 and report["removed_descendants"] == 0
    assert present(remote, live) == [True] * 4 and present(remote, [stale]) == [False]
