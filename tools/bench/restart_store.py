"""The restart benchmark's store (:mod:`.restart`): its block sizes, the
fill in the engine's own namespace (as the connector writes: one unit chain
per KV head), and timed opens."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import ucm_db
from ucm_db import BlockKeys, Namespace
from ucm_db.keys.units import KVGrid, UnitKeys

BLOCK_SIZE = 32
VOCAB = 8000
#: Blocks per filled chain (2K tokens, the shorter prompt).
CHAIN_BLOCKS = 64
#: Chains per ``put_segments`` while filling (one transaction: 8192 units of a 4-head model).
CHAINS_PER_PUT = 32


def progress(line: str) -> None:
    print(f"    {line}", file=sys.stderr, flush=True)


def engine_namespace(store: ucm_db.Store) -> Namespace:
    """The one namespace the seed engine wrote (its description is the namespace's fields)."""
    held = store.stats().namespaces
    if len(held) != 1:
        raise SystemExit(f"the seeded store holds {len(held)} namespaces, expected the engine's one: {sorted(held)}")
    (ns_id, stats), = held.items()
    namespace = Namespace.from_dict(stats.description)
    if namespace.id.hex() != ns_id:
        raise SystemExit(f"namespace {ns_id} read back as {namespace.id.hex()}: its description is not its fields")
    return namespace


def _grid(namespace: Namespace) -> KVGrid:
    layout = json.loads(namespace.layout)
    return KVGrid(int(layout["kv_heads"]), int(layout["layers"]))


def fill_store(path: Path, blocks: int, fill_bytes: int, seed: int) -> dict[str, Any]:
    """Fills the store at ``path`` to at least ``blocks`` blocks in the
    engine's namespace (module docstring, step 2)."""
    with ucm_db.open(path) as store:
        namespace = engine_namespace(store)
        grid, epoch = _grid(namespace), store.epoch(namespace)
        spans = grid.head_spans()
        seeded = store.stats().blocks
        chains = max(0, -(-(blocks - seeded) // (CHAIN_BLOCKS * len(spans))))
        rng, payload = random.Random(seed + 1), os.urandom(fill_bytes)
        started = time.perf_counter()
        segments: list[tuple[BlockKeys, list[bytes]]] = []
        for chain in range(chains):
            keys = namespace.block_keys([rng.randrange(3, VOCAB) for _ in range(CHAIN_BLOCKS * BLOCK_SIZE)], epoch=epoch)
            segments += [(BlockKeys(UnitKeys(keys, grid, span), parent=None), [payload] * CHAIN_BLOCKS) for span in spans]
            if len(segments) >= CHAINS_PER_PUT * len(spans) or chain == chains - 1:
                store.put_segments(namespace, segments)
                segments = []
        store.flush()
        fill_s = time.perf_counter() - started
        stats = store.stats()
    return {"namespace": namespace.short_id, "kv_heads": grid.heads, "seeded_blocks": seeded, "blocks": stats.blocks,
            "filled_blocks": stats.blocks - seeded, "fill_bytes": fill_bytes, "fill_s": fill_s,
            "blocks_per_s": (stats.blocks - seeded) / fill_s if fill_s else 0.0,
            "file_bytes": stats.file_bytes, "stored_bytes": stats.stored_bytes}


def time_opens(path: Path, repeat: int) -> list[float]:
    """Seconds of ``ucm_db.open`` of the store alone (closed after each)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        store = ucm_db.open(path)
        times.append(time.perf_counter() - started)
        store.close()
    return times


# -- the run --------------------------------------------------------------------------------
