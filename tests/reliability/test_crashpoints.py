"""Crash points inside the code: SIGKILL at exactly chosen steps.

``UCM_DB_CRASH_AT=name:nth`` (see :mod:`ucm_db.crashpoints`) kills a process
the nth time it reaches a named step. Each step is crashed many times at
different ``nth``; afterwards a fresh process checks the same criteria as the
crash loop (acked blocks whole, in-flight blocks absent or whole, reopen
works, the next writer is not blocked) plus: no orphaned index entries
(``LocalTier.check()``), no published-but-missing payloads (every remote
object whole, every queued upload still backed by a local block).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import crashpoints
from ucm_db.errors import ConfigError

from .harness import (
    NS, OracleWriter, chain_tokens, check_store_against_oracle, payload_for, run_child, size_for, tail,
)

SIZE_RANGE = (512, 16384)
OPTIONS: dict[str, Any] = {"capacity_bytes": 1 << 30, "durability": "group", "sync_interval_s": 0.1, "map_size_bytes": 4 << 20}
REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "stores"

pytestmark = [pytest.mark.crash]


def arm(spec: str) -> None:
    """In a child: arm the crash point through the environment variable."""
    os.environ[crashpoints.ENV_VAR] = spec
    crashpoints.reload()


def put_chains(store: ucm_db.Store, oracle: OracleWriter, count: int, tag: str, *, drain_each: bool = False) -> None:
    """Puts ``count`` chains (one or two segments each); ``drain_each``
    waits for the upload queue after every chain, so each chain is at least
    one uploader batch (the remote crash points are reached a known number
    of times, however fast the uploader runs)."""
    for n in range(count):
        n_blocks = random.randint(1, 5)
        keys = NS.block_keys(chain_tokens(f"{tag}-{os.getpid()}-{n}", n_blocks))
        cut = random.randint(1, n_blocks)
        for segment, parent in ((keys[:cut], None), (keys[cut:], keys[cut - 1])):
            if segment:
                oracle.intent(segment)
                store.put(NS, segment, [payload_for(k, size_for(k, *SIZE_RANGE)) for k in segment], parent=parent)
                oracle.ack(segment)
        if drain_each:
            store.flush(upload_timeout_s=60)


def armed_writer(run_dir: Path, store_path: Path, spec: str, options: dict[str, Any]) -> None:
    arm(spec)
    store = ucm_db.open(store_path, **options)
    # With a remote, every chain is drained before the next: "remote.during_upload"
    # is reached once per block and "remote.before_mark_uploaded" at least once
    # per chain, so any nth up to 200 is reached whatever the timing.
    put_chains(store, OracleWriter(run_dir / f"oracle-{os.getpid()}.log"), 200, "armed", drain_each=store.config.remote is not None)
    store.flush(upload_timeout_s=30) if store.config.remote is not None else store.flush()
    raise AssertionError(f"crash point {spec} was never reached")


def checker(run_dir: Path, store_path: Path, options: dict[str, Any], out: Path) -> None:
    with ucm_db.open(store_path, **options) as store:
        _, report = check_store_against_oracle(store, run_dir, size_range=SIZE_RANGE)
        # The next writer after the kill: must not be blocked by the dead one.
        put_chains(store, OracleWriter(run_dir / f"oracle-{os.getpid()}.log"), 3, "after")
        if store.config.remote is not None:
            store.flush(upload_timeout_s=60)
            report.update(remote_report(store))
        report["index_problems"] = store._tier.check()
    out.write_text(json.dumps(report))


def remote_report(store: ucm_db.Store) -> dict[str, Any]:
    """Every local block is on the remote, whole, once the queue drained."""
    tier = store._wing.link.root.tier(NS.digest[:16])  # type: ignore[union-attr]
    keys = list(store._tier.iterate())
    missing = [k.hex() for k in keys if tier.fetch(k) is None]
    return {"remote_checked": len(keys), "remote_missing_or_torn": missing[:10], "pending_uploads": len(store._tier.pending_uploads())}


def crash_and_check(run_dir: Path, spec: str, options: dict[str, Any]) -> dict[str, Any]:
    store_path = run_dir / "store"
    status = run_child(armed_writer, run_dir, store_path, spec, options, log_path=run_dir / "armed.log", timeout_s=120)
    assert status == -9, f"{spec}: expected death by SIGKILL, got status {status}:\n{tail(run_dir / 'armed.log')}"
    out = run_dir / "check.json"
    status = run_child(checker, run_dir, store_path, options, out, log_path=run_dir / "checker.log", timeout_s=120)
    assert status == 0, f"{spec}: reopen/check failed:\n{tail(run_dir / 'checker.log')}"
    report: dict[str, Any] = json.loads(out.read_text())
    problems = {k: report[k] for k in ("lost", "wrong", "unknown", "in_flight_wrong", "index_problems") if report[k]}
    assert not problems, f"{spec}: {problems}"
    return report


@pytest.mark.parametrize("point", ["local.after_payload_write", "local.before_commit"])
def test_local_crash_points(tmp_path: Path, point: str) -> None:
    """Killed inside the write transaction: the batch is lost, nothing else;
    the same store survives 8 such kills in a row."""
    in_flight_present = 0
    for nth in (1, 2, 3, 5, 8, 13, 21, 34):
        report = crash_and_check(tmp_path, f"{point}:{nth}", OPTIONS)
        in_flight_present += report["in_flight_present"]
    # Killed before LMDB's commit: an uncommitted batch never shows up.
    assert in_flight_present == 0
    assert report["acked_checked"] > 0


@pytest.mark.long
@pytest.mark.parametrize("point", ["local.after_payload_write", "local.before_commit"])
def test_local_crash_points_long(tmp_path: Path, point: str) -> None:
    """100 kills per step on one store, at random nth."""
    rng = random.Random()
    for _ in range(100):
        report = crash_and_check(tmp_path, f"{point}:{rng.randint(1, 60)}", OPTIONS)
        assert report["in_flight_present"] == 0


@pytest.mark.long
@pytest.mark.parametrize("point", ["remote.during_upload", "remote.before_mark_uploaded"])
def test_remote_crash_points_long(tmp_path: Path, point: str) -> None:
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    options = {**OPTIONS, "remote": f"file://{remote_dir}", "remote_mode": "write_back"}
    rng = random.Random()
    for _ in range(40):  # reached once per object / at least once per chain: any nth <= 200 is reached
        report = crash_and_check(tmp_path, f"{point}:{rng.randint(1, 30)}", options)
        assert report["remote_missing_or_torn"] == [] and report["pending_uploads"] == 0, report


def test_env_var_arms_a_fresh_interpreter(tmp_path: Path) -> None:
    """The variable works from process start (no reload), as in production."""
    script = (
        "import ucm_db, sys\n"
        "from ucm_db.keys import Namespace\n"
        "ns = Namespace(model='m', kv_dtype='bfloat16', block_size=4)\n"
        "s = ucm_db.open(sys.argv[1], capacity_bytes=1 << 26)\n"
        "for i in range(10):\n"
        "    s.put(ns, ns.block_keys(list(range(i, i + 4))), [bytes(64)])\n"
        "    print('acked', i, flush=True)\n"
    )
    env = {**os.environ, crashpoints.ENV_VAR: "local.before_commit:4"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.split("\n")[-2] == "acked 2"
    with ucm_db.open(tmp_path / "s") as store:
        assert store.stats().blocks == 3 and store._tier.check() == []


def test_malformed_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="NAME:N"):
        crashpoints.parse("local.before_commit")
    with pytest.raises(ConfigError):
        crashpoints.parse("x:0")
    assert crashpoints.parse("a:1, b.c:7") == {"a": 1, "b.c": 7}


@pytest.mark.parametrize("point", ["remote.during_upload", "remote.before_mark_uploaded"])
def test_remote_crash_points(tmp_path: Path, point: str) -> None:
    """Killed while uploading (to a shared directory, ``file://``): objects
    are whole or absent under their final name, the queue resumes in the
    next process and drains completely. Deterministic: the writer drains the
    queue after each chain, so every nth below is reached."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    options = {**OPTIONS, "remote": f"file://{remote_dir}", "remote_mode": "write_back"}
    for nth in (1, 2, 4, 7):
        report = crash_and_check(tmp_path, f"{point}:{nth}", options)
        assert report["remote_missing_or_torn"] == [] and report["pending_uploads"] == 0, report
    temp_left = [p for p in remote_dir.rglob("*") if p.is_file() and p.name.startswith(".tmp-")]
    # A crash during upload may leave a temp file (never under an object's name).
    assert point == "remote.during_upload" or temp_left == []


def compact_child(store_path: Path, spec: str) -> None:
    from ucm_db.maintenance import compact

    arm(spec)
    compact(store_path, target_bytes=None, require_exclusive=False)


@pytest.mark.parametrize("nth", [1, 2])
def test_compaction_switch_crash(tmp_path: Path, nth: int) -> None:
    """Killed just before / just after the file switch: the store opens with
    exactly the blocks it had, whole, and the next compaction finishes."""
    store_path = tmp_path / "store"
    with ucm_db.open(store_path, **OPTIONS) as store:
        put_chains(store, OracleWriter(tmp_path / "oracle-0.log"), 40, "compact")
        store.delete(NS, list(store._tier.iterate())[:30])  # free pages for the compacting copy to drop
        expected = set(store._tier.iterate())
    status = run_child(compact_child, store_path, f"compact.during_switch:{nth}", log_path=tmp_path / "compact.log", timeout_s=120)
    assert status == -9, tail(tmp_path / "compact.log")
    for attempt in range(2):  # check; compact again (must finish); check again
        with ucm_db.open(store_path, **OPTIONS) as store:
            assert set(store._tier.iterate()) == expected
            values = store.get(NS, sorted(expected))
            assert all(v is not None and bytes(v) == payload_for(k, size_for(k, *SIZE_RANGE)) for k, v in zip(sorted(expected), values))
            assert store._tier.check() == []
        if attempt == 0:
            status = run_child(compact_child, store_path, "none:1", log_path=tmp_path / "compact2.log", timeout_s=120)
            assert status == 0, tail(tmp_path / "compact2.log")


def migrate_child(store_path: Path, spec: str) -> None:
    from ucm_db.migrations import migrate

    arm(spec)
    migrate(store_path)


def test_migration_crash(tmp_path: Path) -> None:
    """Killed inside a migration's transaction: the store stays at its old
    format with the same contents, and migrating again succeeds."""
    from ucm_db.migrations.access import open_engine, read_format_version

    source = FIXTURES / "format1-lmdb"
    if not source.is_dir():
        pytest.skip("no format-1 fixture store checked in")
    store_path = tmp_path / "store"
    shutil.copytree(source, store_path)

    def snapshot() -> tuple[int, dict[bytes, bytes]]:
        engine = open_engine(store_path, read_only=True)
        try:
            return read_format_version(engine), engine.read(lambda t: {k: bytes(v) for k, v in t.scan("blocks")})
        finally:
            engine.close()

    version, blocks = snapshot()
    for _ in range(3):
        status = run_child(migrate_child, store_path, "migrate.during_migration:1", log_path=tmp_path / "m.log", timeout_s=120)
        assert status == -9, tail(tmp_path / "m.log")
        assert snapshot() == (version, blocks)
    assert run_child(migrate_child, store_path, "none:1", log_path=tmp_path / "m2.log", timeout_s=120) == 0, tail(tmp_path / "m2.log")
    new_version, new_blocks = snapshot()
    assert new_version > version and new_blocks == blocks
