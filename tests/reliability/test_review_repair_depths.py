"""Review of `verify --fix`'s depth rewrite (commit 788643b) beside pins.

A pin walks from its block up to the root while each parent's depth is
one less than its child's (:mod:`ucm_db.index.pins`): a pin made while a
block's depth is altered stops below that block, and its records count
only the blocks below. `--fix` now rewrites the depth, after which the pin
audit walks through the block and counts pins the records do not hold:
the pins are rebuilt only where the *first* check named a pin or counter
problem, which it could not (they agreed then). So the second `verify`,
which the commit promises clean, exits 1, and the chain's first blocks
stay unpinned under a pinned tail until another `--fix`.

The depth rewrite also judges only the blocks the scan before it found
wrong: a live writer's child put under such a block between the scan and
its rewrite takes the old (wrong) depth plus one and keeps it, so a
`--fix` beside live writers again leaves a second `verify` a depth problem
(a pin walk stops there). The writer is a real process; to make the
interleaving exact it is run from a hook on
:func:`~ucm_db.maintenance.verification.expected_depths` (called by the
rewrite right after its scan): the one stand-in here, for a window a few
milliseconds wide that a free-running writer hits only by chance.

The altered depth is written through the engine's raw tables (its LRU
entry moved with it, so the depth is the one damage). The CLI runs as a
real subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.engines.base import Txn
from ucm_db.index.entries import BlockMeta, lru_key
from ucm_db.maintenance import repair, verification, verify
from ucm_db.migrations.access import open_engine

from .harness import NS, chain_tokens, payload_for


def cli_json(*args: Any) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args), "--json"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


ROOT = Path(__file__).resolve().parents[2]


def alter_depth(path: Path, key: bytes, depth: int) -> None:
    """``key``'s depth set to ``depth`` in its record, its LRU entry moved with it."""
    def run(txn: Txn) -> None:
        meta = BlockMeta.unpack(txn.get("meta", key))
        txn.delete("lru", lru_key(meta.access_ns, meta.depth, key))
        meta.depth = depth
        txn.put("meta", key, meta.pack())
        txn.put("lru", lru_key(meta.access_ns, meta.depth, key), b"")
    engine = open_engine(path)
    try:
        engine.write(run)
    finally:
        engine.close()


def test_a_pin_made_across_an_altered_depth_is_consistent_after_fix(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("review-pinned-depth", 4))
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    alter_depth(path, keys[1], 7)
    with ucm_db.open(path) as store:
        store.pin(NS, keys)  # the walk stops below keys[1]: keys[2:] pinned

    code, found = cli_json("verify", path)
    assert code == 1 and not any("pin/" in p for p in found["index_problems"]), found
    code, fixed = cli_json("verify", "--fix", path)
    assert fixed["index_repaired"].get("depths_restored") == 1, fixed
    code, again = cli_json("verify", path)
    assert code == 0 and again["index_problems"] == [], again["index_problems"]


@pytest.mark.multiprocess
def test_a_child_a_live_writer_put_under_a_block_of_wrong_depth_is_rewritten_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "s"
    tokens = chain_tokens("review-live-depth", 3)
    keys = NS.block_keys(tokens)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    alter_depth(path, keys[0], 5)  # a first block's depth altered: it and keys[1] (1, not 5 + 1) are named

    report = verify(path, isolated=True)
    # A live writer continues the same first block with another second block (depth 5 + 1 = 6),
    # after the rewrite's scan and before its write transactions.
    branch = tokens[:NS.block_size] + chain_tokens("review-live-depth-branch", 1)
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
    repair(path, report)
    # keys[0] back to 0, and the writer's second block, put at 5 + 1 under it, back to 1
    assert report.index_repaired.get("depths_restored") == 2, report.index_repaired

    again = verify(path)
    assert again.index_problems == [], again.index_problems
