"""The child of tests/test_close_race.py: closes a store while threads use it.

``python close_race_child.py PATH ENGINE SECONDS SEED`` fills a store at
PATH (once), then, until SECONDS have passed, opens it, starts threads that
read (``get_into`` into :class:`~ucm_db.ScatterSlabs` and into a list of
buffers, ``get``), look up, touch, put and delete, closes it from the main thread
after a random delay while a second thread closes it too, and checks that
every call either returned the stored bytes or raised
:class:`~ucm_db.ClosedError`, that every thread ended, and that the closed
store refuses calls with ``ClosedError``. It prints one JSON line and exits
0 when nothing went wrong, 1 otherwise; a crash (SIGSEGV) is its exit
signal, with faulthandler's traceback on stderr.
"""

from __future__ import annotations

import faulthandler
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import ucm_db
from ucm_db import ClosedError, Namespace, ScatterSlabs

NS = Namespace(model="close-race", kv_dtype="bfloat16", block_size=4)
UNIT_BYTES = 1 << 20
UNITS = 48
LAYERS = 2
#: Each unit is read this many times by one get_into into slabs (per engine): a long read, the window a
#: close used to unmap LMDB's map under, from a small store (RocksDB copies every value: one pass is long).
REPEATS = {"lmdb": 8, "rocksdb": 1}


def unit(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, UNIT_BYTES, dtype=np.uint8).tobytes()


def open_store(path: Path, engine: str) -> ucm_db.Store:
    return ucm_db.open(path, engine=engine, codec="none", capacity_bytes=1 << 30, check_on_open="none", encode_threads=2)


def fill(path: Path, engine: str) -> list[bytes]:
    keys = NS.block_keys(list(range(4 * UNITS)))
    if not (path / "filled").exists():
        with open_store(path, engine) as store:
            store.put(NS, keys, [unit(i) for i in range(UNITS)])
        (path / "filled").touch()
    return list(keys)


class Race:
    """One open store, its users and its closers (one iteration)."""

    def __init__(self, store: ucm_db.Store, keys: list[bytes], expected: list[np.ndarray], seed: int, repeats: int) -> None:
        self.store, self.keys, self.expected, self.repeats = store, keys, expected, repeats
        self.failures: list[str] = []
        self.ok = 0
        self.refused = 0
        self.seed = seed
        self._lock = threading.Lock()

    def run(self, name: str, call: Callable[[], bool]) -> None:
        """``call()`` until it raises: ClosedError ends it well, anything
        else (or wrong bytes) is a failure."""
        try:
            while True:
                if not call():
                    self.fail(f"{name}: wrong bytes or a miss")
                    return
                with self._lock:
                    self.ok += 1
        except ClosedError:
            with self._lock:
                self.refused += 1
        except BaseException as exc:  # noqa: BLE001 - reported
            self.fail(f"{name}: {type(exc).__name__}: {exc}")

    def fail(self, message: str) -> None:
        with self._lock:
            self.failures.append(message)

    def slabs(self) -> bool:
        views = [np.zeros(UNITS * UNIT_BYTES // LAYERS, np.uint8) for _ in range(LAYERS)]
        slabs = ScatterSlabs([memoryview(v) for v in views], [UNIT_BYTES // LAYERS] * LAYERS, list(range(UNITS)) * self.repeats)
        flags = self.store.get_into(NS, self.keys * self.repeats, slabs, touch=False)
        rows = np.stack([v.reshape(UNITS, -1) for v in views], axis=1).reshape(UNITS, -1)
        return all(flags) and all(np.array_equal(rows[i], self.expected[i]) for i in range(UNITS))

    def buffers(self) -> bool:
        picked = random.Random().sample(range(UNITS), 8)
        buffers = [bytearray(UNIT_BYTES) for _ in picked]
        flags = self.store.get_into(NS, [self.keys[i] for i in picked], [memoryview(b) for b in buffers])
        return all(flags) and all(np.array_equal(np.frombuffer(b, np.uint8), self.expected[i]) for b, i in zip(buffers, picked))

    def get(self) -> bool:
        got = self.store.get(NS, self.keys[:4])
        return all(g is not None and np.array_equal(np.frombuffer(g, np.uint8), self.expected[i]) for i, g in enumerate(got))

    def lookup(self) -> bool:
        self.store.touch(NS, self.keys[:8])
        return self.store.lookup(NS, self.keys) == UNITS

    def put(self) -> bool:
        tail = NS.block_keys(list(range(4 * UNITS)) + [self.seed, random.getrandbits(31), 0, 0])[UNITS:]
        self.store.put(NS, tail, [b"\x01" * 65536])
        return self.store.delete(NS, tail) == 1


def iteration(path: Path, engine: str, keys: list[bytes], expected: list[np.ndarray], rng: random.Random, seed: int) -> Race:
    race = Race(open_store(path, engine), keys, expected, seed, REPEATS[engine])
    users = [threading.Thread(target=race.run, args=(name, getattr(race, name)), name=f"user-{name}")
             for name in ("slabs", "buffers", "get", "lookup", "put")]
    for thread in users:
        thread.start()
    time.sleep(rng.uniform(0.0, 0.03))
    second = threading.Thread(target=lambda: _close(race, "second close"), name="second-close")
    second.start()
    _close(race, "close")
    second.join(30)
    for thread in [*users, second]:
        thread.join(30)
        if thread.is_alive():
            race.fail(f"{thread.name} still running 30 s after close")
    try:
        race.store.lookup(NS, keys)
        race.fail("lookup on a closed store did not raise")
    except ClosedError:
        pass
    return race


def _close(race: Race, name: str) -> None:
    try:
        race.store.close()
    except BaseException as exc:  # noqa: BLE001 - reported
        race.fail(f"{name}: {type(exc).__name__}: {exc}")


def main() -> int:
    faulthandler.enable()
    path, engine, seconds, seed = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    keys = fill(path, engine)
    expected = [np.frombuffer(unit(i), np.uint8) for i in range(UNITS)]
    rng = random.Random(seed)
    summary = {"iterations": 0, "ok": 0, "refused": 0, "failures": []}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            race = iteration(path, engine, keys, expected, rng, seed)
        except Exception as exc:  # noqa: BLE001 - e.g. the last close did not release the store: reported
            summary["failures"].append(f"iteration: {type(exc).__name__}: {exc}")
            break
        summary["iterations"] += 1
        summary["ok"] += race.ok
        summary["refused"] += race.refused
        summary["failures"] += race.failures
        if len(summary["failures"]) > 20:
            break
    print(json.dumps(summary), flush=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
