"""`ucm-db migrate --to-engine` refuses a store open elsewhere and a
destination inside the source, and a killed conversion leaves no DEST that
opens as a store (issue 26, item 20)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance

from cli_stores import NS_A, invoke, invoke_json, make_store, payload

REPO = Path(__file__).resolve().parents[2]

# A real conversion in a child process that stops (sleeps) at its first
# progress report, after the copy has written every table: the parent
# SIGKILLs it there, mid-conversion, before verification and the rename.
PAUSED_CONVERSION = """
import sys, time
from pathlib import Path
from ucm_db.maintenance import convert_engine as convert

def pause(done, total):
    Path(sys.argv[3]).write_text(f"{done}/{total}")
    time.sleep(120)

convert(sys.argv[1], sys.argv[2], "rocksdb", progress=pause)
"""


# A process that keeps the store open until its stdin closes.
HOLDER = """
import sys, ucm_db
store = ucm_db.open(sys.argv[1])
print("open", flush=True)
sys.stdin.read()
store.close()
"""


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def test_conversion_refuses_a_store_open_in_another_process(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s")], env=child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        result = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "rocks", expect=2)
    finally:
        holder.communicate("")
    assert "cannot convert" in result.stderr and f"is open in pid {holder.pid}" in result.stderr
    assert not (tmp_path / "rocks").exists()
    assert invoke_json("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "rocks")["blocks_verified"] == 23


@pytest.mark.parametrize("inside", ["sub", "lmdb/sub", "."])
def test_conversion_refuses_a_destination_inside_the_source(tmp_path: Path, inside: str) -> None:
    make_store(tmp_path / "s")
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "s").rglob("*"))
    result = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "s" / inside, expect=2)
    assert "inside the source store" in result.stderr or "is not empty" in result.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "s").rglob("*")) == before


def test_conversion_into_an_empty_directory_and_through_a_symlink_inside(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    (tmp_path / "link").symlink_to(tmp_path / "s")
    result = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "link" / "sub", expect=2)
    assert "inside the source store" in result.stderr
    (tmp_path / "empty").mkdir()
    assert invoke_json("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "empty")["blocks_verified"] == 23
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "s"]  # no temp directory left


@pytest.mark.parametrize("points_to", ["empty-dir", "nowhere"])
def test_conversion_refuses_a_destination_that_is_a_symlink(tmp_path: Path, points_to: str) -> None:
    """A DEST symlink (to an empty directory, or dangling) ended in a raw
    NotADirectoryError from the final rename; it is refused up front, the
    link and what it points to left as they were."""
    make_store(tmp_path / "s")
    if points_to == "empty-dir":
        (tmp_path / points_to).mkdir()
    (tmp_path / "link").symlink_to(tmp_path / points_to)
    result = invoke("migrate", "--to-engine", "rocksdb", tmp_path / "s", tmp_path / "link", expect=2)
    assert "is a symlink" in result.stderr and str(tmp_path / points_to) in result.stderr, result.stderr
    assert os.readlink(tmp_path / "link") == str(tmp_path / points_to)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s", "link"] + (["empty-dir"] if points_to == "empty-dir" else []))
    if points_to == "empty-dir":
        assert not any((tmp_path / points_to).iterdir())


def test_a_killed_conversion_leaves_no_destination_store(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "s")
    dest, marker = tmp_path / "rocks", tmp_path / "paused"
    child = subprocess.Popen([sys.executable, "-c", PAUSED_CONVERSION, str(tmp_path / "s"), str(dest), str(marker)],
                             env=child_env())
    try:
        while not marker.exists():  # the child reports progress once its copy is written
            assert child.poll() is None, "the conversion ended before pausing"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()

    assert not dest.exists()
    with pytest.raises(ucm_db.ConfigError, match="no ucm-db store"):
        maintenance.inspect(dest)
    # The source is whole and free again; a new conversion succeeds beside the leftover temp directory.
    assert invoke_json("migrate", "--to-engine", "rocksdb", tmp_path / "s", dest)["blocks_verified"] == 23
    with ucm_db.open(dest) as store:
        assert store.get(NS_A, chains["a1"]) == [bytearray(payload("a1", i)) for i in range(5)]


def test_a_sync_store_converted_to_lmdb_keeps_no_sync_record(tmp_path: Path) -> None:
    """The copy into LMDB runs as a group writer, which keeps a sync record;
    left in a converted ``sync`` store, its sync commits kept moving it, and
    a failure to move it could roll fsynced puts back after an OS crash."""
    source = tmp_path / "s"
    keys = NS_A.block_keys(list(range(8 * NS_A.block_size)))
    with ucm_db.open(source, engine="rocksdb", durability="sync", codec="none") as store:
        store.put(NS_A, keys, [payload("c", i) for i in range(len(keys))])
    maintenance.convert_engine(source, tmp_path / "d", "lmdb")
    record = tmp_path / "d" / "lmdb" / "synced-snapshot"
    assert not list(record.parent.glob("synced-snapshot*"))
    with ucm_db.open(tmp_path / "d") as store:
        assert store.config.durability == "sync" and store.lookup(NS_A, keys) == len(keys)
        store.put(NS_A, NS_A.block_keys(list(range(1000, 1000 + NS_A.block_size))), [payload("c", 99)])
    assert not list(record.parent.glob("synced-snapshot*"))
