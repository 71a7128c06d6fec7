"""``import`` killed midway, and ``import`` beside a live writer: no finding,
kept as regression tests of what the audit checked.

* An import SIGKILLed between two of its batch commits (the crash point
  ``local.before_commit``, a real ``ucm-db import`` process) leaves a store
  that ``ucm-db verify`` finds clean; running the import again stores the
  rest, reports the first batch as already present, and the store is clean.
* An import with ``--allow-evict`` into a 2 MiB store while another process
  puts chains into it (tests/tools/writer_proc.py) evicts as any put does;
  the store's accounting and index stay consistent (``verify`` clean, stored
  bytes within capacity).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, maintenance

pytestmark = pytest.mark.timeout(300)
NS = Namespace(model="test/archive-audit-processes", kv_dtype="bfloat16", block_size=4)
CHAINS, DEPTH = 100, 4  # 400 blocks: two import batches of at most 256
WRITER = Path(__file__).resolve().parent / "tools" / "writer_proc.py"


def chain(c: int) -> list[bytes]:
    return NS.block_keys([c * 1000 + t for t in range(DEPTH * NS.block_size)])


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "src") as store:
        for c in range(CHAINS):
            store.put(NS, chain(c), [os.urandom(2048) for _ in range(DEPTH)])
    out = tmp_path / "a.tar"
    assert maintenance.export_archive(tmp_path / "src", out)["blocks"] == CHAINS * DEPTH
    return out


def cli(*args: object, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if crash_at is not None:
        env["UCM_DB_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=240)


def verify_clean(path: Path) -> dict[str, Any]:
    result = cli("verify", path, "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["corrupt"] == [] and report["index_problems"] == [], result.stdout
    return report  # type: ignore[no-any-return]


def test_an_import_killed_between_batches_leaves_a_clean_store_and_a_rerun_finishes(archive: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dst"
    ucm_db.open(dest).close()
    killed = cli("import", archive, dest, "--json", crash_at="local.before_commit:2")
    assert killed.returncode == -9, killed.stderr
    first = verify_clean(dest)["checked"]
    assert 0 < first < CHAINS * DEPTH  # killed midway: the first batch committed, the second not

    rerun = cli("import", archive, dest, "--json")
    report = json.loads(rerun.stdout)
    assert rerun.returncode == 0 and report["skipped"] == []
    assert report["already_present"] == first and report["stored"] == CHAINS * DEPTH - first
    assert verify_clean(dest)["checked"] == CHAINS * DEPTH
    with ucm_db.open(dest) as store:
        assert all(store.lookup(NS, chain(c)) == DEPTH for c in range(CHAINS))


def test_an_evicting_import_beside_a_live_writer_keeps_the_store_consistent(archive: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dst"
    ucm_db.open(dest, capacity_bytes=2 << 20).close()
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, str(WRITER), str(dest), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "0"  # the writer is putting
        for _ in range(2):
            report = maintenance.import_archive(archive, dest, allow_evict=True)
            assert report["stored"] + report["already_present"] + len(report["skipped"]) == CHAINS * DEPTH
            assert {s["reason"] for s in report["skipped"]} <= {"parent evicted during import (capacity too small)"}
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert writer.returncode == 0
    verify_clean(dest)
    with ucm_db.open(dest) as store:
        stats = store.stats()
        assert 0 < stats.stored_bytes <= stats.capacity_bytes
