"""Audit: two real processes creating one store at the same moment, with
different engines. Before the creation lock (``ucm_db.storelock.hold_creation``)
both saw no engine directory, both opened "successfully", and the directory
ended up with ``lmdb/`` *and* ``rocksdb/``: two stores in one path, each
process serving its own (4 of 4 tries on a 2-core host). Now one engine is
created; the other process adopts it or, having asked for the other engine
explicitly, gets the ConfigError an existing store of another engine gives.

The start is synchronised on a wall-clock instant so that both processes
check the directory within a few milliseconds of each other; the assertion
holds whichever wins, so the test cannot pass by luck of ordering alone
(before the fix it failed at the first round)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db

pytest.importorskip("rocksdict")

CHILD = r"""
import json, sys, time
import ucm_db
path, engine, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < start_at:
    pass
try:
    store = ucm_db.open(path, engine=engine)
    print(json.dumps({"opened": store.config.engine}))
    store.close()
except ucm_db.UcmDbError as exc:
    print(json.dumps({"error": type(exc).__name__, "text": str(exc)}))
"""

ROUNDS = 3


def _race(store: Path) -> list[dict[str, str]]:
    start_at = time.time() + 2.0  # both interpreters imported by then
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(store), engine, str(start_at)],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
                for engine in ("lmdb", "rocksdb")]
    outs = [child.communicate(timeout=120)[0] for child in children]
    assert all(child.returncode == 0 for child in children), outs
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_processes_creating_a_store_with_different_engines_leave_one_engine(tmp_path: Path, round_: int) -> None:
    store = tmp_path / "store"
    results = _race(store)
    engines = sorted(name for name in ("lmdb", "rocksdb") if (store / name).is_dir())
    assert len(engines) == 1, (engines, results)
    opened = [r["opened"] for r in results if "opened" in r]
    refused = [r for r in results if "error" in r]
    assert opened and all(engine == engines[0] for engine in opened), results
    assert all(r["error"] == "ConfigError" and "conflicts with the store" in r["text"] for r in refused), results


HOLDER = """
import sys, time, ucm_db
store = ucm_db.open(sys.argv[1], capacity_bytes=1 << 30, durability="sync", codec="none")
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("option", [{"engine": "rocksdb"}, {"capacity_bytes": 2 << 30}, {"durability": "group"},
                                    {"codec": "zstd"}], ids=lambda o: next(iter(o)))
def test_a_second_process_with_other_settings_is_refused_not_adopted(tmp_path: Path, option: dict[str, object]) -> None:
    """Answered: refused, clearly, while another process holds the store
    open: the second open names the conflicting setting and the stored one."""
    store = tmp_path / "s"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(ucm_db.ConfigError, match="conflicts with the store") as raised:
            ucm_db.open(store, **option)
        assert "omit" in raised.value.hint
        with ucm_db.open(store) as adopted:  # no options: the stored settings
            assert (adopted.config.capacity_bytes, adopted.config.durability, adopted.config.codec) == (1 << 30, "sync", "none")
    finally:
        holder.kill()
        holder.wait()
