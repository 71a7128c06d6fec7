"""`ucm-db verify` finds exactly the blocks a test corrupted; --fix
quarantines them (with descendants); without --fix nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db.migrations.access import open_engine

from cli_stores import NS_A, invoke, invoke_json, make_store


def corrupt(path: Path, keys: list[bytes], *, offset: int = -5) -> None:
    """Flips one byte of each stored blob (length unchanged)."""
    engine = open_engine(path)
    try:
        def run(txn: object) -> None:
            for key in keys:
                blob = bytearray(txn.get("blocks", key))  # type: ignore[attr-defined]
                blob[offset] ^= 0x40
                txn.put("blocks", key, bytes(blob))  # type: ignore[attr-defined]
        engine.write(run)
    finally:
        engine.close()


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_verify_finds_exactly_the_corrupted_blocks(tmp_path: Path, engine: str) -> None:
    chains = make_store(tmp_path / "s", engine=engine)
    bad = [chains["a1"][4], chains["a2"][1], chains["b0"][0]]
    assert invoke_json("verify", tmp_path / "s")["corrupt"] == []
    corrupt(tmp_path / "s", bad[:2])
    corrupt(tmp_path / "s", bad[2:], offset=40)  # inside the header: the owning key

    r = invoke_json("verify", tmp_path / "s", expect=1)
    assert r["checked"] == 23
    assert sorted(c["key"] for c in r["corrupt"]) == sorted(k.hex() for k in bad)
    assert r["index_problems"] == [] and r["quarantined_blocks"] == 0
    text = invoke("verify", tmp_path / "s", expect=1).stdout
    assert "3 corrupt" in text and "--fix" in text

    with ucm_db.open(tmp_path / "s") as store:  # verify wrote nothing: still there
        assert store.stats().blocks == 23 and store.stats().quarantined == 0


def test_verify_fix_quarantines_corrupt_blocks_and_descendants(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "s")
    corrupt(tmp_path / "s", [chains["a1"][3]])
    r = invoke_json("verify", tmp_path / "s", "--fix", expect=1)
    assert [c["key"] for c in r["corrupt"]] == [chains["a1"][3].hex()]
    assert r["quarantined_blocks"] == 2  # the block and its one descendant
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS_A, chains["a1"]) == 3
        assert chains["a1"][3] in store._tier.quarantine_records()
    assert invoke_json("verify", tmp_path / "s")["checked"] == 21


def test_verify_sample_checks_that_many(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    r = invoke_json("verify", tmp_path / "s", "--sample", 5)
    assert r["checked"] == 5 and r["corrupt"] == []
