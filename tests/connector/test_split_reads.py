"""``load_threads``: a staged load's units read over several threads
(``connector/worker/split_reads.py``), against one ``get_into`` over the
same rows, on a real store; and a restarted engine's layer-mode load read
that way lands every block where vLLM allocated it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ucm_db
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.worker import split_reads
from ucm_db.connector.worker.split_reads import MIN_UNITS_PER_THREAD, SplitReads, auto_load_threads
from ucm_db.errors import ConfigError, TierError

UNIT = 4096
UNITS = 4 * MIN_UNITS_PER_THREAD + 3  # chunks of unequal length


@pytest.fixture()
def stored(tmp_path: Path) -> Any:
    """A store holding a chain's units, one at the wrong size (a miss on
    read), and keys to read: the chain's with one never stored."""
    ns = ucm_db.Namespace(model="split", kv_dtype="bfloat16", block_size=4)
    keys = ns.block_keys(list(range(4 * UNITS)))
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, UNIT, dtype=np.uint8).tobytes() for _ in keys]
    payloads[40] = payloads[40][:-8]
    with ucm_db.open(tmp_path / "store") as store:
        store.put(ns, keys, payloads)
        keys[17] = ns.block_keys(list(range(1000, 1004)))[0]  # read, never stored
        yield store, ns, keys, payloads


@pytest.mark.parametrize("threads", [1, 2, 4, 7])
def test_flags_and_bytes_equal_one_read_over_the_same_rows(stored: Any, threads: int) -> None:
    store, ns, keys, payloads = stored
    one = np.zeros((UNITS, UNIT), np.uint8)
    want = store.get_into(ns, keys, ucm_db.ScatterSlabs([memoryview(one.reshape(-1))], [UNIT], range(UNITS)))
    assert want.count(False) == 2 and not want[17] and not want[40]
    rows = np.zeros((UNITS, UNIT), np.uint8)
    reads = SplitReads(threads)
    try:
        assert reads.get_into(store, ns, keys, memoryview(rows.reshape(-1)), UNIT) == want
    finally:
        reads.close()
    ok = [i for i, flag in enumerate(want) if flag]
    assert np.array_equal(rows[ok], one[ok])
    assert all(bytes(rows[i]) == payloads[i] for i in ok)


class _Recording:
    """The real store, with each ``get_into``'s thread and key count noted
    (and, where ``fail_from`` is set, a read error raised for the chunk that
    starts there: a fault a healthy store does not produce on demand)."""

    def __init__(self, store: ucm_db.Store, keys: list[bytes], fail_from: int | None = None) -> None:
        self._store, self._keys, self._fail_from = store, keys, fail_from
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def get_into(self, namespace: ucm_db.Namespace, keys: list[bytes], buffers: Any, *, touch: bool = True) -> list[bool]:
        flags = self._store.get_into(namespace, keys, buffers, touch=touch)
        with self.lock:
            self.calls.append((threading.current_thread().name, len(keys)))
        if self._fail_from is not None and keys[0] == self._keys[self._fail_from]:
            raise TierError("a read failed")
        return flags


def test_chunks_are_contiguous_and_a_small_batch_stays_on_the_callers_thread(stored: Any) -> None:
    store, ns, keys, _ = stored
    rows = memoryview(np.zeros((UNITS, UNIT), np.uint8).reshape(-1))
    reads = SplitReads(4)
    try:
        recording = _Recording(store, keys)
        reads.get_into(recording, ns, keys, rows, UNIT)  # type: ignore[arg-type]
        assert sorted(n for _, n in recording.calls) == [16, 17, 17, 17]
        assert {name for name, _ in recording.calls} - {threading.current_thread().name}
        small = _Recording(store, keys)
        reads.get_into(small, ns, keys[: 2 * MIN_UNITS_PER_THREAD - 1], rows, UNIT)  # type: ignore[arg-type]
        assert small.calls == [(threading.current_thread().name, 2 * MIN_UNITS_PER_THREAD - 1)]
    finally:
        reads.close()


def test_a_failed_chunk_raises_after_every_chunk_is_done(stored: Any) -> None:
    store, ns, keys, _ = stored
    rows = memoryview(np.zeros((UNITS, UNIT), np.uint8).reshape(-1))
    reads = SplitReads(4)
    try:
        recording = _Recording(store, keys, fail_from=17)  # the second chunk of 17
        with pytest.raises(TierError, match="a read failed"):
            reads.get_into(recording, ns, keys, rows, UNIT)  # type: ignore[arg-type]
        assert len(recording.calls) == 4  # none still writing into the caller's rows
    finally:
        reads.close()


def test_auto_threads_split_only_large_units_beside_an_accelerator() -> None:
    assert auto_load_threads(False, 1 << 20, cpus=64) == 1  # host KV caches: the cores run the model
    assert auto_load_threads(True, 32 << 10, cpus=64) == 1  # small units: the GIL-held work per unit dominates
    assert auto_load_threads(True, 64 << 10, cpus=64) == 2  # four threads measured slower than one here
    assert auto_load_threads(True, 256 << 10, cpus=16) == 4
    assert auto_load_threads(True, 256 << 10, cpus=8) == 2
    assert auto_load_threads(True, 256 << 10, cpus=2) == 1
    assert auto_load_threads(True, 256 << 10, cpus=128) == 4
    assert auto_load_threads(True, 256 << 10, cpus=128, workers=8) == 4  # 16 CPUs a worker
    assert auto_load_threads(True, 256 << 10, cpus=16, workers=8) == 1  # 2 a worker
    assert auto_load_threads(True, 256 << 10, cpus=32, workers=4) == 2
    assert split_reads.usable_cpus() == len(os.sched_getaffinity(0))
    assert split_reads.local_workers(8) == (min(8, torch.accelerator.device_count()) if torch.accelerator.is_available() else 1)


@pytest.mark.parametrize("bad", [0, -1, 65, "four", 2.0, True])
def test_load_threads_is_auto_or_a_count(bad: object) -> None:
    with pytest.raises(ConfigError, match="load_threads"):
        ConnectorSettings.from_extra_config({"load_threads": bad})
    assert ConnectorSettings.from_extra_config({}).load_threads == "auto"
    assert ConnectorSettings.from_extra_config({"load_threads": 3}).load_threads == 3


def test_a_layer_mode_load_read_over_threads_lands_at_the_allocated_blocks(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from test_scheduler_worker import BS, _admit, _new_step, _request, restarted

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_mode": "layer", "load_threads": 2})
    tokens = list(range(1, 20 * BS + 5))  # 20 blocks of 2 units: 40 units, two chunks
    kv, sched, worker, fresh = restarted(settings, tokens)
    try:
        req = _request("b", tokens)
        assert _admit(sched, req) == 20 * BS
        targets = list(range(30, 51))
        meta = sched.build_connector_meta(_new_step(req, targets, len(tokens) - 20 * BS))
        worker.start_load(meta)
        for name in kv:
            worker.wait_for_layer(name)
        assert worker.take_load_errors() == set()
        for name in kv:
            assert torch.equal(fresh[name][30:50].view(torch.int16), kv[name][0:20].view(torch.int16))
            assert not fresh[name][50].any() and not fresh[name][:30].any()
    finally:
        worker.shutdown()
        sched.shutdown()
