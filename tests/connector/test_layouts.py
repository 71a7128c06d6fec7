"""Layouts that cannot run here, exercised with CPU tensors of their shapes.

Each test stores blocks gathered from one set of KV tensors in a real ucm-db
store, loads them into zeroed tensors at other block ids, and compares the
blocks bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ucm_db
from ucm_db.connector.layouts import KVLayout, detect_layout
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace

NUM_BLOCKS, BLOCK, HEADS, HEAD = 6, 32, 2, 64
LAYERS = 3


def _cpu() -> torch.Tensor:
    return torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)


def _flash() -> torch.Tensor:
    return torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD).to(torch.bfloat16)


def _mla() -> torch.Tensor:
    return torch.randn(NUM_BLOCKS, BLOCK, 576).to(torch.bfloat16)


def _ascend() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD).to(torch.float16), torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD).to(torch.float16))


def _block_bits(entry: torch.Tensor | tuple[torch.Tensor, ...], kind: str, block: int) -> torch.Tensor:
    """The block's elements as raw int16 (bit-exact comparison)."""
    if kind == "kv_tuple":
        parts = [t[block] for t in entry]
    elif kind == "flash":
        parts = [entry[0, block], entry[1, block]]
    else:
        parts = [entry[block]]
    return torch.cat([p.reshape(-1).view(torch.int16) for p in parts])


def _zeros_like(entry: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tuple(torch.zeros_like(t) for t in entry) if isinstance(entry, tuple) else torch.zeros_like(entry)


MAKERS: dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = {
    "cpu": _cpu, "flash": _flash, "mla": _mla, "kv_tuple": _ascend,
}


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_block_round_trip_through_the_store_is_bit_exact(tmp_path: Path, kind: str, codec: str) -> None:
    torch.manual_seed(0)
    source = {f"model.layers.{i}.attn": MAKERS[kind]() for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    assert layout.kind == kind
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=BLOCK, layout=kind)
    keys = ns.block_keys(list(range(2 * BLOCK)))
    staging = layout.new_staging(2)
    layout.gather([4, 1], staging)
    with ucm_db.open(tmp_path / "store", codec=codec) as store:
        store.put(ns, keys, [layout.frames(row) for row in staging.numpy()])
        target = {name: _zeros_like(entry) for name, entry in source.items()}
        target_layout = detect_layout(target, NUM_BLOCKS)
        loaded = target_layout.new_staging(2)
        assert store.get_into(ns, keys, list(loaded.numpy())) == [True, True]
    target_layout.scatter([0, 5], loaded)
    for name in source:
        assert torch.equal(_block_bits(source[name], kind, 4), _block_bits(target[name], kind, 0))
        assert torch.equal(_block_bits(source[name], kind, 1), _block_bits(target[name], kind, 5))
        # Blocks not loaded stay untouched.
        assert not _block_bits(target[name], kind, 2).any()


def test_one_frame_per_layer_in_registration_order() -> None:
    source = {f"l{i}": _cpu() for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    staging = layout.new_staging(1)
    layout.gather([3], staging)
    frames = layout.frames(staging.numpy()[0])
    assert len(frames) == LAYERS
    for frame, tensor in zip(frames, source.values()):
        assert bytes(frame) == tensor[3].contiguous().view(torch.uint8).numpy().tobytes()


def test_layer_scatter_touches_only_that_layer() -> None:
    source = {f"l{i}": _flash() for i in range(LAYERS)}
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    staging = detect_layout(source, NUM_BLOCKS).new_staging(1)
    detect_layout(source, NUM_BLOCKS).gather([2], staging)
    layout = detect_layout(target, NUM_BLOCKS)
    layout.scatter([2], staging, layer=1)
    assert torch.equal(target["l1"], torch.where(torch.arange(NUM_BLOCKS).view(1, -1, 1, 1, 1) == 2, source["l1"], 0))
    assert not target["l0"].any() and not target["l2"].any()


def test_kernel_blocks_smaller_than_vllm_blocks() -> None:
    # 12 kernel blocks of 16 tokens back 6 vLLM blocks of 32.
    source = {"l0": torch.randn(2 * NUM_BLOCKS, HEADS, 16, 2 * HEAD).to(torch.bfloat16)}
    layout = detect_layout(source, NUM_BLOCKS)
    assert layout.block_bytes == 2 * source["l0"][0].numel() * 2
    staging = layout.new_staging(1)
    layout.gather([1], staging)
    assert bytes(staging.numpy()[0]) == source["l0"][2:4].contiguous().view(torch.uint8).numpy().tobytes()


def test_non_contiguous_segments_copy_correctly() -> None:
    # A HND-strided flash cache: block-major view that is not contiguous.
    base = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, HEAD).to(torch.bfloat16)
    source = {"l0": base.transpose(2, 3)}
    target = {"l0": torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK, HEAD, dtype=torch.bfloat16).transpose(2, 3)}
    staging = detect_layout(source, NUM_BLOCKS).new_staging(1)
    detect_layout(source, NUM_BLOCKS).gather([3], staging)
    detect_layout(target, NUM_BLOCKS).scatter([4], staging)
    assert torch.equal(target["l0"][:, 4], source["l0"][:, 3])


@pytest.mark.parametrize("bad", [torch.zeros(4, 4), torch.zeros(2, 2, 2, 2, 2, 2), (torch.zeros(4, 4, 4),)])
def test_unknown_layout_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="layer l0"):
        detect_layout({"l0": bad})


