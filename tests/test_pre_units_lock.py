"""``migrate``'s conversion of whole blocks holds the store to itself from
its check to its end.

Audit finding (by reading): :func:`ucm_db.maintenance.pre_units.convert`
took the store's lock exclusively to check that no other process had the
store open, released it, and only then opened the store (shared) to convert:
a process opening the store in between, or during the conversion, ran beside
it, though the docstring (and ``ucm-db migrate``) promise the store to
itself. Now the store's own lock is made exclusive once it is open, and a
process opening the store meanwhile waits until the conversion is done.

The other process is real; it is started from inside the conversion (as the
units are about to be written), so what it meets is deterministic: a
non-blocking try of the store's shared lock, then a real ``ucm_db.open``
that must wait and find the store converted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.errors import LockedError
from ucm_db.maintenance import pre_units

pytestmark = pytest.mark.timeout(300)
BS, HEADS, LAYERS, HEAD = 16, 4, 2, 32
LAYOUT = json.dumps({"kv_heads": HEADS, "layers": LAYERS, "head_size": HEAD, "platform": "cpu-test"},
                    sort_keys=True, separators=(",", ":"))
NS = Namespace(model="test/pre-units-lock", kv_dtype="bfloat16", block_size=BS, layout=LAYOUT)
WHOLE_BYTES = HEADS * LAYERS * BS * 2 * HEAD * 2
BLOCKS = 3

_OTHER = """
import sys
from ucm_db.errors import LockedError
from ucm_db.storelock import hold_shared
path = sys.argv[1]
try:
    hold_shared(path, timeout_s=0).release()
    print("lock: shared taken", flush=True)
except LockedError:
    print("lock: held exclusively", flush=True)
import ucm_db
with ucm_db.open(path) as store:  # waits while the conversion holds the store
    stats = store.stats()
    print("opened:", stats.blocks, stats.raw_bytes, flush=True)
"""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "s") as opened:
        opened.put(NS, NS.block_keys(list(range(BLOCKS * BS))), [bytes([i + 1]) * WHOLE_BYTES for i in range(BLOCKS)])
    return tmp_path / "s"


def test_a_process_opening_the_store_during_the_conversion_waits_for_its_end(store: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    other: dict[str, Any] = {}
    write_units = pre_units._write_units

    def start_other_then_write(*args: Any) -> Any:
        proc = subprocess.Popen([sys.executable, "-c", _OTHER, str(store)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        other["proc"], other["lock"] = proc, proc.stdout.readline().strip()  # its try of the lock is done
        return write_units(*args)

    monkeypatch.setattr(pre_units, "_write_units", start_other_then_write)
    report = pre_units.convert(store)
    assert (report.whole_blocks, report.units_written, report.skipped_blocks) == (BLOCKS, BLOCKS * HEADS, 0)
    out, _ = other["proc"].communicate(timeout=120)
    assert other["proc"].returncode == 0
    assert other["lock"] == "lock: held exclusively"  # the conversion had the store to itself
    # The open waited: it saw the conversion's end (units only), never a store half converted.
    assert out.strip() == f"opened: {BLOCKS * HEADS} {BLOCKS * WHOLE_BYTES}"


def test_a_store_open_elsewhere_is_refused_and_nothing_converted(store: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, ucm_db; s = ucm_db.open(sys.argv[1]); "
                               "print('open', flush=True); sys.stdin.read()", str(store)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(LockedError, match=f"pid {holder.pid} "):
            pre_units.convert(store)
    finally:
        holder.communicate("", timeout=60)
    assert pre_units.convert(store, dry_run=True).whole_blocks == BLOCKS


def test_a_process_that_opens_the_store_after_the_check_makes_the_conversion_refuse(store: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The window the lock was let go in: a process that has the store open
    when the conversion's own open comes is found, and nothing converted."""
    holder: dict[str, subprocess.Popen[str]] = {}
    real_open = pre_units.open_store

    def open_after_another(path: Any) -> Any:
        proc = subprocess.Popen([sys.executable, "-c", "import sys, ucm_db; s = ucm_db.open(sys.argv[1]); "
                                 "print('open', flush=True); sys.stdin.read()", str(path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holder["proc"] = proc
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        return real_open(path)

    monkeypatch.setattr(pre_units, "open_store", open_after_another)
    try:
        with pytest.raises(LockedError):
            pre_units.convert(store)
    finally:
        holder["proc"].communicate("", timeout=60)
    monkeypatch.undo()
    assert pre_units.convert(store, dry_run=True).whole_blocks == BLOCKS
