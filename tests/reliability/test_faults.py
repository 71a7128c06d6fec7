"""Faults: disk full, file-size limit, map full, remote faults.

* Disk full is real: a small tmpfs mounted by the test (root only; skipped
  with the reason otherwise), filled by a filler file to leave a chosen number
  of bytes, so the failure lands on a different write each round. A file-size
  limit (RLIMIT_FSIZE, in a child process) is the second way to make writes
  fail, and needs no privileges.
* Map full: a tiny initial LMDB map must grow; a small capacity must evict.
* Remote faults: the fault-injecting fsspec wrapper (``ucmfault://``) over a
  shared directory and over a real S3 API server (moto on 127.0.0.1):
  errors, timeouts, truncated and bit-flipped reads, a remote that is down.
  Reads turn into misses within the deadline, uploads retry, nothing wrong
  is ever served.
"""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.errors import TierError, UcmDbError

from .harness import NS, chain_tokens, mounted_tmpfs, payload_for, run_child, size_for, tail

SIZE_RANGE = (16 << 10, 256 << 10)


def put_until_error(store: ucm_db.Store, tag: str, limit: int = 10_000) -> tuple[list[bytes], BaseException | None]:
    """Puts single-block chains until one fails; returns acked keys and the error."""
    acked: list[bytes] = []
    for n in range(limit):
        key = NS.block_keys(chain_tokens(f"{tag}-{n}", 1))[0]
        try:
            store.put(NS, [key], [payload_for(key, size_for(key, *SIZE_RANGE))], parent=None)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return acked, exc
        acked.append(key)
    return acked, None


def assert_readable(store: ucm_db.Store, keys: list[bytes]) -> None:
    for start in range(0, len(keys), 64):
        batch = keys[start : start + 64]
        for key, value in zip(batch, store.get(NS, batch)):
            assert value is not None and bytes(value) == payload_for(key, size_for(key, *SIZE_RANGE)), key.hex()
    assert store._tier.check() == []


# -- disk full ---------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", 40) as mount_point:
        yield mount_point


def fill_leaving(mount_point: Path, free_bytes: int) -> Path:
    """A filler file leaving ``free_bytes`` free on ``mount_point``. Where a
    store's background threads (RocksDB's flushes) write while it fills and
    the disk runs full first, the filler is cut back to leave them."""
    filler = mount_point / "filler"
    filler.unlink(missing_ok=True)
    st = os.statvfs(mount_point)
    size = max(0, st.f_bavail * st.f_frsize - free_bytes)
    with open(filler, "wb", buffering=0) as f:
        chunk = bytes(1 << 20)
        try:
            while size > 0:
                size -= f.write(chunk[: min(size, len(chunk))]) or 0
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            f.truncate(max(0, os.fstat(f.fileno()).st_size - free_bytes))
    return filler


