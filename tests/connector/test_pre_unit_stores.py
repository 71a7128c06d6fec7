"""Stores of the storage generations before units (whole blocks at TP=1,
per-rank blocks at TP>1): the connector refuses them at start with the
``ucm-db migrate`` command that converts them, the real CLI converts them,
and the connector then hits the converted blocks as units (real vLLM
request objects, real workers, real LMDB stores; no engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from click.testing import CliRunner  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import ucm_db  # noqa: E402
from ucm_db.connector.identity import KVShape, namespace  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.connector.metadata import UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import FormatVersionError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402
from ucm_db.keys.units import KVGrid, unit_key  # noqa: E402
from ucm_db.maintenance.pre_units import split_whole  # noqa: E402
from ucm_db.tools.cli import cli  # noqa: E402

BS, NUM_BLOCKS, HEAD, HEADS, LAYERS = 16, 12, 32, 4, 2


def _layout_json(platform: str = "cpu-test", heads: int = HEADS) -> str:
    return json.dumps({"kv_heads": heads, "layers": LAYERS, "head_size": HEAD, "platform": platform},
                      sort_keys=True, separators=(",", ":"))


def _shape(tp: int, unit_bytes: int = LAYERS * BS * 2 * HEAD * 2) -> KVShape:
    return KVShape(model="pre-units", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout=_layout_json(),
                   tp_size=tp, pp_size=1, kv_heads=HEADS, layers=LAYERS, unit_bytes=unit_bytes)


def _model_kv() -> dict[str, torch.Tensor]:  # vLLM CPU's layout: [blocks, heads, block, 2*head]
    torch.manual_seed(1)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16)
            for i in range(LAYERS)}


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def _step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: (block_ids,), {})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _migrate(path: Path) -> str:
    result = CliRunner().invoke(cli, ["migrate", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _refused(settings: ConnectorSettings, shape: KVShape, path: Path) -> FormatVersionError:
    with pytest.raises(FormatVersionError) as info:
        UcmDbScheduler(settings, shape)
    assert f"ucm-db migrate {path}" in info.value.hint
    return info.value


def test_whole_blocks_are_refused_at_start_then_migrated_and_hit_as_units(tmp_path: Path) -> None:
    path = tmp_path / "s"
    settings = ConnectorSettings.from_extra_config({"path": str(path)})
    tokens = list(range(1, 3 * BS + 6))
    model_kv = _model_kv()
    # What the connector stored at TP=1 before units: whole blocks (layout.gather + frames) under the block keys.
    layout = detect_layout(model_kv, NUM_BLOCKS)
    staging = layout.new_staging(3)
    layout.gather([4, 9, 2], staging)
    with ucm_db.open(path) as store:
        store.put(namespace(_shape(1)), namespace(_shape(1)).block_keys(tokens), [layout.frames(row) for row in staging.numpy()])

    for tp in (1, 2):  # refused at start by every TP size, not a silent miss at the first lookup
        assert "whole blocks" in str(_refused(settings, _shape(tp), path))
    ucm_db.open(path).close()  # the refusing scheduler released the store
    dry = CliRunner().invoke(cli, ["migrate", "--dry-run", "--json", str(path)], catch_exceptions=False)
    assert json.loads(dry.output)["pre_unit_blocks"]["whole_blocks"] == 3
    assert "3 whole blocks split into 12 head units" in _migrate(path)
    assert "nothing to migrate" in _migrate(path)  # converted once

    sched = UcmDbScheduler(settings, _shape(2))
    req = _request("a", tokens)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * BS
    sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    req.num_computed_tokens = ext
    meta = sched.build_connector_meta(_step(req, [0, 1, 2, 3], len(tokens) - ext))
    (load,) = meta.loads
    assert load.block_ids == (0, 1, 2) and not meta.saves  # stored as units already: nothing to save again
    for rank in range(2):
        kv = {name: torch.zeros(NUM_BLOCKS, HEADS // 2, BS, 2 * HEAD, dtype=torch.bfloat16) for name in model_kv}
        worker = UcmDbWorker(settings, _shape(2), NUM_BLOCKS)
        worker.register_kv_caches(kv, rank, 0)
        worker.start_load(meta)
        assert worker.take_load_errors() == set()
        for name, full in model_kv.items():
            assert torch.equal(_bits(kv[name][0:3]), _bits(full[[4, 9, 2], 2 * rank : 2 * rank + 2]))
        worker.shutdown()
    sched.observe_output(UcmDbWorkerMetadata(meta.step), set())
    sched.shutdown()
    with ucm_db.open(path) as store:
        assert store.stats().blocks == 3 * HEADS  # the whole blocks are gone, their units stay


def test_per_rank_blocks_are_refused_at_start_and_dropped_by_migrate(tmp_path: Path) -> None:
    path = tmp_path / "s"
    settings = ConnectorSettings.from_extra_config({"path": str(path)})
    tokens = list(range(1, 2 * BS + 6))
    model_kv = _model_kv()
    rank_layout = json.dumps({**json.loads(_layout_json()), "kv_heads": HEADS // 2}, sort_keys=True, separators=(",", ":"))
    with ucm_db.open(path) as store:
        for rank in range(2):  # what a TP=2 deployment stored before units: each rank its heads, in its namespace
            ns = Namespace(model="pre-units", kv_dtype="bfloat16", block_size=BS, tp_rank=rank, tp_size=2, layout=rank_layout)
            layout = detect_layout({n: t[:, 2 * rank : 2 * rank + 2].contiguous() for n, t in model_kv.items()}, NUM_BLOCKS)
            staging = layout.new_staging(2)
            layout.gather([3, 8], staging)
            store.put(ns, ns.block_keys(tokens), [layout.frames(row) for row in staging.numpy()], parent=None)
        # A Python API user's namespace with a rank but no connector layout record: not the connector's, kept.
        other = Namespace(model="another-model", kv_dtype="bfloat16", block_size=BS, tp_rank=0, tp_size=2)
        store.put(other, other.block_keys(tokens), [b"x" * 64, b"y" * 64], parent=None)

    for tp in (1, 2):
        assert "per-rank blocks" in str(_refused(settings, _shape(tp), path))
    assert "4 per-rank blocks dropped" in _migrate(path)  # they cannot be re-keyed (no token ids stored)
    with ucm_db.open(path) as store:
        assert store.get(other, other.block_keys(tokens)) == [bytearray(b"x" * 64), bytearray(b"y" * 64)]

    sched = UcmDbScheduler(settings, _shape(2))
    assert sched.get_num_new_matched_tokens(_request("a", tokens), 0) == (0, False)  # a miss: recomputed, saved as units
    sched.shutdown()


def test_split_whole_matches_the_units_the_connector_writes() -> None:
    """The migration's byte rule against the connector's own CPU layout: a
    whole block split is each head's unit, frame by frame."""
    torch.manual_seed(2)
    caches = {f"l{i}": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16) for i in range(LAYERS)}
    layout = detect_layout(caches, NUM_BLOCKS)
    assert layout.kind == "cpu"
    whole = layout.new_staging(1)
    layout.gather([5], whole)
    units = layout.new_unit_staging(1)
    layout.gather_units([5], units)
    description = {"kv_dtype": "bfloat16", "block_size": BS, "layout": _layout_json("cpu-x86")}
    split = split_whole(whole.numpy()[0].tobytes(), description)
    assert len(split) == HEADS
    for head, frames in enumerate(split):
        expected = units.numpy()[0, head]
        assert b"".join(frames) == expected.tobytes()
        assert [len(f) for f in frames] == list(layout.unit_layer_bytes)
    with pytest.raises(FormatVersionError, match="cannot be split"):  # off CPU the record does not give the layout
        split_whole(whole.numpy()[0].tobytes(), {**description, "layout": _layout_json("cuda")})


