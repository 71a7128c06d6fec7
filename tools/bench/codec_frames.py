"""zstd by the size of the caller's frames: grouped (the codec's rule) against frame by frame.

For each caller frame size: ``Store.put`` (encode) and ``Store.get_into``
(decode) of 16 MiB of bf16-like blocks, each block cut into frames of that
size as :class:`ucm_db.Framed`, in raw MB/s (median of ``--runs``). Three
configurations, measured in turns in one process: zstd as the codec stores
it (adjacent frames compressed together up to ``ZSTD_GROUP_BYTES``), zstd
with every frame compressed alone (the group size set to one byte for the
measurement: what stores did before grouping), and codec ``none`` (the
ceiling: a checksum and a copy). The compression ratio of both zstd
configurations is printed beside them. vLLM-CPU hands the connector 8 KiB
layer frames (one head of one layer of a 32-token bf16 block, head size 64).
"""

from __future__ import annotations

import json
from typing import Any

import click

from ucm_db.components import codec
from ucm_db.tools.bench.codec_pool import bf16_like, measure

_CONFIGS = ("grouped", "alone", "none")


def _ratio(frame_bytes: int, block_bytes: int) -> float:
    """Raw over stored bytes of one block, as the codec stores it now."""
    block = bf16_like(1, block_bytes)[0]
    frames = codec.Framed(block, (frame_bytes,) * (block_bytes // frame_bytes))
    encoded = codec.encode_parts(bytes(32), frames, codec="zstd", element_bytes=2)
    return round(block_bytes / encoded.body_len, 3)


def _one(config: str, frame_bytes: int, block_bytes: int, runs: int) -> dict[str, float]:
    saved = codec.ZSTD_GROUP_BYTES
    try:
        if config == "alone":
            codec.ZSTD_GROUP_BYTES = 1
        figures = measure(frame_bytes, block_bytes, 0, runs, codec_name="none" if config == "none" else "zstd")
        if config != "none":
            figures["ratio"] = _ratio(frame_bytes, block_bytes)
        return figures
    finally:
        codec.ZSTD_GROUP_BYTES = saved


def run(frame_sizes: list[int], block_bytes: int, runs: int) -> list[dict[str, Any]]:
    """One row per frame size; the three configurations take turns."""
    rows = []
    for frame_bytes in frame_sizes:
        row: dict[str, Any] = {"frame_bytes": frame_bytes, "block_bytes": block_bytes}
        for config in _CONFIGS:
            row[config] = _one(config, frame_bytes, block_bytes, runs)
        for what in ("decode", "encode"):
            row[f"{what}_grouped_over_alone"] = round(row["grouped"][f"{what}_MBps"] / row["alone"][f"{what}_MBps"], 2)
        rows.append(row)
    return rows


@click.command("codec-frames", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--frame-kib", default="8,32,64,256", show_default=True, help="comma list of caller frame sizes (KiB)")
@click.option("--block-kib", type=click.IntRange(min=64), default=512, show_default=True, help="block size (KiB; a multiple of every frame size)")
@click.option("--runs", type=click.IntRange(min=1), default=11, show_default=True, help="repetitions (medians reported)")
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(frame_kib: str, block_kib: int, runs: int, as_json: bool) -> None:
    """zstd with adjacent small frames grouped against every frame alone, and codec none.

    \b
    Example:
        ucm-db bench codec-frames
        ucm-db bench codec-frames --frame-kib 8 --block-kib 2048 --runs 5
    """
    sizes = [int(kib) << 10 for kib in frame_kib.split(",") if kib.strip()]
    block_bytes = block_kib << 10
    bad = [size >> 10 for size in sizes if size <= 0 or block_bytes % size]
    if bad:
        raise click.BadParameter(f"frame sizes {bad} KiB do not divide the {block_kib} KiB block", param_hint="--frame-kib")
    rows = run(sizes, block_bytes, runs)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"16 MiB of bf16-like {block_kib} KiB blocks through Store.put / Store.get_into, caller's thread, "
               f"median of {runs}, MB/s of raw bytes; zstd groups up to {codec.ZSTD_GROUP_BYTES >> 10} KiB")
    click.echo(f"{'frame':>7} | {'decode grouped':>14} {'alone':>6} {'none':>6} {'x':>5} | "
               f"{'encode grouped':>14} {'alone':>6} {'none':>6} {'x':>5} | {'ratio grouped':>13} {'alone':>6}")
    for r in rows:
        g, a, n = r["grouped"], r["alone"], r["none"]
        click.echo(f"{r['frame_bytes'] >> 10:>5}Ki | {g['decode_MBps']:>14} {a['decode_MBps']:>6} {n['decode_MBps']:>6} "
                   f"{r['decode_grouped_over_alone']:>5} | {g['encode_MBps']:>14} {a['encode_MBps']:>6} {n['encode_MBps']:>6} "
                   f"{r['encode_grouped_over_alone']:>5} | {g['ratio']:>13} {a['ratio']:>6}")
