"""An LMDB map that cannot grow (the process's address space limit) and a
file-size limit, under puts and reads: the put that needs the growth is a
``TierError``, the store goes on serving what it holds, and puts resume
once the limit is lifted, without a reopen.

Real limits in a forked child (``RLIMIT_AS``, ``RLIMIT_FSIZE``), set after
the store opened with a 1 MiB map that must grow. Before the audit a
failed growth raised py-lmdb's raw ``MemoryError`` ("mdb_env_set_mapsize:
Cannot allocate memory") and left the environment closed for good: every
later get and put of the process failed ("Attempt to operate on
closed/deleted/dropped object"), also after the limit was lifted.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import ucm_db
from ucm_db.errors import TierError

from .harness import NS, chain_tokens, payload_for, run_child, tail

BLOCK_BYTES = 64 << 10
#: Address space left to the child beyond what it maps at the limit's setting: room for its Python, not for a
#: map twice the size it reaches.
HEADROOM_BYTES = 80 << 20


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def _put(store: ucm_db.Store, keys: list[bytes], i: int) -> None:
    store.put(NS, keys[i:i + 1], [payload_for(keys[i], BLOCK_BYTES)], parent=keys[i - 1] if i else None)


def _right(store: ucm_db.Store, keys: list[bytes]) -> int:
    return sum(v is not None and bytes(v) == payload_for(k, BLOCK_BYTES) for k, v in zip(keys, store.get(NS, keys)))


def map_child(path: Path, out: Path) -> None:
    report: dict[str, object] = {}
    store = ucm_db.open(path, capacity_bytes=1 << 30, durability="sync", map_size_bytes=1 << 20, codec="none")
    keys = NS.block_keys(chain_tokens("map", 4000))
    _put(store, keys, 0)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + HEADROOM_BYTES, resource.RLIM_INFINITY))
    acked = 1
    try:
        while acked < len(keys):
            _put(store, keys, acked)
            acked += 1
    except Exception as exc:  # noqa: BLE001 - reported
        report["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        report["tier_error"] = isinstance(exc, TierError)
    report["acked"] = acked
    try:
        report["right_while_limited"] = _right(store, keys[acked - 20:acked])
    except Exception as exc:  # noqa: BLE001 - reported
        report["read_error"] = repr(exc)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        _put(store, keys, acked)
        report["resumed"] = True
    except Exception as exc:  # noqa: BLE001 - reported
        report["resumed"] = repr(exc)
    try:
        store.close()
    except Exception as exc:  # noqa: BLE001 - reported
        report["close_error"] = repr(exc)
    out.write_text(json.dumps(report))


def test_a_map_that_cannot_grow_fails_the_put_and_leaves_the_store_serving(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    status = run_child(map_child, tmp_path / "store", out, log_path=tmp_path / "child.log", timeout_s=240)
    assert status == 0, tail(tmp_path / "child.log")
    report = json.loads(out.read_text())
    assert report.get("tier_error") is True, report  # the put that needed the growth, with a hint
    assert report["acked"] > 20, report
    assert report.get("right_while_limited") == 20, report  # the store still serves what it holds
    assert report["resumed"] is True, report  # the limit lifted: the map grows, puts go on
    assert "close_error" not in report, report
    with ucm_db.open(tmp_path / "store") as store:
        keys = NS.block_keys(chain_tokens("map", 4000))
        assert _right(store, keys[:report["acked"] + 1]) == report["acked"] + 1  # nothing acknowledged was lost
