"""gc never takes a live chain for an orphan because one read failed
(audit: a transient error reading one object's head while gc listed the
remote, a ConnectionError or TimeoutError, both OSErrors, made gc take the
object for "not ucm-db's"; its children then had an absent parent, old
enough to be an orphan, and the cascade deleted the whole live subtree under
it, young conversations included, on any run whose rules removed anything).

A real LMDB store writes the chains through to a real ``file://`` directory;
gc reads it through a wrapper that fails the reads of one object's path
(``ucmaudflaky://``): a transient network error on one object, which the
real remotes of the tests cannot be made to produce on a chosen path.

c19c877 made such an error stop gc (TierError) before it removed anything;
review: then one object gc can never read (an archived one:
tests/remote/test_review_gc_bucket.py) stopped every run. Now a failed head
read is read once more at the end of the listing; an object still
unreadable is kept, present with an unknown parent (its children are no
orphans), its namespace loses nothing by rule while the rules would keep
it (it may hang from any object there), it is reported (``unreadable``),
and ``ucm-db gc`` exits 1 naming the likely causes after doing the rest.
Review 3: credentials that may list but not read made that 2N failing
requests before the report; now gc stops (TierError, nothing removed) once
its first ``MAX_FAILED_HEADS`` reads all failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from click.testing import CliRunner

import faultfs
import ucm_db
from ucm_db import maintenance
from ucm_db.errors import TierError
from ucm_db.remote.gc import gc
from ucm_db.remote.gc_listing import MAX_FAILED_HEADS
from ucm_db.keys import Namespace
from ucm_db.remote.tier import RemoteRoot
from ucm_db.tools.cli import cli

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


def other_namespace(tmp_path: Path, remote: Path) -> bytes:
    """A one-block chain 30 days old in another namespace; returns its key."""
    other = Namespace(model="test/audit-gc-read-errors-other", kv_dtype="bfloat16", block_size=4, layout="test")
    key = other.block_keys(list(range(900, 904)))[0]
    with ucm_db.open(tmp_path / "other", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through") as store:
        store.put(other, [key], [b"q" * 400], parent=None)
    path = RemoteRoot.from_url(f"file://{remote}").tier(other.id).path(key)
    os.utime(path, (time.time() - 30 * DAY_S,) * 2)
    return path


def test_a_read_error_on_a_live_object_removes_nothing_under_it(tmp_path: Path) -> None:
    remote, live, stale = written(tmp_path)
    elsewhere = other_namespace(tmp_path, remote)
    url, options = flaky(remote, live[1])
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)  # c19c877: TierError, nothing removed anywhere
    assert report["unreadable"] == 1 and live[1].hex() in report["unreadable_examples"][0]
    assert "injected: connection reset" in report["unreadable_examples"][0] and "storage class" in report["unreadable_hint"]
    assert present(remote, live) == [True] * 4  # before c19c877: [True, True, False, False] (the young block too)
    # live[1] (young) may hang from any object of its namespace: the stale chain there waits ...
    assert present(remote, [stale]) == [True] and report["held_by_rule"] == 1 and "cannot read" in report["held_reason"]
    assert not os.path.exists(elsewhere)  # ... while gc did its work in the other namespace


def test_a_read_that_fails_once_is_read_again_at_the_end_of_the_listing(tmp_path: Path) -> None:
    remote, live, stale = written(tmp_path)
    url, options = flaky(remote, live[1], fail_reads=1)
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert report["unreadable"] == 0 and report["held_by_rule"] == 0, report
    assert present(remote, live) == [True] * 4 and present(remote, [stale]) == [False]


def test_an_unreadable_object_the_rules_remove_is_kept_and_the_rest_goes(tmp_path: Path) -> None:
    """Every object 30 days old: the age rule takes the live chain whole,
    the unreadable object's subtree with it, so its namespace is not held;
    the object itself stays (gc cannot know what it is)."""
    remote, live, stale = written(tmp_path)
    tier = RemoteRoot.from_url(f"file://{remote}").tier(NS.id)
    for key in live:
        os.utime(tier.path(key), (time.time() - 30 * DAY_S,) * 2)
    url, options = flaky(remote, live[1])
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert report["unreadable"] == 1 and report["held_by_rule"] == 0 and report["removed_objects"] == 4, report
    assert present(remote, live) == [False, True, False, False] and present(remote, [stale]) == [False]


def test_dry_run_with_a_read_error_reports_it_and_plans_nothing_under_it(tmp_path: Path) -> None:
    remote, live, _stale = written(tmp_path)
    url, options = flaky(remote, live[2])
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S, dry_run=True)
    assert report["unreadable"] == 1 and report["removed_objects"] == 0, report
    assert present(remote, live) == [True] * 4


def test_the_cli_does_the_rest_and_exits_1_naming_the_causes(tmp_path: Path) -> None:
    remote, live, _stale = written(tmp_path)
    url, options = flaky(remote, live[1])
    flags = [arg for name, value in options.items() for arg in ("--option", f"{name}={value}")]
    result = CliRunner().invoke(cli, ["gc", url, "--older-than", "7d", *flags])
    assert result.exit_code == 1, result.output
    assert "1 unreadable kept" in result.stdout and "could not be read" in result.stderr
    assert "storage class" in result.stderr and "flaky link" in result.stderr


def test_the_cli_says_why_max_bytes_is_not_met(tmp_path: Path) -> None:
    """``--max-bytes 0``: every readable object goes, the unreadable one
    stays, and the human report says the target is not met and why."""
    remote, live, stale = written(tmp_path)
    url, options = flaky(remote, live[1])
    flags = [arg for name, value in options.items() for arg in ("--option", f"{name}={value}")]
    result = CliRunner().invoke(cli, ["gc", url, "--max-bytes", "0", *flags])
    assert result.exit_code == 1, result.output
    assert "bytes over --max-bytes after this run: 1 unreadable objects" in result.stdout, result.stdout
    assert present(remote, live) == [False, True, False, False] and present(remote, [stale]) == [False]


def test_once_the_remote_answers_gc_collects_only_the_stale_chain(tmp_path: Path) -> None:
    remote, live, stale = written(tmp_path)
    url, options = flaky(remote, live[1], fail_reads=0)
    report = maintenance.gc_remote(url, options, older_than_s=7 * DAY_S)
    assert report["removed_objects"] == 1 and report["removed_descendants"] == 0
    assert present(remote, live) == [True] * 4 and present(remote, [stale]) == [False]


def test_a_remote_whose_heads_all_fail_stops_gc_after_the_first_hundred(tmp_path: Path) -> None:
    """Every head read fails (credentials that may list but not read): gc
    stops at :data:`MAX_FAILED_HEADS` failed reads, none succeeding, with
    the TierError it raised before the retry, removing nothing (before:
    two failing reads per object, then a report of every one unreadable)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    keys = NS.block_keys(list(range(4 * (MAX_FAILED_HEADS + 20))))
    with ucm_db.open(tmp_path / "writer", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through") as store:
        store.put(NS, keys, [b"b" * 64] * len(keys))
    url, options = f"{PROTOCOL}://{remote}", {"target_protocol": "file", "fail_suffix": "*", "fail_reads": -1}
    root = RemoteRoot.from_url(url, options)
    with pytest.raises(TierError, match=f"remote {PROTOCOL}://.*none of the first {MAX_FAILED_HEADS} object heads"):
        gc(root, older_than_s=0.0, max_bytes=0, dry_run=False)
    assert root.fs.failed == MAX_FAILED_HEADS  # before: 2 * 120
    with pytest.raises(TierError, match="injected: connection reset") as raised:
        maintenance.gc_remote(url, options, max_bytes=0)
    assert "s3:GetObject" in raised.value.hint and present(remote, keys) == [True] * len(keys)
