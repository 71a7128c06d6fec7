"""TP-independent blocks: stored bytes and load throughput across TP sizes.

Real connector workers (one per rank, in this process), real LMDB stores, CPU
KV caches in vLLM CPU's layout, no engine. One store is written at TP=1 and
one at TP=2 with the same KV; the figures:

* stored blocks and bytes of each store (the units are the same: equal);
* load throughput (KV bytes placed into the reader's caches per second,
  warm page cache) of every (writer TP, reader TP) pair, so a cross-TP read
  compares with a same-TP read. (The whole-block baseline of the storage
  generation before units is gone with its reader: ``ucm-db migrate``
  converts such stores, :mod:`ucm_db.maintenance.pre_units`.)

A TP=2 "reader" is its two ranks loading one after the other in this process:
their seconds add up, as the bytes do.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

MODEL_HEADS, MODEL_LAYERS, HEAD_SIZE, BLOCK = 8, 32, 128, 16


def _shape(tp: int) -> Any:
    from ucm_db.connector.identity import KVShape

    return KVShape(model="bench-tp", kv_dtype="bfloat16", block_size=BLOCK, use_mla=False, layout="bench-tp-cpu",
                   tp_size=tp, pp_size=1, kv_heads=MODEL_HEADS, layers=MODEL_LAYERS)


def _caches(heads: int, num_blocks: int, fill: bool) -> dict[str, Any]:
    import torch

    shape = (num_blocks, heads, BLOCK, 2 * HEAD_SIZE)
    make = (lambda: torch.randn(shape).to(torch.bfloat16)) if fill else (lambda: torch.zeros(shape, dtype=torch.bfloat16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(MODEL_LAYERS)}


def _meta(keys: list[bytes], block_ids: list[int], load: bool) -> Any:
    from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata

    meta = UcmDbConnectorMetadata()
    (meta.loads if load else meta.saves).append(BlockTransfer("bench", tuple(keys), tuple(block_ids)))
    return meta


def _shards(model_kv: dict[str, Any], tp: int) -> list[dict[str, Any]]:
    from ucm_db.keys.units import head_range

    out = []
    for rank in range(tp):
        start, stop = head_range(MODEL_HEADS, tp, rank)
        out.append({name: t[:, start:stop].contiguous() for name, t in model_kv.items()})
    return out


def _write(path: Path, codec: str, tp: int, model_kv: dict[str, Any], keys: list[bytes]) -> dict[str, int]:
    """Every rank of a TP=``tp`` deployment saves the blocks; returns the store's counts."""
    import ucm_db
    from ucm_db.connector.settings import ConnectorSettings
    from ucm_db.connector.worker.hooks import UcmDbWorker

    settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": codec, "capacity_bytes": 8 << 30})
    meta = _meta(keys, list(range(len(keys))), load=False)
    for rank, kv in enumerate(_shards(model_kv, tp)):
        worker = UcmDbWorker(settings, _shape(tp), len(keys))
        worker.register_kv_caches(kv, rank, 0)
        worker.save(meta)
        worker.drain()
        worker.shutdown()
    with ucm_db.open(path) as store:
        stats = store.stats()
    return {"blocks": stats.blocks, "raw_bytes": stats.raw_bytes, "stored_bytes": stats.stored_bytes}


