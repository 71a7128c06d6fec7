"""What a router's presence query costs: ``Store.lookup_many`` of 1k chains
x 64 blocks (issue 49 item 4; target <= 20 ms), against one ``Store.lookup``
per chain, on a real LMDB store.

Cases, each 1k prompts of 64 blocks (block size 16, 64-byte payloads: the
query reads the index only, never a payload):

* ``all``: every chain stored whole (two reads a chain);
* ``none``: no chain stored (one read a chain);
* ``half``: each chain's first 32 blocks stored (a binary search a chain);
* ``units``: a store of per-head units, as the vLLM connector writes it
  (``--heads`` KV heads, one stage), every unit stored; answered in
  whole-model units (``keys.units.stored_prefix`` in the same snapshot).

Also timed: hashing the prompts' block keys (what the CLI adds before the
query), and the loop of ``lookup`` calls. Run:
``ucm-db bench presence [--chains 1024] [--blocks 64] [--heads 8] [--repeat 30] [--json]``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import click

import ucm_db
from ucm_db import BlockKeys, Namespace, maintenance
from ucm_db.keys.units import UnitKeys

BLOCK_SIZE = 16
PAYLOAD = b"p" * 64


def _ms(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm: pages in the cache, code paths loaded
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3)}


def _prompts(chains: int, blocks: int, seed: int) -> list[list[int]]:
    return [[seed * 10**9 + c * 10**4 + t for t in range(blocks * BLOCK_SIZE)] for c in range(chains)]


def _put(store: ucm_db.Store, ns: Namespace, chains: list[BlockKeys], stored: int) -> None:
    for keys in chains:
        store.put(ns, keys[:stored], [PAYLOAD] * stored)


def run(chains: int, blocks: int, heads: int, repeat: int) -> dict[str, Any]:
    plain = Namespace(model="bench/presence", kv_dtype="bfloat16", block_size=BLOCK_SIZE)
    units_ns = Namespace(model="bench/presence-units", kv_dtype="bfloat16", block_size=BLOCK_SIZE,
                         layout=json.dumps({"kv_heads": heads, "layers": 32}, sort_keys=True))
    out: dict[str, Any] = {"chains": chains, "blocks": blocks, "heads": heads, "repeat": repeat}
    with tempfile.TemporaryDirectory() as scratch, ucm_db.open(scratch + "/s", codec="none", capacity_bytes=8 << 30,
                                                               encode_threads=0) as store:
        prompts = {name: _prompts(chains, blocks, seed) for seed, name in enumerate(("all", "none", "half", "units"))}
        started = time.perf_counter()
        keyed = {name: [plain.block_keys(p) for p in ps] for name, ps in prompts.items() if name != "units"}
        out["hash_keys_ms"] = round((time.perf_counter() - started) * 1e3 / 3, 3)
        keyed["units"] = [units_ns.block_keys(p) for p in prompts["units"]]
        _put(store, plain, keyed["all"], blocks)
        _put(store, plain, keyed["half"], blocks // 2)
        units = maintenance.whole_model_units(units_ns)
        assert units is not None
        grid, spans = units
        for keys in keyed["units"]:
            store.put_segments(units_ns, [(BlockKeys(list(UnitKeys(keys, grid, span)), parent=None), [PAYLOAD] * blocks)
                                          for span in spans])
        store.flush()
        expected = {"all": blocks, "none": 0, "half": blocks // 2}
        for name, want in expected.items():
            assert store.lookup_many(plain, keyed[name]) == [want] * chains
            out[f"lookup_many_{name}"] = _ms(lambda k=keyed[name]: store.lookup_many(plain, k), repeat)  # type: ignore[misc]
            out[f"lookup_loop_{name}"] = _ms(lambda k=keyed[name]: [store.lookup(plain, c, remote=False) for c in k],  # type: ignore[misc]
                                             max(3, repeat // 5))
        assert store.lookup_many(units_ns, keyed["units"], grid=grid, spans=spans) == [blocks] * chains
        out["lookup_many_units"] = _ms(lambda: store.lookup_many(units_ns, keyed["units"], grid=grid, spans=spans), repeat)
    return out


@click.command("presence", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--chains", type=click.IntRange(min=1), default=1024, show_default=True, help="prompts queried at once")
@click.option("--blocks", type=click.IntRange(min=1), default=64, show_default=True, help="blocks per prompt")
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="KV heads of the units case")
@click.option("--repeat", type=click.IntRange(min=1), default=30, show_default=True, help="timed repetitions; medians reported")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(chains: int, blocks: int, heads: int, repeat: int, as_json: bool) -> None:
    """What a router's presence query costs (Store.lookup_many).

    \b
    Example:
        ucm-db bench presence --chains 1024 --blocks 64 --repeat 40
    """
    figures = run(chains, blocks, heads, repeat)
    if as_json:
        click.echo(json.dumps(figures, indent=2, sort_keys=True))
        return
    click.echo(f"{figures['chains']} chains x {figures['blocks']} blocks (block size {BLOCK_SIZE}), LMDB, median of {repeat}")
    click.echo(f"  hashing the prompts' block keys         {figures['hash_keys_ms']:8.2f} ms")
    for name in ("all", "none", "half"):
        many, loop = figures[f"lookup_many_{name}"], figures[f"lookup_loop_{name}"]
        click.echo(f"  lookup_many, {name:<5} stored            {many['median_ms']:8.2f} ms (min {many['min_ms']:.2f});"
                   f"  a lookup per chain {loop['median_ms']:8.2f} ms")
    units = figures["lookup_many_units"]
    click.echo(f"  lookup_many, units ({figures['heads']} heads, all stored) {units['median_ms']:8.2f} ms (min {units['min_ms']:.2f})")


if __name__ == "__main__":
    command()
