"""`ucm-db inspect` figures against a store with known contents."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ucm_db

from cli_stores import BLOCK_BYTES, NS_A, NS_B, invoke, invoke_json, make_store

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "stores"


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_inspect_reports_known_contents(tmp_path: Path, engine: str) -> None:
    chains = make_store(tmp_path / "s", engine=engine)
    with ucm_db.open(tmp_path / "s") as store:
        metas = store._tier.metas([k for keys in chains.values() for k in keys])
    stored = sum(m.stored_bytes for m in metas if m)

    r = invoke_json("inspect", tmp_path / "s", "--top", 2)
    assert r["engine"] == engine and r["format_version"] == ucm_db.STORE_FORMAT_VERSION and r["pending_migrations"] == []
    assert r["blocks"] == 23
    assert r["raw_bytes"] == 23 * BLOCK_BYTES
    assert r["stored_bytes"] == stored
    assert r["compression_ratio"] == pytest.approx(23 * BLOCK_BYTES / stored, rel=1e-3)
    assert 1.5 < r["compression_ratio"] < 3  # half of each payload is zeros
    assert r["capacity_bytes"] == 1 << 30
    assert r["use_fraction"] == pytest.approx(stored / (1 << 30), abs=1e-4)
    assert r["hits"] == 6 and r["misses"] == 0  # two gets of 3 blocks
    assert r["quarantine_records"] == 0 and r["pending_uploads"] == 0 and r["remote"] is None
    assert r["created"]["ucm_db_version"] == ucm_db.__version__
    if engine == "lmdb":  # free pages: within the file, and fewer after compact rewrote it
        assert 0 <= r["file_free_bytes"] < r["file_bytes"]
    else:
        assert r["file_free_bytes"] is None

    rows = {row["model"]: row for row in r["namespaces"]}
    assert rows["test/alpha"]["blocks"] == 20 and rows["test/alpha"]["raw_bytes"] == 20 * BLOCK_BYTES
    assert rows["test/beta"]["blocks"] == 3 and rows["test/beta"]["kv_dtype"] == "float16"
    assert rows["test/beta"]["block_size"] == 8 and rows["test/beta"]["rank"] == "tp 1/2 pp 0/1"
    # Per-rank blocks from before TP-independent units: no connector reads them (docs/tp.md).
    assert rows["test/beta"]["read_at"].startswith("no TP size (per-rank blocks of TP=2 PP=1")
    assert rows["test/alpha"]["read_at"] == "any TP size"
    assert rows["test/beta"]["id"] == NS_B.digest[:16].hex()

    assert sum(r["histograms"]["age_since_last_use"].values()) == 23
    assert r["histograms"]["age_since_last_use"]["< 1 h"] == 0 or r["histograms"]["age_since_last_use"]["< 1 min"] == 23
    # Per-block hits count touches per activity flush (both gets fell in one
    # flush), on the block itself; ancestors are only touched.
    assert r["histograms"]["hits"] == {"0": 20, "1": 3, "2-3": 0, "4-7": 0, "8-15": 0, "16+": 0}
    hottest = r["hottest_chains"]
    assert len(hottest) == 2
    assert hottest[0]["first_block"] == chains["b0"][0].hex()
    assert hottest[0]["hits"] == 3 and hottest[0]["blocks"] == 3 and hottest[0]["longest_blocks"] == 3


def test_inspect_namespace_filter_and_human_output(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    r = invoke_json("inspect", tmp_path / "s", "--namespace", "test/beta")
    assert [row["model"] for row in r["namespaces"]] == ["test/beta"]
    assert r["selected_blocks"] == 3
    assert sum(r["histograms"]["hits"].values()) == 3
    by_prefix = invoke_json("inspect", tmp_path / "s", "--namespace", NS_A.digest[:4].hex())
    assert by_prefix["selected_blocks"] == 20

    text = invoke("inspect", tmp_path / "s").stdout
    assert "test/alpha" in text and "test/beta" in text and "blocks         23" in text and "ratio" in text
    assert "read at" in text and "any TP size" in text and "per-rank blocks of TP=2 PP=1" in text

    bad = invoke("inspect", tmp_path / "s", "--namespace", "nope", expect=2)
    assert "no namespace matches 'nope'" in bad.stderr and "test/alpha" in bad.stderr


def test_inspect_is_read_only(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    before = data.read_bytes()
    invoke("inspect", tmp_path / "s", "--top", 3)
    invoke("verify", tmp_path / "s")
    assert data.read_bytes() == before


def test_inspect_older_format_names_the_migration(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "format1-lmdb", tmp_path / "old")
    r = invoke_json("inspect", tmp_path / "old")
    assert r["format_version"] == 1 and r["pending_migrations"] == ["created_record", "split_heads"] and r["blocks"] == 11
    assert "ucm-db migrate" in invoke("inspect", tmp_path / "old").stdout


def test_inspect_beside_a_live_rocksdb_writer_in_this_process(tmp_path: Path) -> None:
    make_store(tmp_path / "s", engine="rocksdb")
    with ucm_db.open(tmp_path / "s") as store:  # holds RocksDB's LOCK
        store.flush()
        assert invoke_json("inspect", tmp_path / "s")["blocks"] == 23  # read-only open needs no lock


def test_inspect_shows_free_pages_and_suggests_compact_when_most_of_the_file_is_free(tmp_path: Path) -> None:
    ns = ucm_db.Namespace(model="free-pages", kv_dtype="bfloat16", block_size=4)
    keys = ns.block_keys(list(range(4 * 256)))
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put(ns, keys, [bytes([i % 251]) * 65536 for i in range(256)])  # 16 MiB of overflow pages
        store.delete(ns, keys[:1])  # the root takes the chain with it: the pages go to the free list
    before = invoke_json("inspect", tmp_path / "s")
    assert before["blocks"] == 0 and before["file_free_bytes"] >= 16 << 20
    assert "`ucm-db compact" in invoke("inspect", tmp_path / "s").output
    invoke("compact", tmp_path / "s")
    after = invoke_json("inspect", tmp_path / "s")
    assert after["file_free_bytes"] < (1 << 20) and after["file_bytes"] < before["file_bytes"]
    assert "`ucm-db compact" not in invoke("inspect", tmp_path / "s").output


def test_inspect_prints_what_each_namespace_names(tmp_path: Path) -> None:
    """Issue 48: `ucm-db inspect` shows each namespace's identity in plain
    words: the model (a content digest for the connector's), KV dtype, block
    size and the inputs that change the KV (the connector's ``extra``)."""
    import json as json_module

    import ucm_db

    ns = ucm_db.Namespace(model="blake3:" + "ab" * 32, kv_dtype="bfloat16", block_size=16,
                          extra=json_module.dumps({"dtype": "float32", "rope": {"rope_type": "linear", "factor": 2.0}}))
    with ucm_db.open(tmp_path / "s") as store:
        store.put(ns, ns.block_keys(list(range(32))), [b"x" * 64, b"y" * 64])
    out = invoke("inspect", tmp_path / "s").stdout
    line = next(l for l in out.splitlines() if l.strip().startswith(ns.id.hex()[:16]) and "model=" in l)
    assert "model=blake3:" in line and "kv_dtype=bfloat16" in line and "block_size=16" in line
    assert 'dtype="float32"' in line and '"rope_type":"linear"' in line


@pytest.mark.parametrize("fixture", ["format1-lmdb", "format2-lmdb", "format1-rocksdb", "format2-rocksdb"])
def test_verify_of_an_older_format_names_the_migration_and_reports_no_block_corrupt(tmp_path: Path, fixture: str) -> None:
    """verify read an older store's blocks with this format's layout: every block "corrupt: head missing",
    exit 1 (an operator who believed it would delete a good store). RocksDB's read commands said
    "lacks tables heads (hint: open it once for writing)", which fixes nothing."""
    shutil.copytree(FIXTURES / fixture, tmp_path / "old")
    error = invoke_json("verify", tmp_path / "old", expect=2)["error"]
    assert error["type"] == "FormatVersionError" and f"ucm-db migrate {tmp_path / 'old'}" in error["hint"], error
    if fixture.endswith("rocksdb"):
        inspected = invoke_json("inspect", tmp_path / "old", expect=2)["error"]
        assert "older ucm-db" in inspected["message"] and "ucm-db migrate" in inspected["hint"], inspected
    invoke("migrate", tmp_path / "old")
    report = invoke_json("verify", tmp_path / "old")
    assert report["checked"] == 11 and report["corrupt"] == [] and report["index_problems"] == []