def _cuda_caches(vllm: str) -> dict[str, torch.Tensor]:
    """What vLLM hands the connector on CUDA: 0.32 views every backend's
    cache ``[blocks, heads, block, K|V]`` over an allocation in NHD order
    (``vllm/v1/worker/utils.py: allocate_kv_cache``; FlashAttention splits
    K and V off the last axis), before 0.32 FlashAttention's own
    ``[2, blocks, block, heads, head]``."""
    if vllm == "0.32":
        return {f"l{i}": torch.randn(NUM_BLOCKS, BS, HEADS, 2 * HEAD).to(torch.bfloat16).permute(0, 2, 1, 3) for i in range(LAYERS)}
    return {f"l{i}": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD).to(torch.bfloat16) for i in range(LAYERS)}


@pytest.mark.parametrize("written", ["cpu", "cuda-0.32", "cuda-before-0.32"])
def test_migrate_writes_the_connectors_own_units_or_drops_the_block(tmp_path: Path, written: str) -> None:
    """A whole block's record names its platform, not the arrangement that
    wrote it: on CUDA two arrangements of one size were written (vLLM 0.32's
    head-major ``[block, K|V]``, FlashAttention's head-minor K then V before
    it). Every unit ``ucm-db migrate`` leaves is byte for byte the one the
    connector gathers from the same cache; whole blocks off CPU are dropped."""
    torch.manual_seed(3)
    caches = _model_kv() if written == "cpu" else _cuda_caches(written.removeprefix("cuda-"))
    layout = detect_layout(caches, NUM_BLOCKS)
    whole, units = layout.new_staging(1), layout.new_unit_staging(1)
    layout.gather([5], whole)
    layout.gather_units([5], units)  # what the connector reads for each head
    shape = KVShape(model="pre-units", kv_dtype="bfloat16", block_size=BS, use_mla=False, tp_size=1, pp_size=1,
                    layout=_layout_json("cpu-x86" if written == "cpu" else "cuda"), kv_heads=HEADS, layers=LAYERS)
    ns, path = namespace(shape), tmp_path / "s"
    keys = ns.block_keys(list(range(1, BS + 1)))
    with ucm_db.open(path) as store:
        store.put(ns, keys, [layout.frames(whole.numpy()[0])])
    out = _migrate(path)
    grid = KVGrid(HEADS, LAYERS)
    with ucm_db.open(path) as store:
        migrated = store.get(ns, [unit_key(keys[0], span, grid) for span in grid.head_spans()])
        blocks = store.stats().blocks
    for head, unit in enumerate(migrated):
        assert unit is None or bytes(unit) == units.numpy()[0, head].tobytes(), f"head {head}: not the connector's unit"
    assert blocks == (HEADS if written == "cpu" else 0)  # the whole block is gone either way
    if written != "cpu":
        assert "1 whole blocks written off CPU dropped: not convertible, recomputed on demand" in out


