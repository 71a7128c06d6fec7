"""zstd by the size of the caller's frames: grouped (the codec's rule) against frame by frame.

For each caller frame size: ``Store.put`` (encode) and ``Store.get_into``
(decode) of 16 MiB of bf16-like blocks, each block cut into frames of that
size as :class:`ucm_db.Framed`, in raw MB/s (median of ``--runs``). Three
configurations, measured in turns (run by run, the order rotating) in one process: zstd as the codec stores
it (adjacent frames compressed together up to ``ZSTD_GROUP_BYTES``), zstd
with every frame compressed alone (the group size set to one byte for the
measurement: what stores did before grouping), and codec ``none`` (the
ceiling: a checksum and a copy). The compression ratio of both zstd
configurations is printed beside them. vLLM-CPU hands the connector 8 KiB
layer frames (one head of one layer of a 32-token bf16 block, head size 64).
With ``--data real`` the blocks are real bf16 K/V activations
(:mod:`.kv_sample`, captured in a child process) instead of bf16-like
normal values: the figures a served model's units see.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
import numpy as np

from ucm_db.components import codec
from ucm_db.tools.bench.codec_pool import TOTAL_BYTES, bf16_like, measure

_CONFIGS = ("grouped", "alone", "none")


def _ratio(frame_bytes: int, data: np.ndarray) -> float:
    """Raw over stored bytes of ``data``'s blocks, as the codec stores them now."""
    frame_counts = (frame_bytes,) * (data.shape[1] // frame_bytes)
    stored = sum(codec.encode_parts(bytes(32), codec.Framed(block, frame_counts), codec="zstd", element_bytes=2).body_len
                 for block in data)
    return round(data.size / stored, 3)


@contextmanager
def _grouping(config: str) -> Iterator[None]:
    """The codec's group size as ``config`` measures it: one byte for
    ``alone`` (every frame compressed by itself), the codec's own else;
    restored afterwards."""
    saved = codec.ZSTD_GROUP_BYTES
    codec.ZSTD_GROUP_BYTES = 1 if config == "alone" else saved
    try:
        yield
    finally:
        codec.ZSTD_GROUP_BYTES = saved


def _one(config: str, frame_bytes: int, data: np.ndarray) -> dict[str, float]:
    """One run of one configuration (a fresh store)."""
    with _grouping(config):
        return measure(frame_bytes, data.shape[1], 0, 1, codec_name="none" if config == "none" else "zstd", data=data)


def blocks_of(kind: str, block_bytes: int) -> np.ndarray:
    """16 MiB of blocks, ``[blocks, block_bytes]`` uint8: ``bf16-like`` or ``real`` K/V."""
    count = TOTAL_BYTES // block_bytes
    if kind == "bf16-like":
        return bf16_like(count, block_bytes)
    from ucm_db.tools.bench.kv_sample import capture_kv_in_subprocess, kv_blocks
    return np.stack(kv_blocks(capture_kv_in_subprocess(), block_bytes, count))


def run(frame_sizes: list[int], block_bytes: int, runs: int, data_kind: str = "bf16-like") -> list[dict[str, Any]]:
    """One row per frame size; the three configurations take turns run by run."""
    data = blocks_of(data_kind, block_bytes)
    rows = []
    for frame_bytes in frame_sizes:
        row: dict[str, Any] = {"frame_bytes": frame_bytes, "block_bytes": block_bytes, "data": data_kind}
        each: dict[str, list[dict[str, float]]] = {config: [] for config in _CONFIGS}
        for turn in range(runs):  # configurations interleaved, the order rotating: no one runs first each time
            for config in _CONFIGS[turn % 3:] + _CONFIGS[:turn % 3]:
                each[config].append(_one(config, frame_bytes, data))
        for config, figures in each.items():
            row[config] = {what: round(statistics.median(f[what] for f in figures), 1) for what in ("decode_MBps", "encode_MBps")}
            if config != "none":
                with _grouping(config):
                    row[config]["ratio"] = _ratio(frame_bytes, data)
        for what in ("decode", "encode"):
            row[f"{what}_grouped_over_alone"] = round(row["grouped"][f"{what}_MBps"] / row["alone"][f"{what}_MBps"], 2)
        rows.append(row)
    return rows


@click.command("codec-frames", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--frame-kib", default="8,32,64,256", show_default=True, help="comma list of caller frame sizes (KiB)")
@click.option("--block-kib", type=click.IntRange(min=16, max=16 << 10), default=512, show_default=True,
              help="block size (KiB; a multiple of every frame size)")
@click.option("--runs", type=click.IntRange(min=1), default=11, show_default=True, help="repetitions (medians reported)")
@click.option("--data", "data_kind", type=click.Choice(["bf16-like", "real"]), default="bf16-like", show_default=True,
              help="bf16 bit patterns of normal values, or real bf16 K/V activations (kv_sample)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(frame_kib: str, block_kib: int, runs: int, data_kind: str, as_json: bool) -> None:
    """zstd with adjacent small frames grouped against every frame alone, and codec none.

    \b
    Example:
        ucm-db bench codec-frames
        ucm-db bench codec-frames --frame-kib 8 --block-kib 2048 --runs 5
        ucm-db bench codec-frames --data real --block-kib 16 --frame-kib 8
    """
    sizes = [int(kib) << 10 for kib in frame_kib.split(",") if kib.strip()]
    block_bytes = block_kib << 10
    bad = [size >> 10 for size in sizes if size <= 0 or block_bytes % size]
    if bad:
        raise click.BadParameter(f"frame sizes {bad} KiB do not divide the {block_kib} KiB block", param_hint="--frame-kib")
    rows = run(sizes, block_bytes, runs, data_kind)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"16 MiB of {data_kind} {block_kib} KiB blocks through Store.put / Store.get_into, caller's thread, "
               f"median of {runs}, MB/s of raw bytes; zstd groups up to {codec.ZSTD_GROUP_BYTES >> 10} KiB")
    click.echo(f"{'frame':>7} | {'decode grouped':>14} {'alone':>6} {'none':>6} {'x':>5} | "
               f"{'encode grouped':>14} {'alone':>6} {'none':>6} {'x':>5} | {'ratio grouped':>13} {'alone':>6}")
    for r in rows:
        g, a, n = r["grouped"], r["alone"], r["none"]
        click.echo(f"{r['frame_bytes'] >> 10:>5}Ki | {g['decode_MBps']:>14} {a['decode_MBps']:>6} {n['decode_MBps']:>6} "
                   f"{r['decode_grouped_over_alone']:>5} | {g['encode_MBps']:>14} {a['encode_MBps']:>6} {n['encode_MBps']:>6} "
                   f"{r['encode_grouped_over_alone']:>5} | {g['ratio']:>13} {a['ratio']:>6}")
