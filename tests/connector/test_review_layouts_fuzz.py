"""Seeded model-based review of the KV layouts and the copies between paged KV caches and the store (WRONG-KV).

A seed draws a layout (``cpu``; ``flash``; ``kv_tuple``, V's head size K's or half; ``mla``, 3-D or vLLM 0.32's
``cpu`` view of one head), KV dtype (bf16, f16, f32; uint8, int8 as vLLM's fp8/int8 caches), block size, kernel
blocks per vLLM block, KV heads, head size, layers, writer TP a, reader TP b, each rank's physical arrangement (dense,
storage offset, every other block, padded rows, heads and tokens swapped), store (LMDB; RocksDB on some seeds), codec,
compressible data or not, load mode (block, layer, async, or device_loads.py's accelerator path in chunks of 1-3
blocks) and load threads; "many" seeds load over 64 units at once, "big" ones have units over zstd's 256 KiB group.
The layout record is ``kv_shape``'s (CPU: no view named; CUDA: the ``cpu`` view; elsewhere the runner's).

Writers, each rank a real ``UcmDbWorker`` over its KV heads, save a chain in pieces (parents named, block ids in
random order), then a piece again from other blocks; half the seeds then lose one head's unit (and its descendants).
Readers, every rank, load a prefix into noisy caches at other ids, part of it twice (two requests), and a key never
stored. Invariants, byte for byte over each cache's whole storage:
    * a loaded slot holds, for the rank's heads, what was first saved under its key; load errors are exactly the
      blocks missing a unit of the rank's heads; no other byte changes (padding, other blocks; failed blocks too,
      except in an in-place load, where loads.py lets them hold part of their units).
    * a reader of another dtype, head size or kind never takes the writer's units as its own: under its own
      namespace every block misses; its caches under the writer's namespace are a ConfigError where the namespace
      names the view (CPU, CUDA records), else (runner) every block of another unit size misses.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import ucm_db  # noqa: E402
from ucm_db.connector.identity import KVShape, grid, namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker import device_loads  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys.units import UnitSpan, head_range, unit_key  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8)
LAYER = "model.layers.{}.self_attn.attn"
#: Axis of the blocks / KV heads / tokens in each logical tensor of a layer ([2, ...] for flash, per tensor else).
BLOCK_AXIS = {"cpu": 0, "flash": 1, "kv_tuple": 0, "mla": 0}
HEAD_AXIS = {"cpu": 1, "flash": 3, "kv_tuple": 2, "mla": None}
TOKEN_AXIS = {"cpu": 2, "flash": 2, "kv_tuple": 1, "mla": 1}
ARRANGEMENTS = ("dense", "offset", "gap", "pad", "swap")
#: Every kind, platform record and size class, RocksDB (80) and the device path among them; the rest under --long.
FAST_SEEDS: list[Any] = [0, 1, 2, 4, 7, 8, 9, 11, 12, 13, 15, 16, 80]
LONG_SEEDS: list[Any] = [pytest.param(s, marks=pytest.mark.long) for s in range(150) if s not in FAST_SEEDS]


@dataclass(frozen=True)
class Scenario:
    """One seed's deployment: the model's KV, the writer's and reader's TP and caches, the store."""

    kind: str
    mla4: bool  # MLA as a ``cpu`` layout of one head (vLLM 0.32)
    dtype: torch.dtype
    block: int  # tokens of a vLLM block; ``ratio`` kernel blocks each
    ratio: int
    heads: int  # the model's KV heads; ``head``, ``head_v``: K's and V's head sizes (MLA: the latent's)
    head: int
    head_v: int
    layers: int
    chain: int  # blocks of the saved chain
    num_blocks: int
    writer_tp: int
    reader_tp: int
    platform: str  # "cpu" (no view named), "cuda" (the cpu view named), "runner"
    engine: str
    codec: str
    load_mode: str
    load_threads: int
    device_path: bool  # readers load through device_loads.py (the accelerator path), in chunks of 1-3 blocks
    compressible: bool  # the model's KV of few distinct bytes (zstd keeps it compressed)

    @property
    def isz(self) -> int:
        return self.dtype.itemsize

    @property
    def unit_bytes(self) -> int:
        """One KV head's unit (MLA: the latent's) over every layer."""
        return self.layers * self.block * (self.head if self.mla else self.head + self.head_v) * self.isz

    @property
    def mla(self) -> bool:
        return self.kind == "mla" or self.mla4

    @property
    def detected(self) -> str:
        """The kind detect_layout sees."""
        return "cpu" if self.mla4 else self.kind


def draw(seed: int) -> Scenario:
    """Seed ``seed``'s scenario: mostly small; some "many" (over 64 units a load), some "big" (units > 256 KiB)."""
    rng = random.Random(seed)
    kind = ("cpu", "flash", "kv_tuple", "mla")[seed % 4]
    mla4 = kind == "mla" and rng.random() < 0.5
    size = rng.choice(["small", "small", "small", "many", "big"])
    heads = 1 if kind == "mla" else rng.choice({"many": [8], "big": [1, 2]}.get(size, [1, 2, 4]))
    tps = [1, 1, 2] if size == "many" else [t for t in (1, 2, 4, 8) if t <= 2 * heads or t <= 2]
    chain = {"many": rng.randint(8, 12), "big": rng.randint(2, 3)}.get(size, rng.randint(2, 5))
    block = {"many": rng.choice([2, 4]), "big": rng.choice([64, 128])}.get(size, rng.choice([2, 4, 8, 16]))
    head = {"big": 128 if kind != "mla" else 512}.get(size, rng.choice([4, 8, 12]))
    platform = rng.choice(["cpu", "cuda"]) if kind == "cpu" or mla4 else "runner"
    head_v = head // 2 if kind == "kv_tuple" and rng.random() < 0.5 else head
    return Scenario(kind=kind, mla4=mla4, dtype=rng.choice(DTYPES[:3] if size == "big" else DTYPES), block=block,
                    ratio=rng.choice([1, 1, 2]), heads=heads, head=head, head_v=head_v,
                    layers=3 if size == "big" else rng.randint(1, 3),
                    chain=chain, num_blocks=2 * chain + 1 + rng.randint(0, 2), writer_tp=rng.choice(tps),
                    reader_tp=rng.choice(tps), platform=platform, engine="rocksdb" if seed % 11 == 3 else "lmdb",
                    codec=rng.choice(["none", "zstd"]), load_mode=rng.choice(["block", "layer", "async"]),
                    load_threads=rng.choice([1, 2]), device_path=rng.random() < 0.3, compressible=rng.random() < 0.5)


