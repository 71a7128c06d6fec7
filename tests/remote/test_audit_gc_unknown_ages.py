"""gc never takes an object whose age it cannot read for an old one (audit:
an object whose listing gave no time it knew, as fsspec's WebHDFS
(``modificationTime``, in ms) and FTP (``modify``, ``YYYYMMDDHHMMSS``) give
theirs, counted as written in 1970: ``gc --older-than 7d`` removed every
object of such a remote, conversations written a second before included).

Now those two forms are read, and an object of unknown age counts as young
(as it already did for the orphan rule): kept by ``--older-than``, taken
last by ``--max-bytes``. A real LMDB store writes through to a real
``file://`` directory; gc lists it through a wrapper whose listing states
times as such a backend does (``ucmaudtimes://``): no WebHDFS or FTP server
runs here, so their listings are imitated, the one thing mocked.
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
from ucm_db.keys import Namespace
from ucm_db.remote.tier import RemoteRoot

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/audit-gc-unknown-ages", kv_dtype="bfloat16", block_size=4, layout="test")
DAY_S = 86400.0
PROTOCOL = "ucmaudtimes"
_TIME_KEYS = ("mtime", "created", "LastModified", "last_modified", "updated", "ctime", "atime")


class BackendTimesFileSystem(faultfs.FaultyFileSystem):  # type: ignore[misc]
    """``ucmfault://`` over a directory whose listing states times as
    ``style`` does: ``webhdfs`` (modificationTime, ms), ``ftp`` (modify,
    UTC digits) or ``none`` (no time at all)."""

    protocol = (PROTOCOL,)
    cachable = False

    def __init__(self, style: str = "none", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.style = style

    def _restate(self, info: dict[str, Any]) -> dict[str, Any]:
        mtime_s = float(info.get("mtime", 0))
        out = {k: v for k, v in info.items() if k not in _TIME_KEYS}
        if self.style == "webhdfs":
            out["modificationTime"] = int(mtime_s * 1000)
        elif self.style == "ftp":
            out["modify"] = time.strftime("%Y%m%d%H%M%S", time.gmtime(mtime_s))
        return out

    def find(self, path: str, **kwargs: Any) -> Any:
        found = super().find(path, **kwargs)
        return {p: self._restate(i) for p, i in found.items()} if isinstance(found, dict) else found

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._restate(super().info(path, **kwargs))


fsspec.register_implementation(PROTOCOL, BackendTimesFileSystem, clobber=True)


def written(tmp_path: Path) -> tuple[Path, list[bytes], bytes]:
    """A young chain (3 blocks, written now) and a stale one (30 days)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    young = NS.block_keys(list(range(12)))
    stale = NS.block_keys(list(range(500, 504)))
    with ucm_db.open(tmp_path / "w", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through") as store:
        store.put(NS, young, [bytes([i]) * 400 for i in range(len(young))])
        store.put(NS, stale, [b"s" * 400])
    old_s = time.time() - 30 * DAY_S
    os.utime(RemoteRoot.from_url(f"file://{remote}").tier(NS.id).path(stale[0]), (old_s, old_s))
    return remote, young, stale[0]


def present(remote: Path, keys: list[bytes]) -> list[bool]:
    tier = RemoteRoot.from_url(f"file://{remote}").tier(NS.id)
    return [os.path.exists(tier.path(k)) for k in keys]


@pytest.mark.parametrize("style", ["webhdfs", "ftp"])
def test_the_times_webhdfs_and_ftp_list_are_read(tmp_path: Path, style: str) -> None:
    remote, young, stale = written(tmp_path)
    report = maintenance.gc_remote(f"{PROTOCOL}://{remote}", {"target_protocol": "file", "style": style}, older_than_s=7 * DAY_S)
    assert report["removed_objects"] == 1  # before: 4, the young chain too
    assert present(remote, young) == [True] * 3 and present(remote, [stale]) == [False]


def test_objects_of_unknown_age_are_never_old(tmp_path: Path) -> None:
    remote, young, stale = written(tmp_path)
    url, options = f"{PROTOCOL}://{remote}", {"target_protocol": "file", "style": "none"}
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert report["removed_objects"] == 0 and present(remote, young + [stale]) == [True] * 4  # before: all 4 removed
    report = maintenance.gc_remote(url, options, max_bytes=1)  # the size rule still works, on what it must take
    assert report["removed_objects"] == 4