class _Reader:
    """Every rank of a TP=``tp`` reader of one store, ready to load."""

    def __init__(self, path: Path, tp: int, keys: list[bytes]) -> None:
        from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
        from ucm_db.connector.settings import ConnectorSettings
        from ucm_db.connector.worker.hooks import UcmDbWorker

        settings = ConnectorSettings.from_extra_config({"path": str(path)})
        self.meta = UcmDbConnectorMetadata(loads=[BlockTransfer("bench", tuple(keys), tuple(range(len(keys))))])
        self.workers = []
        for rank in range(tp):
            worker = UcmDbWorker(settings, _shape(tp), len(keys))
            worker.register_kv_caches(_caches(MODEL_HEADS // tp, len(keys), fill=False), rank, 0)
            self.workers.append(worker)
        self.placed_bytes = sum(w.layout.block_bytes for w in self.workers) * len(keys)
        self.samples: list[float] = []
        self.cpu_samples: list[float] = []

    def load(self) -> None:
        """All ranks load the blocks, one after the other; timed (wall, and
        CPU of every thread of this process: steadier on a shared machine)."""
        started, cpu = time.perf_counter(), time.process_time()
        for worker in self.workers:
            worker.start_load(self.meta)
            if worker.take_load_errors():
                raise RuntimeError("a block failed to load: the figure would be meaningless")
        self.samples.append(time.perf_counter() - started)
        self.cpu_samples.append(time.process_time() - cpu)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def run(blocks: int, codec: str, repeats: int) -> dict[str, Any]:
    """All figures of the module docstring, as a dict. Loads are timed in
    rounds, each round loading once through every reader, so a change of
    machine load hits every configuration alike."""
    import torch

    from ucm_db.connector.identity import namespace

    torch.manual_seed(0)
    model_kv = _caches(MODEL_HEADS, blocks, fill=True)
    keys = namespace(_shape(1)).block_keys(list(range(blocks * BLOCK)))
    out: dict[str, Any] = {"blocks": blocks, "codec": codec, "block_bytes": sum(t[0].numel() * 2 for t in model_kv.values())}
    with tempfile.TemporaryDirectory(prefix="ucm-db-bench-tp-") as tmp:
        stores = {tp: Path(tmp) / f"written-tp{tp}" for tp in (1, 2)}
        out["stored"] = {tp: _write(path, codec, tp, model_kv, keys) for tp, path in stores.items()}
        readers = {f"written tp{w}, read tp{r}": _Reader(path, r, keys) for w, path in stores.items() for r in (1, 2)}
        del model_kv
        for round_ in range(repeats + 1):  # round 0 warms the page cache
            for reader in readers.values():
                reader.load()
        out["load"] = {}
        for name, reader in readers.items():
            seconds, cpu_s = statistics.median(reader.samples[1:]), statistics.median(reader.cpu_samples[1:])
            out["load"][name] = {"s": seconds, "cpu_s": cpu_s, "bytes": reader.placed_bytes,
                                 "gb_s": reader.placed_bytes / seconds / 1e9, "cpu_gb_s": reader.placed_bytes / cpu_s / 1e9}
            reader.close()
    return out


@click.command("tp", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--blocks", type=click.IntRange(min=1), default=64, show_default=True, help="blocks of 16 tokens (8 KV heads x 32 layers, bf16: 2 MiB each)")
@click.option("--codec", type=click.Choice(["none", "zstd"]), default="none", show_default=True, help="store codec")
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True, help="timed loads per pair (median)")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
def command(blocks: int, codec: str, repeats: int, as_json: bool) -> None:
    """Stored bytes at TP=1 vs TP=2 and load throughput of cross-TP against same-TP reads (connector workers, no engine).

    \b
    Example:
        ucm-db bench tp --blocks 64 --codec none
    """
    figures = run(blocks, codec, repeats)
    if as_json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{blocks} blocks of {figures['block_bytes'] / 2**20:.1f} MiB ({MODEL_HEADS} KV heads x {MODEL_LAYERS} layers x"
          f" {BLOCK} tokens x head {HEAD_SIZE}, bf16), codec {codec}")
    for tp, counts in figures["stored"].items():
        print(f"  written at TP={tp}: {counts['blocks']} units, raw {counts['raw_bytes']} B, stored {counts['stored_bytes']} B")
    for name, load in figures["load"].items():
        print(f"  {name:<36} {load['gb_s']:6.2f} GB/s wall, {load['cpu_gb_s']:6.2f} GB/s per CPU second"
              f"  ({load['bytes'] / 2**20:.0f} MiB in {1e3 * load['s']:.1f} ms, {1e3 * load['cpu_s']:.1f} CPU ms; median of {repeats})")


if __name__ == "__main__":
    command()