@pytest.mark.slow
def test_disk_full_at_many_points_then_recovery(small_tmpfs: Path) -> None:
    """For many amounts of free space the n-th put fails with a TierError;
    every acked block stays readable, the store reopens, and puts work again
    once space is freed."""
    store_path = small_tmpfs / "store"
    store = ucm_db.open(store_path, capacity_bytes=1 << 30, durability="sync", map_size_bytes=8 << 20)
    acked_all: list[bytes] = []
    failing_write: list[int] = []
    try:
        for round_no, free_bytes in enumerate([0, 4 << 10, 16 << 10, 48 << 10, 128 << 10, 300 << 10, 700 << 10, 1500 << 10, 3 << 20]):
            filler = fill_leaving(small_tmpfs, free_bytes)
            acked, error = put_until_error(store, f"full-{round_no}")
            assert isinstance(error, TierError) and isinstance(error, UcmDbError), f"{free_bytes} B free: {error!r}"
            assert error.hint, "the error must say what to do"
            failing_write.append(len(acked) + 1)
            acked_all += acked
            assert_readable(store, acked_all)  # readable while the disk is still full
            filler.unlink()
            more, error = put_until_error(store, f"after-{round_no}", limit=3)
            assert error is None, f"no recovery after freeing space: {error!r}"
            acked_all += more
            # Keep the store small so later rounds fail at their own point.
            doomed = acked_all[: len(acked_all) // 2]
            store.delete(NS, doomed)
            acked_all = acked_all[len(doomed) :]
        store.close()
        store = ucm_db.open(store_path)
        assert_readable(store, acked_all)
    finally:
        store.close()
    assert len(set(failing_write)) >= 3, f"failures should land on different writes: {failing_write}"
    print(f"\ndisk full: failing write per round {failing_write}")


def fsize_child(store_path: Path, limit_bytes: int, out: Path) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    store = ucm_db.open(store_path, capacity_bytes=1 << 30, durability="sync", map_size_bytes=8 << 20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    acked, error = put_until_error(store, f"fsize-{limit_bytes}")
    assert_readable(store, acked)
    out.write_text(json.dumps({"acked": len(acked), "error": type(error).__name__, "is_ucm": isinstance(error, TierError),
                               "message": str(error)}))
    try:
        store.close()
    except UcmDbError:
        pass  # close may fail to flush hit counters on a full file: acceptable


def test_file_size_limit_gives_a_tier_error(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (no privileges needed): the write past the limit fails
    with a TierError, everything acked stays readable, reopening works."""
    outcomes = []
    for limit_bytes in (256 << 10, 1 << 20, 3 << 20):
        store_path = tmp_path / f"store-{limit_bytes}"
        out = tmp_path / f"fsize-{limit_bytes}.json"
        status = run_child(fsize_child, store_path, limit_bytes, out, log_path=tmp_path / "fsize.log", timeout_s=120)
        assert status == 0, tail(tmp_path / "fsize.log")
        report = json.loads(out.read_text())
        assert report["is_ucm"], report
        outcomes.append(report["acked"])
        with ucm_db.open(store_path) as store:
            assert store.stats().blocks == report["acked"] and store._tier.check() == []
    assert outcomes == sorted(outcomes) and outcomes[0] < outcomes[-1], outcomes


# -- map full ---------------------------------------------------------------------
def test_map_full_grows_the_map(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 30, map_size_bytes=1 << 20) as store:
        acked, error = put_until_error(store, "grow", limit=80)
        assert error is None and len(acked) == 80
        assert store._tier.engine._environment().info()["map_size"] > 1 << 20  # type: ignore[attr-defined]
        assert_readable(store, acked)


GROW_THE_MAP = """
import sys, ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
with ucm_db.open(sys.argv[1], capacity_bytes=1 << 30, map_size_bytes=1 << 20) as store:
    for i in range(80):
        key = NS.block_keys(chain_tokens(f"other-{i}", 1))
        store.put(NS, key, [payload_for(key[0], 64 << 10)])
"""


def test_every_read_adopts_a_map_another_process_grew(tmp_path: Path) -> None:
    """Found by the concurrent-load suite: after another process grew the
    map, the free-page count (``ucm-db inspect``) began a bare transaction
    and failed with MDB_MAP_RESIZED where every other read adopts the size."""
    path = tmp_path / "s"
    # durability "sync": no background sync that would adopt the new size first
    with ucm_db.open(path, capacity_bytes=1 << 30, map_size_bytes=1 << 20, durability="sync") as store:
        mine, _ = put_until_error(store, "mine", limit=1)
        # Its own interpreter: LMDB refuses a second open of one file in a process.
        subprocess.run([sys.executable, "-c", GROW_THE_MAP, str(path)], check=True, timeout=120, cwd=Path(__file__).parents[2])
        engine = store._tier.engine
        assert engine.free_page_bytes() is not None  # type: ignore[attr-defined]
        assert engine._environment().info()["map_size"] > 1 << 20  # type: ignore[attr-defined]
        assert_readable(store, mine)


def test_capacity_full_evicts(tmp_path: Path) -> None:
    capacity = 2 << 20
    with ucm_db.open(tmp_path / "s", capacity_bytes=capacity, codec="none") as store:
        acked, error = put_until_error(store, "evict", limit=100)
        assert error is None
        stats = store.stats()
        assert stats.evictions > 0 and stats.stored_bytes <= capacity
        present = [k for k, v in zip(acked, store.get(NS, acked)) if v is not None]
        assert present and present == acked[-len(present) :], "LRU: the newest blocks stay"
        assert_readable(store, present)


# -- remote faults -----------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("moto")
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_target(endpoint: str) -> dict[str, Any]:
    return {"target_protocol": "s3", "target_options": {
        "endpoint_url": endpoint, "key": "testing", "secret": "testing", "anon": False, "skip_instance_cache": True,
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}}}


@pytest.fixture(params=["dir", "s3"])
def faulty_remote(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "dir":
        root = tmp_path / "remote"
        root.mkdir()
        return f"ucmfault://{root}", {"target_protocol": "file"}
    endpoint = request.getfixturevalue("s3_endpoint")
    import fsspec

    bucket = f"rel-{random.randrange(1 << 30)}"
    fsspec.filesystem("s3", **s3_target(endpoint)["target_options"]).mkdir(bucket)
    return f"ucmfault://{bucket}/kv", s3_target(endpoint)


@pytest.mark.s3
@pytest.mark.slow
def test_remote_faults_give_misses_and_retries_never_wrong_bytes(tmp_path: Path, faulty_remote: tuple[str, dict[str, Any]]) -> None:
    from faultfs import FaultPlan, register

    register()
    url, target = faulty_remote
    plan = FaultPlan(write_error_rate=0.3, read_error_rate=0.1, timeout_rate=0.05, timeout_s=0.05,
                     truncate_rate=0.1, bitflip_rate=0.1, seed=7)
    options = {"remote": url, "remote_options": {**target, "plan": plan}, "remote_deadline_s": 0.5,
               "capacity_bytes": 1 << 30}
    chains = [NS.block_keys(chain_tokens(f"remote-{n}", 3)) for n in range(12)]
    with ucm_db.open(tmp_path / "writer", **options) as store:
        for keys in chains:
            store.put(NS, keys, [payload_for(k, size_for(k, 1024, 8192)) for k in keys])
        store.flush(upload_timeout_s=120)  # uploads retry through the write errors
        assert store.stats().pending_uploads == 0
    # A second node with an empty local tier reads through the faulty remote.
    # The breaker skips the remote for a while after a fault: read in rounds.
    served = missed = 0
    with ucm_db.open(tmp_path / "reader", **options) as store:
        # Long enough for a loaded machine (moto answers slowly there and the
        # 0.5 s deadline turns slow reads into misses); the loop ends as soon
        # as every chain is local.
        give_up = time.monotonic() + 20.0
        while time.monotonic() < give_up:
            for keys in chains:
                started = time.monotonic()
                values = store.get(NS, keys)
                assert time.monotonic() - started < 10, "a remote read must not hang"
                for key, value in zip(keys, values):
                    if value is None:
                        missed += 1
                    else:
                        assert bytes(value) == payload_for(key, size_for(key, 1024, 8192)), "wrong bytes from a faulty remote"
                        served += 1
            if store.lookup(NS, chains[-1]) == 3 and all(store._tier.exists(k) == [True] * 3 for k in chains):
                break
            time.sleep(0.1)
        plan.take_down()
        try:
            fresh = NS.block_keys(chain_tokens("remote-down", 2))
            started = time.monotonic()
            assert store.get(NS, fresh) == [None, None]
            assert time.monotonic() - started < 10, "a down remote must not hang reads"
        finally:
            plan.heal()
    assert served > 0, "reads should get through the faults, round after round"
    print(f"\nremote faults ({url.split(':')[0]}): served {served}, missed {missed}")