def test_no_layers_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no KV cache layers"):
        KVLayout("cpu", [])


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_units_decoded_in_place_equal_units_staged_and_scattered(tmp_path: Path, codec: str) -> None:
    """A ``cpu`` cache takes each unit straight into its slabs (one per
    layer): the same bits as staging the unit and scattering it, and no
    other block is touched."""
    torch.manual_seed(1)
    source = {f"l{i}": _cpu() for i in range(LAYERS)}
    layout = detect_layout(source, NUM_BLOCKS)
    assert layout.writes_units_in_place
    staging = layout.new_unit_staging(2)
    layout.gather_units([4, 1], staging)
    ns = Namespace(model="m", kv_dtype="bfloat16", block_size=BLOCK, layout="cpu")
    chains = [ns.block_keys([h * 1000 + t for t in range(2 * BLOCK)]) for h in range(HEADS)]
    keys = [chains[h][b] for b in range(2) for h in range(HEADS)]  # block-major, as unit staging rows
    rows = staging.numpy()
    with ucm_db.open(tmp_path / "store", codec=codec) as store:
        for h in range(HEADS):
            store.put(ns, chains[h], [layout.unit_frames(rows[b, h]) for b in range(2)])
        staged = {name: torch.zeros_like(t) for name, t in source.items()}
        staged_layout = detect_layout(staged, NUM_BLOCKS)
        loaded = staged_layout.new_unit_staging(2)
        assert store.get_into(ns, keys, [loaded.numpy()[b, h] for b in range(2) for h in range(HEADS)]) == [True] * 4
        staged_layout.scatter_units([0, 5], loaded)
        in_place = {name: torch.zeros_like(t) for name, t in source.items()}
        assert store.get_into(ns, keys, detect_layout(in_place, NUM_BLOCKS).unit_slabs([0, 5])) == [True] * 4
    for name in source:
        assert torch.equal(in_place[name].view(torch.int16), staged[name].view(torch.int16))
        assert torch.equal(in_place[name][0].view(torch.int16), source[name][4].view(torch.int16))
        assert torch.equal(in_place[name][5].view(torch.int16), source[name][1].view(torch.int16))
        assert not in_place[name][1:5].any()


def test_units_go_in_place_only_where_a_heads_share_is_one_slab() -> None:
    def layout_of(make: Callable[[], object], num_blocks: int = NUM_BLOCKS) -> KVLayout:
        return detect_layout({f"l{i}": make() for i in range(LAYERS)}, num_blocks)  # type: ignore[misc]

    assert layout_of(_cpu).writes_units_in_place
    for make in (_flash, _mla, _ascend):
        assert not layout_of(make).writes_units_in_place
    # Kernel blocks of 16 tokens inside vLLM blocks of 32: a head's share is two slabs.
    assert not layout_of(lambda: torch.randn(2 * NUM_BLOCKS, HEADS, 16, 2 * HEAD).to(torch.bfloat16)).writes_units_in_place
    # Block-major but not contiguous (every other block of a larger cache).
    assert not layout_of(lambda: torch.randn(2 * NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)[::2]).writes_units_in_place
    with pytest.raises(ConfigError, match="in place"):
        layout_of(_flash).unit_slabs([0])


@pytest.mark.parametrize("head_sizes", [(HEAD, HEAD, HEAD), (HEAD, HEAD // 2, HEAD)])
def test_unit_slabs_are_each_heads_slab_of_each_layer(head_sizes: tuple[int, ...]) -> None:
    # One slab size (sliced with one slice object) or several: the same views.
    caches = {f"l{i}": torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * h).to(torch.bfloat16) for i, h in enumerate(head_sizes)}
    slabs = detect_layout(caches, NUM_BLOCKS).unit_slabs([4, 1])
    assert len(slabs) == 2 * HEADS
    for row, (block, head) in enumerate((b, h) for b in (4, 1) for h in range(HEADS)):
        want = [t[block, head].contiguous().view(torch.uint8).numpy().tobytes() for t in caches.values()]
        assert [bytes(view) for view in slabs[row]] == want


def test_cpu_units_are_gathered_slab_by_slab_like_the_generic_path() -> None:
    # A cpu cache's units are copied straight from its slabs (one numpy take
    # per layer); the bytes equal each head's slab of each layer in order,
    # and so what the generic torch path (a strided copy of the same cache) gives.
    caches = {f"l{i}": _cpu() for i in range(3)}
    layout = detect_layout(caches, NUM_BLOCKS)
    assert layout.writes_units_in_place
    staging = layout.new_unit_staging(3)
    layout.gather_units([4, 0, 5], staging)
    for row, block in enumerate([4, 0, 5]):
        for head in range(HEADS):
            want = torch.cat([caches[f"l{i}"][block, head].reshape(-1).view(torch.uint8) for i in range(3)])
            assert torch.equal(staging[row, head], want)
    strided = {name: torch.cat([t, t], dim=2)[:, :, :BLOCK] for name, t in caches.items()}  # same values, not contiguous
    generic = detect_layout(strided, NUM_BLOCKS)
    assert not generic.writes_units_in_place
    other = generic.new_unit_staging(3)
    generic.gather_units([4, 0, 5], other)
    assert torch.equal(staging, other)
    with pytest.raises(IndexError):
        layout.gather_units([NUM_BLOCKS], layout.new_unit_staging(1))