def logical_shapes(sc: Scenario, heads: int) -> list[tuple[int, ...]]:
    """Byte shapes of one layer's tensors holding ``heads`` KV heads (the last axis in bytes)."""
    nb, kb, k, v = sc.num_blocks * sc.ratio, sc.block // sc.ratio, sc.head * sc.isz, sc.head_v * sc.isz
    shapes: dict[str, list[tuple[int, ...]]] = {
        "mla4": [(nb, 1, kb, k)], "cpu": [(nb, heads, kb, k + v)], "flash": [(2, nb, kb, heads, k)],
        "kv_tuple": [(nb, kb, heads, k), (nb, kb, heads, v)], "mla": [(nb, kb, k)]}
    return shapes["mla4" if sc.mla4 else sc.kind]


def noise(shape: tuple[int, ...], sc: Scenario, gen: torch.Generator) -> torch.Tensor:
    """Random bytes that are no NaN in a float dtype (the exponent's top bit cleared)."""
    out = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if sc.dtype.is_floating_point:
        out.view(-1, sc.isz)[:, -1] &= 0xBF
    return out


def arranged(sc: Scenario, shape: tuple[int, ...], how: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(its whole storage, a byte view of logical ``shape`` laid out as ``how`` says in it), both full of noise."""
    blocks, heads, tokens = BLOCK_AXIS[sc.detected], HEAD_AXIS[sc.detected], TOKEN_AXIS[sc.detected]
    how = "pad" if how == "swap" and heads is None else how
    physical = list(shape)
    if how == "gap":
        physical[blocks] *= 2
    elif how == "pad":
        physical[-1] += 4 * sc.isz
    elif how == "swap":
        physical[heads], physical[tokens] = physical[tokens], physical[heads]  # type: ignore[index]
    extra = 16 if how == "offset" else 0
    storage = noise((extra + int(torch.Size(physical).numel()),), sc, gen)
    view = storage[extra:].view(physical)
    if how in ("gap", "pad", "swap"):
        view = {"gap": lambda: view[(slice(None),) * blocks + (slice(None, None, 2),)],
                "pad": lambda: view.narrow(-1, 0, shape[-1]), "swap": lambda: view.transpose(heads or 0, tokens)}[how]()
    assert tuple(view.shape) == shape
    return storage, view


def narrow_heads(sc: Scenario, view: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
    axis = HEAD_AXIS[sc.detected]
    return view if axis is None or sc.mla4 else view.narrow(axis, heads[0], heads[1] - heads[0])


def blocks_of(sc: Scenario, view: torch.Tensor, block: int) -> torch.Tensor:
    """vLLM block ``block`` of a byte view (its kernel blocks)."""
    return view.narrow(BLOCK_AXIS[sc.detected], block * sc.ratio, sc.ratio)


class Rank:
    """One rank's caches (typed views, as vLLM registers them), each tensor's storage and byte view, a snapshot."""

    def __init__(self, sc: Scenario, tp: int, rank: int, how: str, gen: torch.Generator) -> None:
        self.heads = (0, 1) if sc.mla else head_range(sc.heads, tp, rank)
        count = self.heads[1] - self.heads[0]
        self.layers = [[arranged(sc, s, how, gen) for s in logical_shapes(sc, count)] for _ in range(sc.layers)]
        typed = [[v.view(sc.dtype) for _, v in tensors] for tensors in self.layers]
        self.caches = {LAYER.format(i): tuple(t) if sc.kind == "kv_tuple" else t[0] for i, t in enumerate(typed)}
        self.before = [[s.clone() for s, _ in tensors] for tensors in self.layers]


def model_kv(sc: Scenario, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """The model-wide KV (every head) of each layer, as contiguous byte tensors."""
    out = [[noise(s, sc, gen) for s in logical_shapes(sc, sc.heads)] for _ in range(sc.layers)]
    for tensor in (t for layer in out for t in layer) if sc.compressible else ():
        tensor &= 0x13
    return out


def shape_of(sc: Scenario, tp: int) -> KVShape:
    """The KVShape ``kv_shape`` gives this deployment (its layout record as kv_shape writes it)."""
    cache_dtype = {torch.uint8: "fp8", torch.int8: "int8"}.get(sc.dtype, "auto")
    record: dict[str, Any] = {"spec": "MLAAttentionSpec" if sc.mla else "FullAttentionSpec", "layers": sc.layers,
                              "kv_heads": 1 if sc.mla else sc.heads, "head_size": sc.head, "cache_dtype": cache_dtype}
    content = sc.unit_bytes // (sc.layers * sc.block)
    if sc.platform == "cpu":
        record["platform"] = "cpu-avx512"
    elif sc.platform == "cuda":
        record.update(platform="cuda", kv_view={"kind": "cpu", "block": [sc.block, content]})
    else:
        record.update(platform="npu" if sc.kind == "kv_tuple" else "cuda", kv_view={"kind": "runner", "runner": "x==1"})
    return KVShape(model="layouts-fuzz", kv_dtype=str(sc.dtype).removeprefix("torch."), block_size=sc.block,
                   use_mla=sc.mla, layout=json.dumps(record, sort_keys=True), tp_size=tp, pp_size=1,
                   kv_heads=1 if sc.mla else sc.heads, layers=sc.layers, unit_bytes=0 if sc.mla else sc.unit_bytes)


def settings(sc: Scenario, root: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(root / "store"), "codec": sc.codec, "engine": sc.engine,
                                                "load_mode": sc.load_mode, "load_threads": sc.load_threads,
                                                "save_process": False})


def worker(sc: Scenario, root: Path, shape: KVShape, rank: int, caches: dict[str, Any]) -> UcmDbWorker:
    """A real worker half of rank ``rank`` over ``caches`` (no engine: the ranks are passed here). A refused
    registration raises before the store is acquired: nothing to shut down."""
    out = UcmDbWorker(settings(sc, root), shape, sc.num_blocks)
    out.register_kv_caches(caches, rank, 0)
    return out


def plan_saves(sc: Scenario, keys: list[bytes],
               rng: random.Random) -> tuple[list[list[BlockTransfer]], dict[bytes, int]]:
    """The writer's steps (the chain in pieces, then a piece again from other blocks) and the source block of
    each key's stored bytes (its first save)."""
    src = rng.sample(range(sc.num_blocks), len(keys))
    cuts = sorted(rng.sample(range(1, len(keys)), rng.randint(0, min(2, len(keys) - 1))))
    pieces = list(zip([0, *cuts], [*cuts, len(keys)]))
    transfers = [BlockTransfer("w", tuple(keys[a:b]), tuple(src[a:b]), keys[a - 1] if a else None) for a, b in pieces]
    a, b = rng.choice(pieces)
    others = rng.sample([i for i in range(sc.num_blocks) if i not in src[a:b]], b - a)
    again = BlockTransfer("w2", tuple(keys[a:b]), tuple(others), keys[a - 1] if a else None)
    steps = [transfers, [again]] if rng.random() < 0.5 else [transfers + [again]]
    return steps, dict(zip(keys, src))


def write(sc: Scenario, root: Path, model: list[list[torch.Tensor]], steps: list[list[BlockTransfer]],
          rng: random.Random, gen: torch.Generator) -> None:
    """Every writer rank saves ``steps`` (a step's save transfers each) out of its share of ``model``."""
    shape = shape_of(sc, sc.writer_tp)
    for rank in range(sc.writer_tp):
        caches = Rank(sc, sc.writer_tp, rank, rng.choice(ARRANGEMENTS), gen)
        for layer, tensors in zip(model, caches.layers):
            for whole, (_, view) in zip(layer, tensors):
                view.copy_(narrow_heads(sc, whole, caches.heads))
        w = worker(sc, root, shape, rank, caches.caches)
        try:
            for step, saves in enumerate(steps):
                w.save(UcmDbConnectorMetadata(saves=saves, step=step))
                w.drain()
            assert w.counters.totals.data.get("save_errors", 0) == 0
        finally:
            w.shutdown()


def load(w: UcmDbWorker, sc: Scenario, transfers: list[BlockTransfer]) -> set[int]:
    """One step loading ``transfers`` as the load mode does; the block ids reported failed."""
    if sc.load_mode == "async":
        w.start_load(UcmDbConnectorMetadata(async_loads=transfers, step=1))
        done, wanted = set[str](), {t.req_id for t in transfers}
        for _ in range(200):  # each reported once, as its load ends
            done |= w.finished_loads(wait_s=0.05)
            if done >= wanted:
                break
        assert done == wanted, done
    elif sc.device_path:  # chunks of 1-3 blocks (device_loads.CHUNK_BYTES is set by the test)
        w.start_load(UcmDbConnectorMetadata(step=1))
        return w._loads._load_on_device(transfers, None, False, None)  # KV caches on an accelerator: this path
    else:
        w.start_load(UcmDbConnectorMetadata(loads=transfers, step=1))
        for i in range(sc.layers):
            w.wait_for_layer(LAYER.format(i))
    return w.take_load_errors()


def check(sc: Scenario, reader: Rank, model: list[list[torch.Tensor]], placed: dict[int, int], what: str,
          free: set[int] = set()) -> None:
    """Every byte of ``reader``'s storage is as before but for source block ``placed[dst]`` of the model at each
    ``dst`` (the rank's heads); blocks ``free`` may hold anything (an in-place load's failed blocks: loads.py)."""
    for i, (layer, tensors, before) in enumerate(zip(model, reader.layers, reader.before)):
        for j, (whole, (storage, view), want) in enumerate(zip(layer, tensors, [b.clone() for b in before])):
            typed = want.as_strided(view.shape, view.stride(), view.storage_offset())
            for dst, src in placed.items():
                blocks_of(sc, typed, dst).copy_(blocks_of(sc, narrow_heads(sc, whole, reader.heads), src))
            for dst in free:
                blocks_of(sc, typed, dst).copy_(blocks_of(sc, view, dst))
            differ = (storage != want).nonzero()
            assert not len(differ), f"{what}: layer {i} tensor {j}: {len(differ)} bytes differ, first at {differ[:4]}"


def punch(sc: Scenario, root: Path, keys: list[bytes], rng: random.Random) -> tuple[int, int]:
    """Deletes one head's unit of one block of the chain (and its descendants: the prefix invariant), half the
    time; returns (that head, the first block gone), or (0, len(keys)) for none."""
    if rng.random() < 0.5:
        return 0, len(keys)
    head, at = rng.randrange(sc.heads), rng.randrange(1, len(keys))  # block 0 stays: some blocks load
    shape, options = shape_of(sc, 1), settings(sc, root)
    span = UnitSpan(0, 1, 0, sc.layers) if sc.mla else UnitSpan(head, head + 1, 0, sc.layers)
    with ucm_db.open(options.path, **options.store_options) as store:
        assert store.delete(namespace(shape), [unit_key(keys[at], span, grid(shape))]) >= 1
    return head, at


def read_all(sc: Scenario, root: Path, model: list[list[torch.Tensor]], keys: list[bytes], first: dict[bytes, int],
             rng: random.Random, gen: torch.Generator, hows: tuple[str, ...] = ARRANGEMENTS) -> None:
    hole_head, hole_at = punch(sc, root, keys, rng)
    loaded = keys[: rng.randint(1, len(keys))]
    lost = namespace(shape_of(sc, 1)).block_keys([9999] * sc.block)  # never stored
    twice = loaded[: rng.randint(0, len(loaded))]  # another request's load of the same prefix, in the same step
    dst = rng.sample(range(sc.num_blocks), len(loaded) + len(twice) + 1)
    cut = rng.randint(1, len(loaded))
    parts = [("r1", loaded[:cut], dst[:cut]), ("r2", loaded[cut:], dst[cut : len(loaded)]),
             ("r4", twice, dst[len(loaded) : -1]), ("r3", lost, dst[-1:])]
    transfers = [BlockTransfer(req, tuple(k), tuple(ids)) for req, k, ids in parts if k]
    loaded = loaded + twice
    for rank in range(sc.reader_tp):
        reader = Rank(sc, sc.reader_tp, rank, rng.choice(hows), gen)
        w = worker(sc, root, shape_of(sc, sc.reader_tp), rank, reader.caches)
        in_place = w.layout.writes_units_in_place and sc.load_mode != "layer" and not sc.device_path
        try:
            failed = load(w, sc, transfers)
        finally:
            w.shutdown()
        holed = sc.mla or reader.heads[0] <= hole_head < reader.heads[1]
        missing = {d for d, k in zip(dst, loaded) if keys.index(k) >= hole_at} if holed else set()
        assert failed == missing | {dst[-1]}, f"rank {rank}: failed {failed}, not {missing | {dst[-1]}}"
        placed = {d: first[k] for d, k in zip(dst, loaded) if d not in missing}
        check(sc, reader, model, placed, f"reader tp={sc.reader_tp} rank {rank} (in place: {in_place})",
              missing if in_place else set())


def mutations(sc: Scenario) -> list[Scenario]:
    """Readers whose KV differs from the writer's in dtype, head size or layout kind."""
    other = [d for d in DTYPES if d != sc.dtype]
    out = [replace(sc, dtype=other[0]), replace(sc, dtype=other[-1]),
           replace(sc, head=2 * sc.head, head_v=2 * sc.head_v)]
    if sc.kind == "cpu" and sc.heads > 1:
        out.append(replace(sc, kind="flash", platform="runner"))
    if sc.kind in ("flash", "kv_tuple"):
        out.append(replace(sc, kind="cpu", platform="cuda", head_v=sc.head))
    return out


def refusals(sc: Scenario, root: Path, keys: list[bytes], gen: torch.Generator) -> None:
    transfers, every = [BlockTransfer("x", tuple(keys), tuple(range(len(keys))))], set(range(len(keys)))
    for other in mutations(sc):
        same_view = (other.detected, other.head, other.head_v, other.isz) == (sc.detected, sc.head, sc.head_v, sc.isz)
        view_named = sc.platform != "runner"
        lies = not same_view and (view_named or other.unit_bytes != sc.unit_bytes)  # a lie its namespace can catch
        for honest in (True, False) if lies else (True,):  # its own namespace; the writer's, its caches not as it says
            reader = Rank(other, 1, 0, "dense", gen)
            try:
                w = worker(other, root, shape_of(other if honest else sc, 1), 0, reader.caches)
            except ConfigError as exc:
                assert not honest and view_named, f"{other}: {exc}"
                continue
            try:
                assert honest or not view_named, f"{other} registered under the writer's namespace naming another view"
                failed = load(w, other, transfers)
            finally:
                w.shutdown()
            assert failed == every, f"{other} (honest={honest}) loaded blocks {every - failed}"
            check(other, reader, reader.before, {}, f"{other} (honest={honest})")


def run(sc: Scenario, root: Path, seed: int, monkeypatch: pytest.MonkeyPatch,
        hows: tuple[str, ...] = ARRANGEMENTS) -> None:
    """Writes the scenario's chain, reads it back at the reader TP, then tries the readers of other views."""
    rng, gen = random.Random(seed * 7919), torch.Generator().manual_seed(seed)
    monkeypatch.setattr(device_loads, "CHUNK_BYTES", sc.unit_bytes * sc.heads * (1 + seed % 3))
    model = model_kv(sc, gen)
    keys = namespace(shape_of(sc, 1)).block_keys([seed * 100 + t for t in range(sc.chain * sc.block)])
    steps, first = plan_saves(sc, keys, rng)
    write(sc, root, model, steps, rng, gen)
    read_all(sc, root, model, keys, first, rng, gen, hows)
    refusals(sc, root, keys, gen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", FAST_SEEDS + LONG_SEEDS)
def test_every_rank_loads_the_bytes_saved_under_its_keys_and_nothing_else(tmp_path: Path, seed: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run(draw(seed), tmp_path, seed, monkeypatch)


F8 = replace(draw(0), kind="cpu", mla4=False, dtype=torch.float8_e4m3fn, ratio=1, heads=2, writer_tp=1, reader_tp=2,
             platform="cpu", load_mode="block", device_path=False)


def test_a_float8_cache_round_trips_where_units_go_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``fp8_inc`` KV cache dtype is ``torch.float8_e4m3fn``: a contiguous ``cpu`` cache copies bytes."""
    run(F8, tmp_path, 0, monkeypatch, hows=("dense", "offset"))


@pytest.mark.parametrize("kind", ["flash", "kv_tuple"])
def test_a_float8_cache_in_a_staged_layout_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """CPU torch has no float8 ``index_copy_``: the staged copies run on integer views of the same width."""
    run(replace(F8, kind=kind, platform="runner"), tmp_path, 0, monkeypatch, hows=("dense",))