def test_conversion_refuses_while_the_store_is_open_elsewhere(tmp_path: Path) -> None:
    import subprocess
    import sys

    from ucm_db.errors import LockedError
    from ucm_db.maintenance.pre_units import convert

    path = tmp_path / "s"
    ns = namespace(_shape(1))
    tokens = list(range(1, BS + 1))
    with ucm_db.open(path) as store:
        store.put(ns, ns.block_keys(tokens), [b"\0" * (HEADS * LAYERS * BS * 2 * HEAD * 2)])
    holder = subprocess.Popen([sys.executable, "-c", f"import ucm_db, sys; s = ucm_db.open({str(path)!r}); print('open', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(LockedError):
            convert(path)
    finally:
        holder.communicate("", timeout=30)
    assert convert(path, dry_run=True).whole_blocks == 1  # nothing was converted


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_either_role_of_the_connector_refuses_an_older_generation_in_its_constructor(tmp_path: Path, role: str,
                                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ucm_db.connector.connector import UcmDbConnector
    from ucm_db.connector.identity import kv_shape

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                head_dim=64, vocab_size=1000, max_position_embeddings=512).save_pretrained(model_dir)
    path = tmp_path / "store"
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute", kv_connector_extra_config={"path": str(path)})
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
                             cache_config=CacheConfig(block_size=BS), kv_transfer_config=transfer)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    shape = kv_shape(vllm_config, kv_cache_config, None)
    assert shape.unit_bytes == 2 * BS * (64 + 64) * 2  # layers x block x (K + V head size) x bf16, from the spec
    rank_layout = json.dumps({**json.loads(shape.layout), "kv_heads": 1}, sort_keys=True, separators=(",", ":"))
    ns = Namespace(model=shape.model, kv_dtype=shape.kv_dtype, block_size=BS, tp_rank=1, tp_size=2, layout=rank_layout)
    with ucm_db.open(path) as store:  # what this model's TP=2 deployment stored before units
        store.put(ns, ns.block_keys(list(range(BS))), [b"\0" * 64])

    with caplog.at_level("ERROR", logger="vllm.ucm_db.connector.connector"), pytest.raises(FormatVersionError) as info:
        UcmDbConnector(vllm_config, getattr(KVConnectorRole, role), kv_cache_config)
    assert f"ucm-db migrate {path}" in info.value.hint and "per-rank blocks" in str(info.value)
    assert f"ucm-db connector cannot start: {info.value}" in caplog.messages


def test_a_whole_block_that_cannot_be_split_is_dropped_with_its_descendants(tmp_path: Path) -> None:
    from ucm_db.maintenance.pre_units import convert

    path = tmp_path / "s"
    ns = namespace(_shape(1))
    keys = ns.block_keys(list(range(3 * BS)))
    whole_bytes = HEADS * LAYERS * BS * 2 * HEAD * 2
    with ucm_db.open(path) as store:
        store.put(ns, keys, [bytes([i + 1]) * whole_bytes for i in range(3)])
        engine = store._tier.engine  # test-only damage: flip the last byte of block 1's stored body
        body = bytearray(bytes(engine.read(lambda txn: txn.get("blocks", keys[1]))))
        body[-1] ^= 1
        engine.write(lambda txn: txn.put("blocks", keys[1], bytes(body)))
    report = convert(path)
    assert (report.whole_blocks, report.skipped_blocks, report.units_written) == (1, 2, HEADS)
    with ucm_db.open(path) as store:
        assert store.stats().blocks == HEADS  # block 0's units; no whole block is left
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(path)}), _shape(1))  # starts: nothing older is left
    assert sched.get_num_new_matched_tokens(_request("a", list(range(3 * BS + 1))), 0) == (BS, False)
    sched.shutdown()


