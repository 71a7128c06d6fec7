"""Review of `verify --fix`'s rewrite of damaged namespace descriptions
(commit 788643b): it deletes every ``nsdesc:`` record it finds damaged,
"the next put of the namespace writes its own again".

But a namespace's description is also the store's memory that it *holds*
the namespace (:func:`ucm_db.store.epochs.held`: "written with its first
put and never deleted"): a sealed store reads a lost epoch record as
unknown (never served) only while the description is there. Deleted, the
lost epoch reads as 0 again, and `--fix`'s own epoch renewal (which runs
after the records step) no longer sees it: the KV of before an
invalidation is served. And ``ucm-db invalidate`` selects namespaces by
their descriptions: after the `--fix` its hint asks for, it finds none.

The damage is written through the engine's raw tables (the records of one
info page: the namespace's description and its epoch record sit side by
side there). The CLI runs as a real subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db.engines.base import Txn
from ucm_db.migrations.access import open_engine

from .harness import NS, chain_tokens, payload_for

DESC = b"nsdesc:" + NS.id
EPOCH = b"epoch:" + NS.id


def cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


def edit(path: Path, change: Callable[[Txn], object]) -> None:
    engine = open_engine(path)
    try:
        engine.write(change)
    finally:
        engine.close()


def spoil_description(txn: Txn) -> None:
    """The description's last byte changed: its checksum sidecar disagrees."""
    value = bytes(txn.get("info", DESC))
    txn.put("info", DESC, value[:-1] + b" ")


def test_fix_of_a_damaged_description_beside_a_lost_epoch_never_serves_invalidated_kv(tmp_path: Path) -> None:
    path = tmp_path / "s"
    tokens = chain_tokens("review-stale", 4)
    stale = NS.block_keys(tokens, epoch=0)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, stale, [payload_for(k, 3000) for k in stale])
        assert store.bump_epoch(NS) > 0  # a weight update: the blocks above must never be served again

    def torn_info_page(txn: Txn) -> None:
        spoil_description(txn)
        txn.delete("info", EPOCH)
        txn.delete("info", b"sum:" + EPOCH)
    edit(path, torn_info_page)

    found = json.loads(cli("verify", path, "--json").stdout)
    assert any("epoch record is missing" in p for p in found["index_problems"]), found  # unknown: not served
    fixed = cli("verify", "--fix", path, "--json")
    assert "Traceback" not in fixed.stderr, fixed.stderr

    with ucm_db.open(path) as store:
        epoch = store.epoch(NS)
        served = store.lookup(NS, NS.block_keys(tokens, epoch=epoch), remote=False)
    assert epoch != 0 and served == 0, f"epoch {epoch} after --fix: {served} blocks of before the invalidation served"


def test_a_namespace_can_be_invalidated_after_fix_of_its_description_record(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = NS.block_keys(chain_tokens("review-invalidate", 3))
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        store.put(NS, keys, [payload_for(k, 3000) for k in keys])
    # Only the checksum sidecar is damaged: the description itself is whole
    # (its namespace id is a digest of it, so it can be checked without one).
    edit(path, lambda txn: txn.put("info", b"sum:" + DESC, b"\0" * 8))

    assert cli("verify", "--fix", path).returncode == 1
    assert cli("verify", path).returncode == 0
    done = cli("invalidate", path, "--namespace", NS.model, "--json")
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr.strip()[-400:]}"
