"""Pins and epochs (audit r4): a pin of a chain keyed at an epoch the
namespace has moved on from (stored before the move) is refused with
StaleEpochError and pins nothing, also when the move was made by another
process after the caller read the epoch (the check is read in the pin's own
write transaction); moving the epoch releases the old epoch's pins and their
chain records, so those blocks leave through eviction; the refusal holds
across reopen, compact and an epoch adopted from an archive. Real LMDB and
RocksDB stores, a real second process for the concurrent bump."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.errors import StaleEpochError
from ucm_db.index.entries import PIN_PREFIX

NS = Namespace(model="pin-epochs", kv_dtype="bfloat16", block_size=16)
OTHER = Namespace(model="pin-epochs-other", kv_dtype="bfloat16", block_size=16)
CAPACITY = 2 << 20
BLOCK_BYTES = 4096
SYSTEM = list(range(5000, 5000 + 16 * 16))  # 16 blocks
ROOT = Path(__file__).resolve().parent.parent


def payload(seed: int) -> bytes:
    return bytes([seed % 251]) * BLOCK_BYTES


def put_tokens(store: ucm_db.Store, ns: Namespace, tokens: list[int]) -> ucm_db.BlockKeys:
    keys = ns.block_keys(tokens, epoch=store.epoch(ns))
    have = store.lookup(ns, keys)
    if have < len(keys):
        store.put(ns, keys[have:], [payload(i) for i in range(have, len(keys))])
    return keys


def traffic(store: ucm_db.Store, total_bytes: int, base: int) -> None:
    for i in range(total_bytes // (8 * BLOCK_BYTES)):
        put_tokens(store, NS, list(range(base + i * 1000, base + i * 1000 + 128)))


@pytest.fixture(params=["lmdb", "rocksdb"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "rocksdb":
        pytest.importorskip("rocksdict")
    return str(request.param)


def test_a_pin_of_keys_from_before_a_bump_is_refused_and_pins_nothing(tmp_path: Path, engine: str) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        old = put_tokens(store, NS, SYSTEM)
        store.bump_epoch(NS)
        with pytest.raises(StaleEpochError, match="nothing was pinned") as caught:
            store.pin(NS, old)
        assert "current epoch" in caught.value.hint and isinstance(caught.value, ValueError)
        current = put_tokens(store, NS, SYSTEM)
        with pytest.raises(StaleEpochError, match="chain 2 of the 2"):
            store.pin(NS, [current, old])  # one stale chain refuses the call: the current one is not pinned either
        assert store.stats().pinned_bytes == 0
        assert store.pin(NS, current).chains == (16,)  # the current epoch's chain pins
        traffic(store, 6 * CAPACITY, 10**6)
        assert store._tier.count_prefix(old) == 0  # the old epoch's blocks aged out
        assert store.lookup(NS, current) == 16
        assert store._tier.check() == []


def test_a_bump_by_another_process_after_the_epoch_was_read_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        keys = put_tokens(store, NS, SYSTEM)  # keyed at the epoch read here
        code = textwrap.dedent(f"""
            import ucm_db
            ns = ucm_db.Namespace(model="pin-epochs", kv_dtype="bfloat16", block_size=16)
            with ucm_db.open({str(path)!r}) as other:
                print(other.bump_epoch(ns))
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        with pytest.raises(StaleEpochError):
            store.pin(NS, keys)  # the router's pin after another process's invalidate
        assert store.stats().pinned_bytes == 0


def test_moving_the_epoch_releases_the_old_pins_and_their_chain_records(tmp_path: Path, engine: str) -> None:
    from ucm_db.index.pins import PIN_BY_PREFIX

    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=CAPACITY, engine=engine) as store:
        system = put_tokens(store, NS, SYSTEM)
        conversation = put_tokens(store, NS, SYSTEM + list(range(9000, 9064)))
        kept = put_tokens(store, OTHER, SYSTEM[:160])
        store.pin(NS, [system, conversation])
        store.pin(OTHER, kept)
        store.bump_epoch(NS)

        def by_namespace(txn: object) -> list[bytes]:
            return [bytes(v) for _n, v in txn.scan("info", PIN_BY_PREFIX)]  # type: ignore[attr-defined]

        assert store._engine.read(by_namespace) == [OTHER.digest[:16]]  # only the other namespace's chain pin
        stats = store.stats()
        assert stats.pinned_bytes == stats.namespaces[OTHER.digest[:16].hex()].pinned_bytes > 0
        assert store._tier.check() == []
        traffic(store, 6 * CAPACITY, 2 * 10**6)
        assert store._tier.count_prefix(system) == 0 and store.lookup(OTHER, kept) == 10


def test_the_refusal_holds_after_reopen_and_compact(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, codec="none", capacity_bytes=CAPACITY) as store:
        old = put_tokens(store, NS, SYSTEM)
        store.bump_epoch(NS)
    maintenance.compact(path)
    with ucm_db.open(path) as store:
        with pytest.raises(StaleEpochError):
            store.pin(NS, old)
        assert store._engine.read(lambda txn: list(txn.scan("info", PIN_PREFIX))) == []


def test_an_epoch_adopted_from_an_archive_refuses_the_old_chains_and_pins_the_imported_ones(tmp_path: Path) -> None:
    source, target = tmp_path / "a", tmp_path / "b"
    with ucm_db.open(source, codec="none", capacity_bytes=CAPACITY) as store:
        store.bump_epoch(NS)
        new = put_tokens(store, NS, SYSTEM)  # keyed at epoch 1
    maintenance.export_archive(source, tmp_path / "x.tar")
    with ucm_db.open(target, codec="none", capacity_bytes=CAPACITY) as store:
        old = put_tokens(store, NS, SYSTEM)  # keyed at epoch 0
        store.pin(NS, old)
    report = maintenance.import_archive(tmp_path / "x.tar", target)
    assert report["stored"] == 16
    with ucm_db.open(target) as store:
        assert store.epoch(NS) == 1 and store.stats().pinned_bytes == 0  # the adoption released epoch 0's pin
        with pytest.raises(StaleEpochError):
            store.pin(NS, old)
        assert store.pin(NS, new).chains == (16,)  # imported after the epoch moved: current
