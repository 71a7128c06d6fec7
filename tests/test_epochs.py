"""Namespace epochs (ucm_db/store/epochs.py) through the public Store API: a bump
makes every block stored before a miss for every process, durably; nothing
is deleted; damage is never read as an epoch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace, TierError

NS = Namespace(model="test/epochs", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="test/other", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(3, 3 + 4 * 6))


def _put(store: ucm_db.Store, ns: Namespace, epoch: int) -> list[bytes]:
    keys = ns.block_keys(TOKENS, epoch=epoch)
    store.put(ns, keys, [bytes([i]) * 64 for i in range(len(keys))])
    return keys


def test_epoch_zero_keys_are_the_keys_ucm_db_always_gave() -> None:
    assert NS.block_keys(TOKENS, epoch=0) == NS.block_keys(TOKENS)
    assert NS.block_keys(TOKENS, {"cache_salt": "x"}, epoch=0) == NS.block_keys(TOKENS, {"cache_salt": "x"})
    at_one, at_two = NS.block_keys(TOKENS, epoch=1), NS.block_keys(TOKENS, epoch=2)
    assert not set(at_one) & set(NS.block_keys(TOKENS)) and not set(at_one) & set(at_two)
    # A continued chain carries its root's epoch.
    assert NS.block_keys(TOKENS[8:], parent=at_one[1]) == at_one[2:]


def test_a_bump_hides_every_older_block_until_stored_again(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s") as store:
        assert store.epoch(NS) == 0
        old = _put(store, NS, store.epoch(NS))
        other = _put(store, OTHER, store.epoch(OTHER))
        assert store.lookup(NS, old) == 6
        assert store.bump_epoch(NS) == 1 and store.epoch(NS) == 1
        assert store.epoch(OTHER) == 0  # per namespace
        new = NS.block_keys(TOKENS, epoch=store.epoch(NS))
        assert store.lookup(NS, new) == 0  # 0 stale hits
        assert store.lookup(OTHER, other) == 6
        assert store.stats().blocks == 12  # nothing deleted: LRU eviction collects the old ones
        _put(store, NS, 1)
        assert store.lookup(NS, new) == 6  # stored again at the new epoch
        assert store.bump_epoch(NS) == 2


def test_another_process_and_a_reopen_see_the_bump(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path) as store:
        _put(store, NS, 0)
        code = f"import ucm_db; from ucm_db import Namespace; s = ucm_db.open({str(path)!r}); print(s.bump_epoch(Namespace(**{NS.to_dict()!r})))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "1"
        assert store.epoch(NS) == 1  # the open store reads the other process's bump at once
    with ucm_db.open(path, read_only=True) as reopened:
        assert reopened.epoch(NS) == 1
        with pytest.raises(TierError, match="read-only"):
            reopened.bump_epoch(NS)


def test_a_damaged_epoch_record_is_never_read_and_a_bump_replaces_it(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s") as store:
        store.bump_epoch(NS)
        name = b"epoch:" + NS.digest[:16]
        store._tier.engine.write(lambda txn: txn.put("info", name, (7).to_bytes(8, "little")))  # a flipped value
        with pytest.raises(TierError, match="damaged") as caught:
            store.epoch(NS)
        assert "ucm-db invalidate" in caught.value.hint
        epoch = store.bump_epoch(NS)
        assert epoch >= 1 << 32 and store.epoch(NS) == epoch


def test_bad_epochs_and_namespaces_are_refused(tmp_path: Path) -> None:
    for bad in (-1, 1 << 64, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="epoch"):
            NS.block_keys(TOKENS, epoch=bad)  # type: ignore[arg-type]
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match="Namespace"):
            store.bump_epoch("test/epochs")  # type: ignore[arg-type]
