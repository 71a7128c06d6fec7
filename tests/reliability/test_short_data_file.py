"""A healthy LMDB file may end before its snapshot's last page.

LMDB counts a page allocated and freed inside one transaction in the
snapshot's page count but never writes it; when that page is the highest
one, ``data.mdb`` is shorter than ``(last_page + 1) x page size``. The open
check must accept such a file (a walk of the snapshot's trees finds no
reachable page past the end) and still refuse a truncated one. A check that
compared the sizes alone refused healthy stores after deletes and puts in
one transaction, the pattern of a put that evicts.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb

import ucm_db
from ucm_db.engines.lmdb.meta import check_file, read_meta_pages
from ucm_db.engines.lmdb.pages import first_reachable_page_past_end

from .harness import NS, chain_tokens, payload_for

BLOCK_BYTES = 20 << 10


def _shortfall_bytes(data: Path) -> int:
    pages, _ = read_meta_pages(data)
    current = max(pages, key=lambda meta: meta.txnid)
    return (current.last_page + 1) * current.page_bytes - data.stat().st_size


def _churn_until_short(env_dir: Path, rng: random.Random, max_rounds: int = 400) -> int:
    """Puts and deletes in the same transactions (in a table of its own)
    until the file ends before its last page; returns the shortfall."""
    env = lmdb.open(str(env_dir), map_size=1 << 30, max_dbs=32, sync=True)
    try:
        table = env.open_db(b"churn-test")
        for _ in range(max_rounds):
            with env.begin(write=True) as txn:
                old = [key for key, _ in txn.cursor(db=table)]
                new = [rng.randbytes(32) for _ in range(rng.randint(1, 200))]
                for key in new:
                    txn.put(key, rng.randbytes(rng.choice([50, 500, 1500])), db=table)
                for key in rng.sample(old + new, min(len(old) + len(new), rng.randint(1, 300))):
                    txn.delete(key, db=table)
            short = _shortfall_bytes(env_dir / "data.mdb")
            if short > 0:
                return short
    finally:
        env.close()
    return 0


def test_a_healthy_file_shorter_than_its_last_page_opens_and_serves(tmp_path: Path) -> None:
    path = tmp_path / "store"
    keys = NS.block_keys(chain_tokens("short-file", 16))
    payloads = [payload_for(key, BLOCK_BYTES) for key in keys]
    with ucm_db.open(path, durability="sync", capacity_bytes=64 << 20) as store:
        store.put(NS, keys, payloads)
    data = path / "lmdb" / "data.mdb"
    short = _churn_until_short(path / "lmdb", random.Random(7))
    assert short > 0, "the churn never left an unwritten tail: the scenario was not reproduced"
    check = check_file(data)
    assert check.ok, check.problem
    assert check.unwritten_tail_bytes == short
    with ucm_db.open(path) as store:
        assert store.lookup(NS, keys) == len(keys)
        assert store.get(NS, keys) == payloads
        store.put(NS, NS.block_keys(chain_tokens("short-file-2", 4)), [b"x" * 100] * 4)


def test_a_truncated_file_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    keys = NS.block_keys(chain_tokens("short-file-cut", 16))
    with ucm_db.open(path, durability="sync", capacity_bytes=64 << 20) as store:
        store.put(NS, keys, [payload_for(key, BLOCK_BYTES) for key in keys])
    data = path / "lmdb" / "data.mdb"
    pages, _ = read_meta_pages(data)
    current = max(pages, key=lambda meta: meta.txnid)
    size = data.stat().st_size
    past_end = first_reachable_page_past_end(
        data, page_bytes=current.page_bytes, last_page=current.last_page,
        roots=(current.free_root, current.main_root), file_bytes=size // 2,
    )
    assert past_end is not None and past_end >= size // 2 // current.page_bytes
    os.truncate(data, size // 2)
    check = check_file(data)
    assert not check.ok and "truncated" in check.problem
