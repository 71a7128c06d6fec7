"""Review of a74e0fe..fee537f: repros of the defects found, and checks of what was found sound.

Checks, on real LMDB stores in ``tmp_path``:
    * ``IndexReader.with_blocks``'s offer (c41b23b) files exactly what the old boolean logic filed, for every
      combination of: meta absent / wrong length / impossible sizes / other namespace / whole; payload present or
      missing; ``damaged`` list given or not; ``namespace_id`` given or not (the old predicate is kept here as the
      oracle, written out as it stood at a74e0fe).
    * ``Store.epoch``'s memory answer (5bf6489) is keyed by LMDB's commit id read from the meta pages. LMDB writes
      the meta page before it publishes the new txnid to readers (``mti_txnid`` in the lock file), so a full read in
      between sees the old snapshot under the new commit id: the old epoch is then answered from memory after the
      bump committed. The window is widened with ``strace``'s syscall delay on the bumping child's ``pwrite64``
      (the meta write), not with a sleep: the parent waits for the commit id to move, then reads. Fixed: the
      answer is keyed by the commit its own read saw (``CommitIds.seen_by``), trusted while the meta pages name it.
    * ``KVLayout``'s integer views (a6b526e) round-trip staging byte for byte for each dtype width torch has.

Invariants: nothing is mocked but ``QUICK_RECHECK_S`` (lengthened so the stale answer cannot expire mid-test);
seeds are fixed; no sleeps as synchronisation.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.engines.lmdb.commit_ids import commit_ids_of
from ucm_db.index.entries import META, NO_PARENT
from ucm_db.index.reads import DAMAGED_RECORD, PAYLOAD_MISSING, IndexReader, in_namespace
from ucm_db.index import damage
from ucm_db.store import epoch_gate

NS = Namespace(model="test/review-today2", kv_dtype="bfloat16", block_size=4)
OWN_NS_ID = bytes(range(16))
OTHER_NS_ID = bytes(range(16, 32))
#: Bumping child's pwrite64 exits are delayed this long (microseconds): LMDB's meta page is in the page cache,
#: its lock file's txnid not yet moved.
META_WRITE_DELAY_US = 400_000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ucm_db.Store]:
    with ucm_db.open(tmp_path / "s", codec="none") as opened:
        yield opened


# -- c41b23b: the offer's damage filing, old logic as oracle --------------------------------------------------------
def _meta_record(kind: str) -> bytes | None:
    """A ``meta`` record of one kind: absent, wrong length, impossible sizes, other namespace, whole."""
    whole = META.pack(OWN_NS_ID, NO_PARENT, 0, 64, 80, 1, 1, 0)
    return {"absent": None, "short": whole[:40], "impossible": META.pack(OWN_NS_ID, NO_PARENT, 0, 1 << 62, 80, 1, 1, 0),
            "impossible_other": META.pack(OTHER_NS_ID, NO_PARENT, 0, 1 << 62, 80, 1, 1, 0),
            "other": META.pack(OTHER_NS_ID, NO_PARENT, 0, 64, 80, 1, 1, 0), "whole": whole}[kind]


def _old_offer(meta: bytes | None, has_payload: bool, namespace_id: bytes | None, with_damaged: bool
               ) -> tuple[bool, list[str]]:
    """(block offered, reasons filed) as ``offer`` decided at a74e0fe."""
    filed: list[str] = []
    if not has_payload:
        if with_damaged and namespace_id is not None:
            plausible = meta is not None and damage.meta_or_none(meta) is not None
            if meta is not None and (not plausible or in_namespace(meta, namespace_id)):
                filed.append(PAYLOAD_MISSING if plausible else DAMAGED_RECORD)
        return False, filed
    if namespace_id is not None:
        if meta is None or not in_namespace(meta, namespace_id) or damage.meta_or_none(meta) is None:
            if with_damaged and meta is not None and damage.meta_or_none(meta) is None:
                filed.append(DAMAGED_RECORD)
            return False, filed
    return True, filed


def _engine_with(tmp_path: Path, meta: bytes | None, has_payload: bool) -> ucm_db.Store:
    path = tmp_path / "offer"
    shutil.rmtree(path, ignore_errors=True)
    store = ucm_db.open(path, codec="none")

    def write(txn):  # type: ignore[no-untyped-def]
        if meta is not None:
            txn.put("meta", KEY, meta)
        if has_payload:
            txn.put("blocks", KEY, b"p" * 16)
            txn.put("heads", KEY, b"")
    store._engine.write(write)
    return store


KEY = bytes(range(32))
OFFER_CASES = list(itertools.product(["absent", "short", "impossible", "impossible_other", "other", "whole"],
                                     [True, False], [OWN_NS_ID, None], [True, False]))


def test_the_offer_files_what_the_old_logic_filed(tmp_path: Path) -> None:
    outcomes: set[tuple[bool, tuple[str, ...]]] = set()
    for kind, has_payload, namespace_id, with_damaged in OFFER_CASES:
        meta = _meta_record(kind)
        store = _engine_with(tmp_path, meta, has_payload)
        try:
            damaged: list[tuple[bytes, str]] | None = [] if with_damaged else None
            blocks = IndexReader(store._engine).with_blocks([KEY], lambda b: b, namespace_id=namespace_id,
                                                            damaged=damaged)
            got = (blocks[0] is not None, [reason for _key, reason in damaged or []])
            assert got == _old_offer(meta, has_payload, namespace_id, with_damaged), (kind, has_payload, namespace_id)
            outcomes.add((got[0], tuple(got[1])))
        finally:
            store.close()
    assert outcomes == {(True, ()), (False, ()), (False, (DAMAGED_RECORD,)), (False, (PAYLOAD_MISSING,))}


# -- 5bf6489: the epoch answered from memory --------------------------------------------------------------------------
def _bumping_child(path: Path) -> subprocess.Popen[str]:
    """A process of the same store that opens it, says ``ready``, bumps on a line of stdin (every pwrite64 exit
    delayed by strace), prints the epoch and exits without closing (no commit after the bump's)."""
    code = (f"import os, sys, ucm_db; from ucm_db import Namespace; s = ucm_db.open({str(path)!r}); "
            f"ns = Namespace(**{NS.to_dict()!r}); s.epoch(ns); print('ready', flush=True); sys.stdin.readline(); "
            "print(s.bump_epoch(ns), flush=True); os._exit(0)")
    command = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=pwrite64",
               "-e", f"inject=pwrite64:delay_exit={META_WRITE_DELAY_US}", sys.executable, "-c", code]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to hold LMDB between its two commit writes")