def test_units_larger_than_the_namespace_record_says_are_not_taken_for_whole_blocks(tmp_path: Path) -> None:
    """A model whose V heads are larger than its K heads (vLLM's head_size_v)
    stores units larger than ``2 x head_size`` per token: the exact unit
    size from the spec keeps them from being judged whole blocks."""
    path = tmp_path / "s"
    unit_bytes = LAYERS * BS * (HEAD + 2 * HEAD) * 2  # head_size_v = 2 x head_size
    shape = _shape(1, unit_bytes=unit_bytes)
    ns = namespace(shape)
    keys = ns.block_keys(list(range(2 * BS)))
    with ucm_db.open(path) as store:
        for span in range(HEADS):  # units (not whole blocks), each a chain of its own
            from ucm_db.keys.units import KVGrid, UnitKeys

            grid = KVGrid(HEADS, LAYERS)
            store.put(ns, list(UnitKeys(keys, grid, grid.head_spans()[span])), [b"\1" * unit_bytes] * 2, parent=None)
        stats = store.stats().namespaces[ns.digest[:16].hex()]
        assert stats.raw_bytes > stats.blocks * LAYERS * BS * 2 * HEAD * 2  # beyond what the record's head_size gives
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(path)}), shape)  # not refused
    sched.shutdown()


def test_conversion_near_capacity_is_refused_before_anything_is_lost(tmp_path: Path) -> None:
    """Issue 46 finding 5: on a store near capacity, the unit puts evicted
    unconverted whole blocks (a 2 MiB store lost 82 of 162). Now the
    conversion is refused up front, with the fix, and loses nothing."""
    from ucm_db.errors import StoreFullError
    from ucm_db.maintenance.pre_units import convert

    path = tmp_path / "s"
    ns = namespace(_shape(1))
    block_bytes = HEADS * LAYERS * BS * 2 * HEAD * 2
    capacity_bytes = 1 << 20
    blocks = capacity_bytes // block_bytes - 2  # a little room, far less than the units need
    with ucm_db.open(path, codec="none", capacity_bytes=capacity_bytes) as store:
        store.put(ns, ns.block_keys(list(range(1, blocks * BS + 1))), [os.urandom(block_bytes) for _ in range(blocks)])
        assert store.stats().blocks == blocks
    with pytest.raises(StoreFullError, match="nothing was converted") as caught:
        convert(path)
    assert "compact" in (caught.value.hint or "")
    with ucm_db.open(path) as store:
        assert store.stats().blocks == blocks  # every whole block is still there
    assert convert(path, dry_run=True).whole_blocks == blocks
