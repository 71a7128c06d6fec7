"""A full disk under a connector worker (both engines, ``kv_both`` and
``kv_producer``): saves fail and are counted, the failure is logged once a
minute at most, loads go on serving the stored KV, nothing waits for ever,
nothing stored is lost, and saves resume once space is freed.

The disk is full for real: a small tmpfs mounted by the test (root only;
skipped otherwise) and filled by a filler file. The worker is the
connector's own (``UcmDbWorker`` with its background writer and store), fed
the metadata a scheduler would send, without an engine; every wait on it
runs on a thread with a deadline, so a worker that hangs fails the test
instead of hanging it. Before the audit, each failed writer round logged a
warning (a kv_producer: one per engine step, 60 in 60 steps) and the
maintenance thread one a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, _shape  # noqa: E402
from tests.reliability.harness import mounted_tmpfs  # noqa: E402
from tests.reliability.test_faults import fill_leaving  # noqa: E402

NUM_BLOCKS = 64
STORED_REQUESTS = 8
FULL_STEPS = 30
NS = ucm_db.Namespace(model="full-disk-audit", kv_dtype="bfloat16", block_size=4)


def _returns(call: Callable[[], object], timeout_s: float = 60.0) -> bool:
    """Whether ``call`` returned within ``timeout_s`` (it runs on a daemon thread)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def request_keys(number: int) -> tuple[bytes, ...]:
    """Four block keys of request ``number`` (the worker only needs distinct chains)."""
    return tuple(NS.block_keys(list(range(number * 1000, number * 1000 + 16))))


class Worker:
    """A connector worker over a store, stepped as vLLM would."""

    def __init__(self, path: Path, engine: str, role: str) -> None:
        extra = {"path": str(path), "codec": "none", "save_process": False, "capacity_bytes": 1 << 30}
        if engine == "rocksdb":
            extra["engine"] = "rocksdb"
        self.worker = UcmDbWorker(ConnectorSettings.from_extra_config(extra), _shape(), NUM_BLOCKS, RolePolicy(role))
        self.kv = {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, 2, BS, 128).to(torch.bfloat16) for i in range(2)}
        self.worker.register_kv_caches(self.kv, 0, 0)
        self._step = 0

    def step(self, saves: list[BlockTransfer], loads: list[BlockTransfer] = ()) -> bool:  # type: ignore[assignment]
        """One engine step (a kv_producer drains its writer inside it); False if it did not return."""
        self._step += 1
        meta = UcmDbConnectorMetadata(step=self._step, saves=saves, loads=list(loads))

        def run() -> None:
            self.worker.start_load(meta)
            self.worker.save(meta)
        return _returns(run)

    @property
    def totals(self) -> dict[str, float]:
        return self.worker.counters.totals.data


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs", 24) as mount_point:
        yield mount_point


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_a_full_disk_fails_saves_quietly_and_they_resume_once_space_is_freed(
        small_disk: Path, engine: str, role: str, caplog: pytest.LogCaptureFixture) -> None:
    w = Worker(small_disk / "store", engine, role)
    for number in range(STORED_REQUESTS):  # stored while there is room: 4 blocks each, at block ids 0-15
        first = 4 * (number % 4)
        assert w.step([BlockTransfer(f"s{number}", request_keys(number), tuple(range(first, first + 4)))])
    assert _returns(w.worker.drain)
    stored_kv = {name: t.clone() for name, t in w.kv.items()}
    assert w.totals["saved_blocks"] == 4 * STORED_REQUESTS and w.totals["save_errors"] == 0

    filler = fill_leaving(small_disk, 0)
    with caplog.at_level(logging.INFO):
        for number in range(100, 100 + FULL_STEPS):  # each step saves a new request and loads a stored one
            loaded = number % STORED_REQUESTS
            sources, targets = range(4 * (loaded % 4), 4 * (loaded % 4) + 4), (40, 41, 42, 43)
            for t in w.kv.values():
                t[list(targets)] = 0
            assert w.step([BlockTransfer(f"r{number}", request_keys(number), (20, 21, 22, 23))],
                          [BlockTransfer(f"l{number}", request_keys(loaded), targets)]), "an engine step hung"
            assert w.worker.take_load_errors() == set(), "a stored block failed to load while the disk was full"
            for name, t in w.kv.items():  # loads serve the stored KV, whole and right
                assert all(torch.equal(t[b], stored_kv[name][a]) for a, b in zip(sources, targets)), (number, name)
        assert _returns(w.worker.drain), "drain waited for ever"
        time.sleep(1.5)  # a maintenance round or two (sync_interval_s 1) meets the full disk too
        assert w.worker._writer is not None and w.worker._writer._thread.is_alive()
        assert w.totals["save_errors"] == 4 * FULL_STEPS, "every failed save is counted"
        assert w.totals["saved_blocks"] == 4 * STORED_REQUESTS
        saving = [r for r in caplog.records if r.getMessage().startswith("ucm-db: saving ")]
        assert len(saving) == 1, [r.getMessage()[:120] for r in saving]  # once a minute, not once a round
        assert "counted in save_errors" in saving[0].getMessage()
        background = [r for r in caplog.records if "background sync/flush failed" in r.getMessage()]
        assert len(background) <= 1, [r.getMessage()[:120] for r in background]

        filler.unlink()  # space comes back: saves resume, no restart
        for attempt in range(20):
            assert w.step([BlockTransfer(f"after{attempt}", request_keys(500 + attempt), (24, 25, 26, 27))])
            assert _returns(w.worker.drain)
            if w.totals["saved_blocks"] > 4 * STORED_REQUESTS:
                break
            time.sleep(0.25)  # a store refusing puts until its sync succeeds (group durability) syncs every second
        assert w.totals["saved_blocks"] == 4 * STORED_REQUESTS + 4, "saves did not resume after space was freed"
        assert any("saves commit again" in r.getMessage() for r in caplog.records)
    assert _returns(w.worker.shutdown)

    units_per_block = 2  # one unit per KV head
    with ucm_db.open(small_disk / "store", engine=engine) as store:  # nothing acknowledged was lost
        assert store.stats().blocks == units_per_block * 4 * (STORED_REQUESTS + 1)


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_a_shutdown_while_the_disk_is_full_releases_the_store_and_loses_nothing(small_disk: Path, engine: str) -> None:
    """Before the audit the worker's shutdown raised the store's failed final
    flush (a ``TierError``) into vLLM's shutdown."""
    w = Worker(small_disk / "store", engine, "kv_both")
    for number in range(4):
        assert w.step([BlockTransfer(f"s{number}", request_keys(number), tuple(range(4 * number, 4 * number + 4)))])
    assert _returns(w.worker.drain)
    filler = fill_leaving(small_disk, 0)
    for number in range(10, 14):  # saves fail; loads touch blocks whose recency cannot be written
        assert w.step([BlockTransfer(f"r{number}", request_keys(number), (20, 21, 22, 23))],
                      [BlockTransfer(f"l{number}", request_keys(number % 4), (40, 41, 42, 43))])
    assert _returns(w.worker.drain)
    time.sleep(1.2)  # a maintenance round meets the full disk
    raised: list[BaseException] = []

    def shutdown() -> None:
        try:
            w.worker.shutdown()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            raised.append(exc)
    assert _returns(shutdown)
    assert raised == [], raised
    filler.unlink()
    with ucm_db.open(small_disk / "store", engine=engine) as store:  # released (not locked), nothing lost
        assert store.stats().blocks == 2 * 4 * 4
