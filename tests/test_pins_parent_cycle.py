"""A parent cycle in block metadata (a record naming its own descendant as
parent: the ``meta`` table has no checksum) never hangs a pin, an unpin or
the pins' check: each walk to the ancestors must see the depth fall by one
a step, so it ends at the link that breaks that (before, ``pin`` looped
forever holding the writer lock). The index check names that link (a depth
that is not the parent's plus one), ``verify --fix`` quarantines the cycle,
and neither ``verify --fix``'s link restore nor a put continuing the chain
writes the child link that would close the cycle in ``children``. Real
LMDB and RocksDB stores; every operation that could hang runs in a child
process under a timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.index.entries import PIN_PREFIX, BlockMeta

NS = ucm_db.Namespace(model="pins-parent-cycle", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(16))  # 4 blocks: a, b, c, d
ROOT = Path(__file__).resolve().parent.parent
#: Seconds a child may take; the hang this guards against never ends.
TIMEOUT_S = 60


@pytest.fixture(params=["lmdb", "rocksdb"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    return str(request.param)


def _cyclic_store(path: Path, engine: str) -> ucm_db.BlockKeys:
    """A store of one 4-block chain a-b-c-d whose root ``a`` names ``c``
    (its grandchild) as parent: a -> c -> b -> a by the metadata."""
    keys = NS.block_keys(TOKENS)
    with ucm_db.open(path, engine=engine, check_on_open="none") as store:
        store.put(NS, keys, [bytes([i]) * 64 for i in range(4)])

        def damage(txn: object) -> None:
            meta = BlockMeta.unpack(bytes(txn.get("meta", keys[0])))  # type: ignore[attr-defined]
            meta.parent = keys[2]
            txn.put("meta", keys[0], meta.pack())  # type: ignore[attr-defined]

        store._engine.write(damage)
    return keys


def _in_child(path: Path, engine: str, body: str) -> dict[str, object]:
    """Runs ``body`` (``store``, ``keys``, ``NS`` in scope; it sets ``out``)
    in a fresh interpreter on the store; its ``out`` as JSON."""
    code = textwrap.dedent(f"""
        import json, sys, ucm_db
        NS = ucm_db.Namespace(model="pins-parent-cycle", kv_dtype="bfloat16", block_size=4)
        keys = NS.block_keys({TOKENS!r})
        out = {{}}
        with ucm_db.open({str(path)!r}, engine={engine!r}, check_on_open="none") as store:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + "\nprint(json.dumps(out))\n"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for over {TIMEOUT_S} s on a parent cycle:\n{body}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_pin_and_unpin_end_on_a_parent_cycle_and_keep_the_pin_records_consistent(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    _cyclic_store(path, engine)
    out = _in_child(path, engine, """
        report = store.pin(NS, keys)
        out["pinned"] = [report.chains[0], report.changed_blocks]
        out["pin_problems"] = [p for p in store._tier.check() if "pin" in p]
        out["second"] = store.pin(NS, keys[:3]).changed_blocks
        out["unpinned"] = [store.unpin(NS, keys).changed_blocks, store.unpin(NS, keys[:3]).changed_blocks]
        out["left"] = store._engine.read(lambda txn: len(list(txn.scan("info", b"pin/"))))
    """)
    # Pinned at d: d, c, b, a (its walk ends at a, whose parent c has depth 2, not -1).
    assert out["pinned"] == [4, 4]
    assert out["pin_problems"] == []  # the check walks the same way, so it agrees with the records
    assert out["second"] == 0  # c and its ancestors were pinned already
    assert out["unpinned"] == [1, 3]  # each chain's unpin takes its own pin: d's, then c's (and b, a above it)
    assert out["left"] == 0


def test_the_check_names_the_link_and_verify_fix_quarantines_the_cycle_without_closing_it(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    keys = _cyclic_store(path, engine)
    with ucm_db.open(path, engine=engine, check_on_open="none") as store:
        problems = store._tier.check()
        assert f"block {keys[0].hex()[:16]}: depth is not its parent's plus one (a parent cycle or altered metadata) " \
               "(depth 0, its parent's 2)" in problems
        # The link restore alone (as verify --fix runs it) never writes c -> a.
        assert store._tier.restore_links()["children"] == 0
        assert store._engine.read(lambda txn: txn.get("children", keys[2] + keys[0])) is None
    report = maintenance.verify(path, fix=True)
    assert set(keys[:3]) <= set(report.corrupt)  # the cycle's members, by the chain walk
    with ucm_db.open(path, engine=engine, check_on_open="none") as store:
        assert store.get(NS, keys) == [None] * 4  # the cycle and d below it were quarantined
        assert store._tier.check() == []
        assert store._engine.read(lambda txn: list(txn.scan("info", PIN_PREFIX))) == []


def test_a_put_continuing_the_cycle_does_not_restore_its_closing_link(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    keys = _cyclic_store(path, engine)
    more = NS.block_keys(TOKENS[:4] + [99, 98, 97, 96], start=4, parent=keys[0])  # a new child of a
    with ucm_db.open(path, engine=engine, check_on_open="none") as store:
        store.put(NS, more, [b"x" * 64])
        # _depth_of_parent restores a lost link above the put's parent: here that link would close the cycle.
        assert store._engine.read(lambda txn: txn.get("children", keys[2] + keys[0])) is None