def test_a_bump_read_between_lmdbs_meta_write_and_its_publication_is_not_answered_stale(
        store: ucm_db.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(epoch_gate, "QUICK_RECHECK_S", 600.0)  # no expiry mid-test: only a commit may renew
    ids = commit_ids_of(store._engine)
    assert ids is not None
    assert store.epoch(NS) == 0
    child = _bumping_child(store.path)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        store.epoch(NS)  # the child's open committed: read, and keyed at the current id
        before = ids.last()
        child.stdin.write("\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60
        while ids.last() == before:  # the bump's meta page reached the page cache
            assert time.monotonic() < deadline, "the child never committed"
        in_window = store.epoch(NS)  # a full read: LMDB's readers still start at the old txnid
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err[-2000:]
    bumped = int(out.strip().splitlines()[-1])
    assert bumped == 1 and ids.last() != before
    assert (in_window, store.epoch(NS)) == (in_window, bumped)  # the bump committed: the next call must see it


# -- a6b526e: integer views of each width -----------------------------------------------------------------------------
def _dtypes_of_every_width() -> list[object]:
    torch = pytest.importorskip("torch")
    return [torch.uint8, torch.bool, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32,
            torch.float64, torch.complex64, torch.complex128]  # 16 bytes: no integer view, copied as is


def _caches(torch, dtype):  # type: ignore[no-untyped-def]
    """One layer's KV cache per layout shape: cpu contiguous (the in-place slab path), cpu strided, flash."""
    return {"cpu": torch.zeros((6, 2, 4, 4), dtype=dtype),
            "cpu_strided": torch.zeros((6, 4, 2, 4), dtype=dtype).transpose(1, 2),
            "flash": torch.zeros((2, 6, 4, 2, 4), dtype=dtype)}


@pytest.mark.parametrize("dtype", _dtypes_of_every_width(), ids=str)
def test_units_and_blocks_round_trip_byte_for_byte_through_integer_views(dtype: object) -> None:
    torch = pytest.importorskip("torch")
    from ucm_db.connector.layouts import detect_layout

    gen = torch.Generator().manual_seed(7)
    for name, kv in _caches(torch, dtype).items():
        layout = detect_layout({"l0": kv}, 6)
        staging = layout.new_unit_staging(3)
        staging.copy_(torch.randint(0, 256, tuple(staging.shape), dtype=torch.uint8, generator=gen))
        layout.scatter_units([5, 0, 3], staging)
        back = layout.new_unit_staging(3)
        layout.gather_units([5, 0, 3], back)
        layout.gather_on_device(layout.index_on_device([5, 0, 3]), back_strided := layout.new_unit_staging(3))
        assert torch.equal(back, staging) and torch.equal(back_strided, staging), name
        blocks = layout.new_staging(2)
        blocks.copy_(torch.randint(0, 256, tuple(blocks.shape), dtype=torch.uint8, generator=gen))
        layout.scatter([1, 4], blocks)
        whole = layout.new_staging(2)
        layout.gather([1, 4], whole)
        assert torch.equal(whole, blocks), name
