"""KV cache events through vLLM's own ZMQ publisher (one CPU engine, its
core and worker in this process).

A subscriber in this process (kv_events_job.EventSubscriber: a SUB socket,
then vLLM's replay endpoint for anything it missed) builds a router's view of STORAGE blocks (vLLM's own
GPU/CPU-medium events are ignored) while the engine serves prompts into a
store too small for them (evictions), and a second process writes evented
blocks into the same store and namespace (evicting the engine's) and
deletes one. vLLM publishes only inside a step, so one more request is
driven after the other process's writes. The view must equal what the
store holds (``ucm-db events``): 0 divergence.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

import ucm_db  # noqa: E402
from e2e_helpers import BLOCK_SIZE, StoreCounter, one_process_engine, wait_for_new_blocks  # noqa: E402
from kv_events_job import EventSubscriber, events_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _storage_view(events: list[object]) -> tuple[set[object], dict[str, int]]:
    """vLLM hashes of STORAGE blocks after every event, in publishing order,
    and the count of each STORAGE event type."""
    view: set[object] = set()
    counts: dict[str, int] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.clear()  # vLLM's own resets clear its own media too; ours are followed by the inventory
        elif getattr(event, "medium", None) != MEDIUM_STORAGE:
            continue  # vLLM's own-medium events
        counts[type(event).__name__] = counts.get(type(event).__name__, 0) + 1
        if isinstance(event, BlockStored):
            view.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            view.difference_update(event.block_hashes)
    return view, counts


_OTHER_WRITER = textwrap.dedent("""
    import os, sys, ucm_db
    from ucm_db import BlockEventFields, Namespace
    path = sys.argv[1]
    with ucm_db.open(path) as store:
        (ns_stats,) = store.stats().namespaces.values()
        ns = Namespace.from_dict(ns_stats.description)
        deleted = None
        for chain in range(6):
            tokens = [900 + chain] * (2 * ns.block_size)
            keys = ns.block_keys(tokens)
            fields, parent = {}, None
            for i, key in enumerate(keys):
                fields[key] = BlockEventFields(os.urandom(32), parent, tuple(tokens[:ns.block_size]), ns.block_size)
                parent = fields[key].block_hash
            store.put(ns, keys, [os.urandom(100_000)] * 2, event_fields=fields)
            deleted = keys
        assert store.delete(ns, deleted[1:]) == 1
        print(store.stats().evictions)
""")


def _store_view(path: Path) -> set[object]:
    """vLLM hashes (as vLLM publishes them: 64-bit ints) of what the store holds."""
    exe = Path(sys.executable).parent / "ucm-db"
    done = subprocess.run([str(exe), "events", str(path)], capture_output=True, text=True, timeout=120, check=True)
    out: set[object] = set()
    for line in done.stdout.splitlines():
        event = json.loads(line)
        (h,) = event["block_hashes"]
        out.add(h if isinstance(h, int) else int.from_bytes(bytes.fromhex(h), "big") & ((1 << 64) - 1))
    return out


def test_subscriber_view_equals_the_store(tiny_models: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = tiny_models
    store_path = tmp_path / "store"
    pub, replay = _free_port(), _free_port()
    spec = {
        "model": str(model), "connector": {"path": str(store_path), "capacity_bytes": 1 << 20},
        "prefix_caching": True, "block_size": BLOCK_SIZE, "enforce_eager": True, "max_tokens": 2,
        "engine_kwargs": {"kv_events_config": events_config(pub, replay)},
    }
    import engine_job  # tests/vllm is on sys.path

    subscriber = EventSubscriber(pub)
    try:
        with StoreCounter() as count_blocks, one_process_engine(spec) as llm:
            # 10 prompts of 5 blocks (32 KB each) into 1 MiB: the oldest are evicted.
            prompts = [{"ids": [(p * 37 + i) % 997 + 3 for i in range(5 * BLOCK_SIZE + 1)]} for p in range(10)]
            before = 0
            for prompt in prompts:
                engine_job.run_prompts(llm, [prompt], max_tokens=2)
            before = wait_for_new_blocks(store_path, before, count_blocks=count_blocks)
            other = subprocess.run([sys.executable, "-c", _OTHER_WRITER, str(store_path)], capture_output=True, text=True, timeout=120)
            assert other.returncode == 0, other.stderr
            assert int(other.stdout) > 0  # the store evicted
            # vLLM publishes inside steps: drive requests so the last saves' and the other process's changes are published.
            engine_job.run_prompts(llm, [{"ids": [5, 6, 7]}], max_tokens=2)
            time.sleep(1.0)
            engine_job.run_prompts(llm, [{"ids": [5, 6, 8]}], max_tokens=2)
            time.sleep(1.0)
            subscriber.replay_missing(replay)
    finally:
        subscriber.close()
    view, counts = _storage_view(subscriber.events())
    held = _store_view(store_path)
    print(f"STORAGE events {counts}; store holds {len(held)} evented blocks")
    assert counts["BlockStored"] >= 50 + 12 and counts["BlockRemoved"] > 0  # the engine's 50 blocks, the other's 12
    with ucm_db.open(store_path) as store:
        assert store.stats().evictions > 0
    assert len(held) >= 5
    assert view == held, f"divergence: {len(view - held)} published but gone, {len(held - view)} held but unpublished"
