"""`ucm-db verify --fix` leaves a store a second `verify` finds clean, for
each kind of index damage `verify` names (audit of verify, verify --fix and
compact on damaged stores).

Each store is real; each damage is written into the real ``data.mdb`` at an
offset found by searching the file for a record's known bytes (the way a
flipped bit or a torn sector leaves it), except where a test says it
writes through the engine's raw tables. The CLI runs as a real subprocess.
Every test ends with a full read of every key checking each payload
returned against the one put: damage is a miss, never wrong bytes, and a
repair loses no block whose ancestors are intact.

Before these fixes: a block record whose key lost a bit left its payload
and head as orphans `verify --fix` never dropped; an altered depth (a
chain block's, or a first block's, which was not even checked) stayed
named forever; a damaged quarantine record made `inspect` die ("report
it") while `verify` called the store clean; a damaged namespace
description or creation record stayed named after `--fix`.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.index.entries import BlockMeta
from ucm_db.migrations.access import open_engine

from .harness import NS, chain_tokens, payload_for

#: Offset of the depth in a packed BlockMeta (``<16s32sIQQQQI``).
DEPTH_AT = 48
CHAINS = 4
BLOCKS = 5
#: A payload size that LMDB keeps on overflow pages, and one it keeps inline.
SIZES = (12 << 10, 900)


def cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


def cli_json(*args: Any, expect: int) -> dict[str, Any]:
    done = cli(*args, "--json")
    assert done.returncode == expect, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr and "report it" not in done.stderr, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def chains() -> list[list[bytes]]:
    return [NS.block_keys(chain_tokens(f"audit-repair-{c}", BLOCKS)) for c in range(CHAINS)]


def size_of(key: bytes) -> int:
    return SIZES[key[0] % 2]


def make_store(path: Path) -> list[list[bytes]]:
    with ucm_db.open(path, codec="none", capacity_bytes=1 << 30, durability="sync") as store:
        for keys in chains():
            store.put(NS, keys, [payload_for(k, size_of(k)) for k in keys])
    return chains()


def raw_record(path: Path, table: str, key: bytes) -> bytes:
    engine = open_engine(path, read_only=True)
    try:
        return engine.read(lambda txn: bytes(txn.get(table, key)))
    finally:
        engine.close()


def overwrite_in_file(path: Path, needle: bytes, offset: int, new: bytes) -> None:
    """Writes ``new`` at ``offset`` into every copy of ``needle`` in data.mdb
    (LMDB copies a page on write: older copies sit on free pages, unread)."""
    data = path / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(needle)
    assert at >= 0, "the record's bytes are in the file"
    while at >= 0:
        raw[at + offset:at + offset + len(new)] = new
        at = raw.find(needle, at + 1)
    data.write_bytes(raw)


def read_everything(path: Path, all_chains: list[list[bytes]]) -> dict[bytes, bool]:
    """Whether each key is served; asserts every payload served is the one put
    and that lookup never claims a block get misses."""
    served: dict[bytes, bool] = {}
    with ucm_db.open(path) as store:
        for keys in all_chains:
            claimed = store.lookup(NS, keys, remote=False)
            got = store.get(NS, keys)
            for key, value in zip(keys, got):
                assert value is None or bytes(value) == payload_for(key, size_of(key)), "wrong bytes served"
                served[key] = value is not None
            assert all(served[k] for k in keys[:claimed]), "lookup claimed a block get misses"
    return served


def fix_until_clean(path: Path) -> dict[str, Any]:
    """verify (problems found), verify --fix, verify (clean); returns the fix's report."""
    cli_json("verify", path, expect=1)
    fixed = cli_json("verify", "--fix", path, expect=1)
    again = cli_json("verify", path, expect=0)
    assert again["corrupt"] == [] and again["index_problems"] == [], again
    return fixed


