"""ucm_db.committer: a child process committing a real store's puts from
shared memory; its errors, its end with the caller, and its buffers."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db.committer import CommitProcess, SharedChain
from ucm_db.errors import CommitProcessError, ConfigError, MissingAncestorError, StoreFullError

NS = ucm_db.Namespace(model="committer-test", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 8 << 20, "codec": "none"}
UNIT_BYTES = 4096


def _filled(committer: CommitProcess, blocks: int, heads: int, seed: int = 0) -> tuple[object, np.ndarray]:
    buffer = committer.share(blocks * heads * UNIT_BYTES)
    rows = np.frombuffer(buffer.memory, dtype=np.uint8).reshape(blocks, heads, UNIT_BYTES)
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    return buffer, rows


def _mapped_buffers(pid: int, expected: int, timeout_s: float = 5.0) -> int:
    """The child's staging mappings, once they number ``expected`` or
    ``timeout_s`` passed: the child maps and unmaps buffers as it reads
    the messages, after ``share`` and the finalizer have returned."""
    end = time.monotonic() + timeout_s
    while True:
        count = Path(f"/proc/{pid}/maps").read_text().count("memfd:ucm-db-staging")
        if count == expected or time.monotonic() > end:
            return count
        time.sleep(0.01)


def test_units_in_a_shared_buffer_are_committed_bit_exact_with_their_frames(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        buffer, rows = _filled(committer, blocks=4, heads=2)
        chains = [NS.block_keys([head] * 16) for head in range(2)]  # two heads' chains of 4 blocks
        located = committer.locate(rows[1:].ctypes.data, rows[1:].nbytes)
        assert located == (buffer.id, rows[1:].ctypes.data - rows.ctypes.data)  # type: ignore[attr-defined]
        shared = [SharedChain(keys, buffer.id, head * UNIT_BYTES, 2 * UNIT_BYTES, UNIT_BYTES) for head, keys in enumerate(chains)]
        committed = committer.put_segments(NS, shared, frame_bytes=(1024, 3072))
        assert committed.wall_s > 0 and committed.cpu_s > 0  # CPU time may be accounted per tick: it can pass a short wall time
        assert committed.stored_keys == [key for keys in chains for key in keys]
        assert committer.put_segments(NS, shared[:1], frame_bytes=(1024, 3072)).stored_keys == []  # stored already
        for head, keys in enumerate(chains):
            got = store.get(NS, list(keys))
            assert [bytes(g) for g in got] == [rows[i, head].tobytes() for i in range(4)]
        assert committer.locate(rows.ctypes.data + rows.nbytes, 1) is None  # past the buffer


def test_the_stores_errors_come_back_as_the_store_raises_them(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        buffer, _rows = _filled(committer, blocks=4, heads=1)
        keys = NS.block_keys(list(range(16)))
        with pytest.raises(MissingAncestorError, match="not stored"):
            committer.put_segments(NS, [SharedChain(keys[1:], buffer.id, UNIT_BYTES, UNIT_BYTES, UNIT_BYTES)])
        big = committer.share(3 * (8 << 20) // 2)
        with pytest.raises(StoreFullError):
            committer.put_segments(NS, [SharedChain(NS.block_keys(list(range(100, 108))), big.id, 0, 6 << 20, 6 << 20)])
        committer.put_segments(NS, [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)])  # the child goes on
        committer.delete(NS, [keys[2]])
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        assert store.lookup(NS, list(keys)) == 2  # the delete took the chain's tail with it


def test_a_refused_put_stores_nothing(tmp_path: Path) -> None:
    """docs/api.md: the commit process commits a call's units "in one transaction, as Store.put_segments
    would": a refused call stores none of them, its segments that would fit included (audit U7: the
    errors were checked, never what the store held after them)."""
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        buffer, _rows = _filled(committer, blocks=4, heads=2)
        first, second = NS.block_keys([0] * 16), NS.block_keys([1] * 16)
        with pytest.raises(MissingAncestorError):  # the second segment's parent is not stored; the first's is a root
            committer.put_segments(NS, [SharedChain(first, buffer.id, 0, 2 * UNIT_BYTES, UNIT_BYTES),
                                        SharedChain(second[1:], buffer.id, UNIT_BYTES, 2 * UNIT_BYTES, UNIT_BYTES)])
        big, large = committer.share(3 * (8 << 20) // 2), NS.block_keys(list(range(100, 108)))
        with pytest.raises(StoreFullError):  # two blocks of 6 MiB in 8 MiB: the first alone would fit
            committer.put_segments(NS, [SharedChain(large, big.id, 0, 6 << 20, 6 << 20)])
        assert store.stats().blocks == 0
        assert store.lookup(NS, list(first)) == 0 and store.lookup(NS, list(large)) == 0


def test_every_error_keeps_its_public_class_message_and_hint(tmp_path: Path) -> None:
    """docs/api.md: the commit process raises what Store.put_segments would. Every error but these two
    came back as a TierError (an OSError: a caller retrying disk faults retried its own bad argument),
    and every one with an empty hint."""
    other = ucm_db.Namespace(model="committer-other", kv_dtype="bfloat16", block_size=4)
    keys = NS.block_keys(list(range(16)))
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        store.put(NS, keys, [b"x" * UNIT_BYTES] * 4)
        buffer, _rows = _filled(committer, blocks=4, heads=1)
        in_process = []
        for call in (lambda: store.put_segments(other, [(keys, [b"y" * UNIT_BYTES] * 4)]),
                     lambda: store.put_segments(NS, [(NS.block_keys(list(range(200, 216))), [b"y" * UNIT_BYTES] * 4)],
                                                codec_name="lz4")):
            with pytest.raises(ucm_db.UcmDbError) as raised:
                call()
            in_process.append(raised.value)
        for expected, put in zip(in_process, (
                lambda: committer.put_segments(other, [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)]),
                lambda: committer.put_segments(NS, [SharedChain(NS.block_keys(list(range(200, 216))), buffer.id, 0,
                                                                UNIT_BYTES, UNIT_BYTES)], codec_name="lz4"))):
            with pytest.raises(ucm_db.UcmDbError) as raised:
                put()
            assert isinstance(raised.value, ConfigError) and not isinstance(raised.value, OSError), raised.value
            assert str(raised.value) == str(expected) and raised.value.hint == expected.hint and expected.hint
        with pytest.raises(MissingAncestorError) as missing:
            committer.put_segments(NS, [SharedChain(NS.block_keys(list(range(300, 316)))[1:], buffer.id, 0, UNIT_BYTES,
                                                    UNIT_BYTES)])
        assert missing.value.hint == MissingAncestorError.default_hint


def test_options_json_cannot_carry_and_stores_it_cannot_open_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="JSON values"):
        CommitProcess(tmp_path / "s", {"capacity_bytes": object()})
    with pytest.raises(CommitProcessError, match="could not open the store"):
        CommitProcess(tmp_path / "s", {"capacity_bytes": "lots"})


def test_a_dropped_buffer_is_unmapped_in_the_child(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        kept, _ = _filled(committer, blocks=1, heads=1)
        dropped, rows = _filled(committer, blocks=1, heads=1, seed=1)
        assert _mapped_buffers(committer.pid, 2) == 2
        del dropped, rows
        gc.collect()
        committer.put_segments(NS, [SharedChain(NS.block_keys(list(range(4))), kept.id, 0, UNIT_BYTES, UNIT_BYTES)])  # type: ignore[attr-defined]
        assert _mapped_buffers(committer.pid, 1) == 1


def test_a_killed_child_fails_every_later_request_at_once(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS), CommitProcess(tmp_path / "s", OPTIONS) as committer:
        buffer, _rows = _filled(committer, blocks=1, heads=1)
        os.kill(committer.pid, signal.SIGKILL)
        time.sleep(0.1)
        for _ in range(2):
            with pytest.raises(CommitProcessError, match="gone"):
                committer.put_segments(NS, [SharedChain(NS.block_keys(list(range(4))), buffer.id, 0, UNIT_BYTES, UNIT_BYTES)])  # type: ignore[attr-defined]
        assert not committer.alive


_CALLER = """
import sys, time, ucm_db
from ucm_db.committer import CommitProcess
committer = CommitProcess(sys.argv[1], {"capacity_bytes": 8 << 20})
print(committer.pid, flush=True)
time.sleep(600)
"""


def test_the_child_ends_when_its_caller_is_killed(tmp_path: Path) -> None:
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        child_pid = int(caller.stdout.readline())
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(child_pid):
            time.sleep(0.05)
        assert not _running(child_pid)
    finally:
        caller.kill()


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan is reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_imports_neither_torch_nor_vllm(tmp_path: Path) -> None:
    script = ("import sys, runpy; sys.argv = ['child', '-1']\n"
              "import ucm_db.committer.child\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'click'))))")
    out = subprocess.run([sys.executable, "-c", "import json\n" + script], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []
