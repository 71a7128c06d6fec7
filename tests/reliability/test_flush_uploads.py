"""``Store.flush`` with a write-back remote: once it returns, a power loss
uploads nothing again. The store lies on the power-cut file system
(``powercut/fs.py``), the remote in a plain directory beside it; a writer
child puts, flushes, says so and is SIGKILLed, then the power is cut.
Flush waited for the uploader, whose queue removals were committed after
flush's sync and were lost with the power: every block was queued again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import ucm_db

from .harness import NS, chain_tokens, fork_call, kill_and_reap, payload_for, tail, wait_counter, write_counter
from .powercut import PowerCutMount

pytestmark = [pytest.mark.multiprocess]

OPTIONS = {"codec": "none", "durability": "group", "sync_interval_s": 3600.0, "remote_mode": "write_back"}
BLOCKS = 12


def _keys() -> list[bytes]:
    return NS.block_keys(chain_tokens("flushed-uploads", BLOCKS))


def _put_flush_wait(store_path: Path, remote: Path, ready: Path) -> None:
    store = ucm_db.open(store_path, remote=f"file://{remote}", **OPTIONS)
    keys = _keys()
    store.put(NS, keys, [payload_for(k, 8 << 10) for k in keys])
    store.flush(upload_timeout_s=60)
    write_counter(ready, 1 + store.stats().pending_uploads)
    while True:
        signal.pause()


def test_a_flushed_upload_queue_stays_empty_after_a_power_cut(tmp_path: Path) -> None:
    remote, ready = tmp_path / "remote", tmp_path / "ready"
    remote.mkdir()
    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        store_path = tmp_path / "mnt" / "store"
        pid = fork_call(_put_flush_wait, store_path, remote, ready, log_path=tmp_path / "writer.log")
        try:
            assert wait_counter(ready, 1, timeout_s=60) == 1, tail(tmp_path / "writer.log")  # flushed: none pending
        finally:
            kill_and_reap(pid)
        mount.cut("drop", 7)  # the power goes: only what was fsynced is on the disk
        with ucm_db.open(store_path, remote=f"file://{remote}", **OPTIONS) as store:
            assert store.lookup(NS, _keys()) == BLOCKS
            assert store.stats().pending_uploads == 0, "blocks flushed to the remote were queued for upload again"
    assert os.listdir(remote)
