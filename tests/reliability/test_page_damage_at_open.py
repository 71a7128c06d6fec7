"""A damaged LMDB page present when a store is opened never kills the process.

Issue 26 item 8: one zeroed leaf page of the LRU table made a process that
read a store and then wrote to it die of SIGSEGV/SIGABRT (an LMDB assertion
or a wild pointer), while ``inspect`` called the store healthy. The damage is
made for real (a reachable leaf page of ``data.mdb`` zeroed in a copy of a
store); the open, the reads and the put run in a subprocess, which must end
with a :class:`~ucm_db.DamagedPageError` (a TierError) at open, never by a signal.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

import ucm_db
from ucm_db.engines.lmdb.meta import check_file
from ucm_db.engines.lmdb.pages import _Walker
from ucm_db.tools.cli import cli

from .harness import NS, chain_tokens, payload_for

CHAINS, BLOCKS = 20, 8
LRU_KEY_BYTES = 44  # access time (8) + sequence (4) + block key (32), no value
_PAGE_HEAD = struct.Struct("<QHHHH")
_NODE_HEAD = struct.Struct("<HHHH")

READER = r"""
import sys
import ucm_db
from tests.reliability.harness import NS, chain_tokens
try:
    with ucm_db.open(sys.argv[1]) as store:
        for chain in range(int(sys.argv[2])):
            keys = NS.block_keys(chain_tokens(f"chain-{chain}", int(sys.argv[3])))
            try:
                store.lookup(NS, keys)
                store.get(NS, keys)
            except ucm_db.UcmDbError:
                pass
        store.put(NS, NS.block_keys(chain_tokens("new", 2)), [b"x" * 4000] * 2)
    print("served")
except ucm_db.DamagedPageError as exc:  # docs/api.md names it: a public name (audit F9: an AttributeError here)
    print("refused:", exc)
except ucm_db.TierError as exc:
    print("another TierError:", type(exc).__name__, exc)
"""


def _store(path: Path) -> Path:
    with ucm_db.open(path, durability="sync", capacity_bytes=64 << 20) as store:
        for chain in range(CHAINS):
            keys = NS.block_keys(chain_tokens(f"chain-{chain}", BLOCKS))
            store.put(NS, keys, [payload_for(k, 300) for k in keys])
    return path / "lmdb" / "data.mdb"


def _reachable_lru_leaves(data: Path) -> list[int]:
    """The reachable leaf pages of the LRU table, in key order."""
    meta = check_file(data).current
    assert meta is not None
    fd = os.open(data, os.O_RDONLY)
    try:
        walker = _Walker(fd, meta.page_bytes, data.stat().st_size // meta.page_bytes, meta.last_page)
        walker.walk([meta.main_root])
    finally:
        os.close(fd)
    raw = data.read_bytes()
    found = []
    for pgno in walker.seen:
        page = raw[pgno * meta.page_bytes:(pgno + 1) * meta.page_bytes]
        _, _, flags, lower, _ = _PAGE_HEAD.unpack_from(page)
        if flags != 0x02 or lower <= 16:  # P_LEAF with nodes
            continue
        (offset,) = struct.unpack_from("<H", page, 16)
        lo, hi, _, key_bytes = _NODE_HEAD.unpack_from(page, offset)
        if key_bytes == LRU_KEY_BYTES and lo | hi << 16 == 0:
            found.append((page[offset + 8:offset + 8 + key_bytes], pgno))
    return [pgno for _, pgno in sorted(found)]


def test_zeroed_leaf_page_is_refused_at_open_never_a_signal(tmp_path: Path) -> None:
    data = _store(tmp_path / "store")
    leaves = _reachable_lru_leaves(data)
    assert len(leaves) >= 3, "the LRU table must span several leaf pages"
    page_bytes = check_file(data).current.page_bytes  # type: ignore[union-attr]
    with open(data, "r+b") as f:  # the second leaf: reached by a cursor from the first (an LMDB assertion)
        f.seek(leaves[1] * page_bytes)
        f.write(bytes(page_bytes))
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "store"), str(CHAINS), str(BLOCKS)],
                          capture_output=True, text=True, timeout=120, cwd=repo, check=False)
    assert done.returncode >= 0, f"the serving process died of signal {-done.returncode}:\n{done.stderr[-2000:]}"
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "damaged pages" in done.stdout, done.stdout
    assert "move" in done.stdout and "aside" in done.stdout, "the error names the fix"
    # inspect reports what verify reports: both exit 1 naming the damage.
    for command in ("verify", "inspect"):
        result = CliRunner().invoke(cli, [command, str(tmp_path / "store")])
        assert result.exit_code == 1, (command, result.output)
        assert "damaged pages" in result.output, (command, result.output)


def test_intact_store_opens_after_the_check_and_forks_do_not_check_again(tmp_path: Path) -> None:
    _store(tmp_path / "store")
    with ucm_db.open(tmp_path / "store") as store:
        assert store.lookup(NS, NS.block_keys(chain_tokens("chain-3", BLOCKS))) == BLOCKS
        assert store._tier.engine._check_pages is False  # type: ignore[attr-defined]
