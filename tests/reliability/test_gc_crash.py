"""Remote GC killed mid-way: ``maintenance.gc_remote`` (what ``ucm-db gc``
runs) SIGKILLed at random points while it deletes from a shared directory
(the tests' ``ucmfault://`` wrapper over it kills the process right after
its nth removal, n random; the product has no hook for it).

After every kill: each object under a final name is whole (verifies for its
key) and a fresh node reading through the remote serves only right bytes.
After a GC that runs to its end: the remote is within its limit and keeps
whole prefixes (every object's parent chain reaches a chain root), however
the killed runs left it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import maintenance
from ucm_db.remote.tier import RemoteRoot, unpack_object

from .harness import NS, chain_tokens, payload_for, run_child, size_for, tail

pytestmark = [pytest.mark.crash]
SIZE_RANGE = (1024, 8192)
CHAINS = 60
KILLS = 15


def remote_state(url: str) -> dict[bytes, bytes | None]:
    """Every object under a final name: key -> parent (each one verified)."""
    root = RemoteRoot.from_url(url)
    tier = root.tier(NS.digest[:16])
    out: dict[bytes, bytes | None] = {}
    for key in tier.iterate():
        data = root.fs.cat_file(tier.path(key))
        out[key] = unpack_object(data, key).parent  # raises on a torn or foreign object
    return out


def gc_child(url: str, max_bytes: int, options: dict[str, Any] | None = None) -> None:
    if url.startswith("ucmfault://"):
        import faultfs

        faultfs.register()
    maintenance.gc_remote(url, options, max_bytes=max_bytes)


def test_remote_gc_killed_midway_leaves_whole_objects_and_finishes(tmp_path: Path) -> None:
    remote_dir = tmp_path / "remote"
    url = f"file://{remote_dir}"
    chains = [NS.block_keys(chain_tokens(f"gc-{n}", random.randint(1, 6))) for n in range(CHAINS)]
    with ucm_db.open(tmp_path / "writer", capacity_bytes=64 << 20, remote=url, remote_mode="write_through") as store:
        for keys in chains:
            store.put(NS, keys, [payload_for(k, size_for(k, *SIZE_RANGE)) for k in keys])
    total_bytes = sum(p.stat().st_size for p in remote_dir.rglob("*") if p.is_file() and len(p.name) == 64)
    before = remote_state(url)
    assert len(before) == sum(len(c) for c in chains)

    rng = random.Random()
    limit = total_bytes
    killed_while_deleting = 0
    previous = before
    for _ in range(KILLS):
        limit = int(limit * 0.9)
        nth = rng.randint(1, 6)
        log = tmp_path / "gc.log"
        status = run_child(gc_child, f"ucmfault://{remote_dir}", limit, {"target_protocol": "file", "plan": {"kill_after_removes": nth}},
                           log_path=log, timeout_s=120)
        assert status in (0, -9), f"gc died otherwise (status {status}):\n{tail(log)}"
        now = remote_state(url)  # every object left is whole
        assert set(now) <= set(previous), "gc must only remove"
        killed_while_deleting += status == -9
        previous = now

    # A fresh node reading through the half-collected remote: misses, never wrong bytes.
    with ucm_db.open(tmp_path / "reader", capacity_bytes=64 << 20, remote=url, remote_deadline_s=5.0) as reader:
        for keys in chains:
            for key, value in zip(keys, reader.get(NS, keys)):
                assert value is None or bytes(value) == payload_for(key, size_for(key, *SIZE_RANGE))

    final_limit = int(limit * 0.8)
    assert run_child(gc_child, url, final_limit, log_path=tmp_path / "gc-final.log", timeout_s=120) == 0, tail(tmp_path / "gc-final.log")
    after = remote_state(url)
    kept_bytes = sum(p.stat().st_size for p in remote_dir.rglob("*") if p.is_file() and len(p.name) == 64)
    assert kept_bytes <= final_limit
    broken = [k.hex()[:16] for k, parent in after.items() if parent is not None and parent not in after]
    assert broken == [], f"objects whose parent is gone after a complete gc: {broken}"
    assert killed_while_deleting >= KILLS // 2, "the kills must land while gc deletes"
    print(f"\nremote gc: {KILLS} runs, objects {len(before)} -> {len(after)}, {killed_while_deleting} killed while deleting")
