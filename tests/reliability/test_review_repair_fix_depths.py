"""`verify --fix`'s depth rewrite beside live writers and damaged links (the
fixes of the review of commit 788643b, tests/reliability/test_review_repair_depths.py).

Each rewritten block's children are judged right after it through their
child links (:mod:`ucm_db.index.depths`), a bounded number per write
transaction, the rest carried to the next one; a block is rewritten at
most once (a cycle of damaged links ends).

The live writer is a real process run from a hook on
:func:`~ucm_db.maintenance.verification.expected_depths` (called by the
rewrite right after its scan): the one stand-in, for a window a few
milliseconds wide. Damage is written through the engine's raw tables.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ucm_db
from ucm_db.engines.base import Txn
from ucm_db.index import depths
from ucm_db.index.entries import BlockMeta
from ucm_db.maintenance import repair, verification, verify
from ucm_db.migrations.access import open_engine

from .harness import NS, chain_tokens, payload_for
from .test_review_repair_depths import ROOT, alter_depth

BRANCH_BLOCKS = 6


@pytest.mark.multiprocess
def test_a_long_branch_a_live_writer_hung_under_a_wrong_depth_is_rewritten_across_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "s"
    tokens = chain_tokens("fix-live-depth", 2)
    keys = NS.block_keys(tokens)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    alter_depth(path, keys[0], 5)
    report = verify(path)

    # After the rewrite's scan, a writer hangs a branch of 6 blocks under the first block (depths 6..11).
    branch = tokens[:NS.block_size] + chain_tokens("fix-live-depth-branch", BRANCH_BLOCKS)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import ucm_db
        from tests.reliability.harness import NS, payload_for
        keys = NS.block_keys({branch!r})
        with ucm_db.open({str(path)!r}) as store:
            store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    """)
    real_expected = verification.expected_depths

    def scan_then_writer(metas: dict[bytes, BlockMeta]) -> dict[bytes, int]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return real_expected(metas)
    monkeypatch.setattr(verification, "expected_depths", scan_then_writer)
    monkeypatch.setattr(verification, "MAINTENANCE_CHUNK_KEYS", 2)  # 2 blocks judged a transaction: the walk is carried
    repair(path, report)
    assert report.index_repaired.get("depths_restored") == 1 + BRANCH_BLOCKS, report.index_repaired

    again = verify(path)
    assert again.index_problems == [], again.index_problems
    branch_keys = NS.block_keys(branch)
    with ucm_db.open(path) as store:
        assert store.lookup(NS, branch_keys, remote=False) == len(branch_keys)


def test_a_cycle_of_damaged_links_is_rewritten_once_a_block(tmp_path: Path) -> None:
    """A root of wrong depth whose child links lead into a parent cycle (a
    names c as parent, c names a; each links the other): the walk ends."""
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("fix-depth-cycle", 3))
    root, a, c = keys
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])

    def tangle(txn: Txn) -> tuple[list[bytes], list[bytes]]:
        meta = BlockMeta.unpack(txn.get("meta", a))
        meta.parent = c
        txn.put("meta", a, meta.pack())
        txn.put("children", c + a, b"")
        meta = BlockMeta.unpack(txn.get("meta", root))
        meta.depth = 4
        txn.put("meta", root, meta.pack())
        return depths.restore_in(txn, [root], 50)
    engine = open_engine(path)
    try:
        done, left = engine.write(tangle)
    finally:
        engine.close()
    assert sorted(done) == sorted([root, a, c]) and left == [], (done, left)


def test_a_block_rewritten_in_an_earlier_transaction_is_not_judged_again(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("fix-depth-once", 2))
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    alter_depth(path, keys[1], 9)
    engine = open_engine(path)
    try:
        assert engine.write(lambda txn: depths.restore_in(txn, [keys[1]], 10, {keys[1]})) == ([], [])
        assert engine.write(lambda txn: depths.restore_in(txn, [keys[1]], 10)) == ([keys[1]], [])
    finally:
        engine.close()
