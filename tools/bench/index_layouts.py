"""What the local index's table layout costs a put at 1M blocks: a bare py-lmdb model.

``ucm-db bench scale`` finds an index-only put (64 new blocks of 128 bytes)
about 1.7-1.8x slower in a 1M-block store than in a 10k one. Its profile
puts the difference in the commit: every randomly keyed B-tree a block
writes dirties about one leaf *and* one branch page per new block at 1M,
against about one leaf per block and a handful of branches at 10k. This
benchmark asks what a store format with fewer randomly keyed tables per
block would reach, before anyone writes one: it builds the same two sizes
with bare py-lmdb for each layout below and times the same 64-block put.

=========  ===========================================================  ==========
layout     tables a block writes                                        random
=========  ===========================================================  ==========
format-3   ``heads``, ``blocks``, ``meta``, ``children`` (by key),       4
           ``lru`` (appends): the store format today
merged     head and metadata in one record, ``blocks``, ``children``     3
by-seq     merged record and ``children``; payloads keyed by a put       2
           sequence number (appends)
one        one record per block (head, metadata, its child inline;       1
           a put rewrites its parent's record too); payloads by sequence
=========  ===========================================================  ==========

Value sizes follow format 3: a 1-frame head (``codec.encode_parts``), a
128-byte payload, the 88-byte metadata record, 64-byte ``children`` keys,
44-byte ``lru`` keys. Everything else a put of the store does (key checks,
ancestor reads, accounting, eviction check) is left out, so a layout's
ratio here is higher than the store's; ``--store-put-ms`` turns the
model into the store's figure: the store's small-store put time minus the
model's format-3 small-store put time is the work outside the tables, added
to both sizes of every layout.

Invariants:
    * Both sizes of a layout are built and measured in turns within one
      run, with the same puts; each put is timed from ``begin`` to commit,
      no fsync (the scale benchmark's stores use group durability, which
      syncs off the put path).
    * The model writes nothing of ucm-db's: it needs only py-lmdb and a
      scratch directory, which it removes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import lmdb

from ucm_db.components import codec

PUT_BLOCKS = 64
PAYLOAD_BYTES = 128
META_BYTES = 88  # ucm_db's per-block metadata record (format 3)
_LRU = struct.Struct(">QI")  # access time, inverted depth; the key follows
_SEQ = struct.Struct(">Q")
#: Blocks per write transaction while building (the scale benchmark's chains are 1024).
BUILD_BATCH = 4096


@dataclass(frozen=True)
class Layout:
    """Which tables a block writes, and how each is keyed."""

    name: str
    by_key: tuple[tuple[str, int], ...]  # (table, value bytes), keyed by the block key
    children_table: bool  # a ("children", parent + key) entry per block with a parent
    payload_by_seq: bool  # payloads in an append-only table keyed by sequence number


def _head_bytes() -> int:
    return len(codec.encode_parts(bytes(32), bytes(PAYLOAD_BYTES), codec="none").head)


def layouts() -> list[Layout]:
    head = _head_bytes()
    merged = head + META_BYTES
    return [
        Layout("format-3", (("heads", head), ("blocks", PAYLOAD_BYTES), ("meta", META_BYTES)), True, False),
        Layout("merged", (("index", merged), ("blocks", PAYLOAD_BYTES)), True, False),
        Layout("by-seq", (("index", merged),), True, True),
        Layout("one", (("index", merged + 32),), False, True),
    ]


class _Model:
    """One bare LMDB environment laid out as ``layout``."""

    def __init__(self, path: Path, layout: Layout) -> None:
        self.layout = layout
        self.env = lmdb.open(str(path), map_size=16 << 30, max_dbs=8, sync=False, metasync=False, readahead=True)
        names = [t for t, _ in layout.by_key] + ["lru"] + (["children"] if layout.children_table else [])
        names += ["payloads"] if layout.payload_by_seq else []
        self.dbs = {name: self.env.open_db(name.encode()) for name in names}
        self.seq = 0

    def add(self, txn: lmdb.Transaction, key: bytes, parent: bytes | None) -> None:
        self.seq += 1
        for table, size in self.layout.by_key:
            txn.put(key, bytes(size), db=self.dbs[table])
        if self.layout.payload_by_seq:
            txn.put(_SEQ.pack(self.seq), bytes(PAYLOAD_BYTES), db=self.dbs["payloads"], append=True)
        if self.layout.children_table and parent is not None:
            txn.put(parent + key, b"", db=self.dbs["children"])
        txn.put(_LRU.pack(self.seq, 0) + key, b"", db=self.dbs["lru"], append=True)

    def build(self, blocks: int) -> None:
        done = 0
        while done < blocks:
            with self.env.begin(write=True) as txn:
                parent = None
                for _ in range(min(BUILD_BATCH, blocks - done)):
                    key = os.urandom(32)
                    self.add(txn, key, parent)
                    parent = key
                    done += 1
        with self.env.begin(buffers=True) as txn:  # touch every page, as the store's prefault does
            for db in self.dbs.values():
                for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                    pass

    def put(self) -> float:
        """Seconds of one put of a new ``PUT_BLOCKS``-block chain segment."""
        started = time.perf_counter()
        with self.env.begin(write=True) as txn:
            parent = os.urandom(32)  # the segment continues a stored chain
            if not self.layout.children_table:  # the parent's record gains its new child
                table, size = self.layout.by_key[0]
                txn.put(parent, bytes(size), db=self.dbs[table])
            for _ in range(PUT_BLOCKS):
                key = os.urandom(32)
                self.add(txn, key, parent)
                parent = key
        return time.perf_counter() - started

    def close(self) -> None:
        self.env.close()


def measure(large_blocks: int, small_blocks: int, puts: int, warmup_puts: int, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for layout in layouts():
        models = {}
        for size, blocks in (("large", large_blocks), ("small", small_blocks)):
            models[size] = _Model(scratch / f"{layout.name}-{size}", layout)
            models[size].build(blocks)
        times: dict[str, list[float]] = {"large": [], "small": []}
        for i in range(warmup_puts + puts):
            for size in ("large", "small"):
                seconds = models[size].put()
                if i >= warmup_puts:
                    times[size].append(seconds)
        for size, model in models.items():
            model.close()
            shutil.rmtree(scratch / f"{layout.name}-{size}")
        # The ratio is of the figures the row prints, so a reader who divides them gets it back.
        large_ms, small_ms = (round(statistics.median(times[s]) * 1e3, 4) for s in ("large", "small"))
        random_tables = len(layout.by_key) + int(layout.children_table)
        rows.append({"layout": layout.name, "random_tables": random_tables, "large_put_ms": large_ms,
                     "small_put_ms": small_ms, "ratio": round(large_ms / small_ms, 2)})
    return rows


def with_store_overhead(rows: list[dict[str, Any]], store_small_put_ms: float) -> None:
    """Adds each row's ratio with the store's work outside the tables (see the module docstring)."""
    base = next(r for r in rows if r["layout"] == "format-3")
    outside_ms = max(0.0, store_small_put_ms - base["small_put_ms"])
    for row in rows:
        row["store_model_ratio"] = round((row["large_put_ms"] + outside_ms) / (row["small_put_ms"] + outside_ms), 2)
    for row in rows:
        row["outside_tables_ms"] = round(outside_ms, 4)


def format_table(rows: list[dict[str, Any]], large_blocks: int, small_blocks: int) -> str:
    has_store = "store_model_ratio" in rows[0]
    head = f"{'layout':<10} {'random tables':>13} {f'put @{large_blocks}':>14} {f'put @{small_blocks}':>14} {'ratio':>6}"
    lines = [head + (f" {'with store work':>16}" if has_store else "")]
    for r in rows:
        line = (f"{r['layout']:<10} {r['random_tables']:>13} {r['large_put_ms']:>11.3f} ms {r['small_put_ms']:>11.3f} ms "
                f"{r['ratio']:>5.2f}x")
        lines.append(line + (f" {r['store_model_ratio']:>15.2f}x" if has_store else ""))
    return "\n".join(lines)


@click.command("index-layouts")
@click.option("--blocks", "large_blocks", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="blocks in the large model")
@click.option("--small-blocks", type=click.IntRange(min=1), default=10_000, show_default=True, help="blocks in the small model")
@click.option("--puts", type=click.IntRange(min=1), default=50, show_default=True, help="timed puts per size (median)")
@click.option("--store-put-ms", type=click.FloatRange(min=0), default=None,
              help="the store's small-store index-only put (ms, from `ucm-db bench scale`): adds the ratio the store would see")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="scratch directory (default: system temp)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(large_blocks: int, small_blocks: int, puts: int, store_put_ms: float | None, scratch_dir: Path | None,
            as_json: bool) -> None:
    """Index-only put at a large and a small size, per table layout (bare py-lmdb model).

    \b
    Example:
        ucm-db bench index-layouts
        ucm-db bench index-layouts --store-put-ms 1.76 --json
    """
    scratch = Path(tempfile.mkdtemp(prefix="ucm-db-index-layouts-", dir=scratch_dir))
    try:
        rows = measure(large_blocks, small_blocks, puts, warmup_puts=10, scratch=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if store_put_ms is not None:
        with_store_overhead(rows, store_put_ms)
    report = {"large_blocks": large_blocks, "small_blocks": small_blocks, "put_blocks": PUT_BLOCKS, "puts": puts, "rows": rows}
    click.echo(json.dumps(report, indent=2) if as_json else format_table(rows, large_blocks, small_blocks))