def test_a_flipped_bit_in_a_block_records_key_leaves_no_orphans_after_fix(tmp_path: Path) -> None:
    """The meta record of a chain's 3rd block under a key one bit off: its
    payload and head have no metadata (orphans), its record has no payload.
    --fix dropped neither orphan: the second verify still exited 1."""
    path = tmp_path / "s"
    all_chains = make_store(path)
    victim = all_chains[1][2]
    flipped = victim[:-1] + bytes([victim[-1] ^ 1])  # the last bit: the leaf page stays sorted
    overwrite_in_file(path, victim + raw_record(path, "meta", victim), 31, flipped[31:])
    found = cli_json("verify", path, expect=1)
    assert any(victim.hex()[:16] in p and "orphan" in p for p in found["index_problems"]), found["index_problems"]
    fixed = fix_until_clean(path)
    assert fixed["index_repaired"].get("orphans_dropped") == 1, fixed
    served = read_everything(path, all_chains)
    lost = {k for k, ok in served.items() if not ok}
    assert lost == set(all_chains[1][2:]), "exactly the damaged block and its descendants are gone"


@pytest.mark.parametrize("position", [2, 0], ids=["chain-block", "first-block"])
def test_an_altered_depth_is_named_and_rewritten_without_losing_blocks(tmp_path: Path, position: int) -> None:
    """A depth field changed in the file: the chain block's stayed named
    after --fix; a first block's was not checked at all. Depth is derived
    (the parent's plus one): --fix rewrites it and every block stays."""
    path = tmp_path / "s"
    all_chains = make_store(path)
    victim = all_chains[2][position]
    overwrite_in_file(path, raw_record(path, "meta", victim), DEPTH_AT, struct.pack("<I", 7))
    found = cli_json("verify", path, expect=1)
    assert any(victim.hex()[:16] in p and "depth" in p for p in found["index_problems"]), found["index_problems"]
    fixed = fix_until_clean(path)
    assert fixed["index_repaired"].get("depths_restored") == 1 and fixed["quarantined_blocks"] == 0, fixed
    assert all(read_everything(path, all_chains).values()), "a block with an altered depth is intact: none lost"
    engine = open_engine(path, read_only=True)
    try:
        assert engine.read(lambda txn: BlockMeta.unpack(txn.get("meta", victim)).depth) == position
    finally:
        engine.close()


def test_a_damaged_quarantine_record_is_named_and_inspect_survives_it(tmp_path: Path) -> None:
    """A quarantine record whose JSON lost its first byte: `inspect` died in
    its checking process ("report it"), `verify` exited 0."""
    path = tmp_path / "s"
    all_chains = make_store(path)
    victim = all_chains[3][4]
    blob = raw_record(path, "blocks", victim)
    overwrite_in_file(path, blob[-64:], 10, b"\xff")  # a payload bit flip: the read quarantines it
    with ucm_db.open(path) as store:
        assert store.get(NS, [*all_chains[3]])[4] is None
    record = raw_record(path, "quarantine", victim)
    assert record.startswith(b"{")
    overwrite_in_file(path, record, 0, b"\x00")
    inspected = cli("inspect", path, "--json")
    assert "report it" not in inspected.stderr and "Traceback" not in inspected.stderr, inspected.stderr
    assert json.loads(inspected.stdout)["quarantine_records"] == 1
    found = cli_json("verify", path, expect=1)
    assert any(victim.hex()[:16] in p and "quarantine record" in p for p in found["index_problems"]), found
    fix_until_clean(path)
    served = read_everything(path, all_chains)
    assert {k for k, ok in served.items() if not ok} == {victim}


def test_damaged_description_and_creation_records_are_repaired(tmp_path: Path) -> None:
    """The namespace description's and the creation record's JSON with a
    byte changed: both named, neither repaired (a second verify exited 1).
    --fix drops the description (the next put writes it again) and rewrites
    the creation record from the whole format version."""
    path = tmp_path / "s"
    all_chains = make_store(path)
    engine = open_engine(path, read_only=True)
    try:
        description, created = engine.read(
            lambda txn: (bytes(txn.get("info", b"nsdesc:" + NS.id)), bytes(txn.get("info", b"created"))))
    finally:
        engine.close()
    overwrite_in_file(path, description, 0, b"[")
    overwrite_in_file(path, created, 0, b"]")
    fixed = fix_until_clean(path)
    assert fixed["index_repaired"].get("records_rewritten") == 2, fixed
    assert all(read_everything(path, all_chains).values())
    more = NS.block_keys(chain_tokens("audit-repair-more", 1))
    with ucm_db.open(path) as store:
        store.put(NS, more, [payload_for(more[0], 900)])
    rows = cli_json("inspect", path, expect=0)["namespaces"]
    assert [row["description"]["model"] for row in rows if row["id"] == NS.id.hex()] == [NS.model]
