"""Audit (hybrid models): through vLLM's real ``Scheduler`` in
``mamba_cache_mode="align"`` (test_audit_hybrid_harness.py: ucm-db's worker
half, a real store, a stand-in runner whose outputs are right only if every
hit is exactly what recomputing gives), a hit never puts attention KV of
one length beside SSM state of another, nor skips or writes a window's
block wrongly: a prompt that is not a multiple of the block size, chunked
prefill (vLLM's align mode cuts chunks at block boundaries), preempted and
resumed requests, decode across block boundaries, hashes finer than the
block (``prefix_match_unit``), a store too small for what is saved
(attention tails and states evicted apart); and the STORAGE events and
``ucm-db events`` tell, group by group, what the store holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import test_audit_hybrid_harness as harness  # noqa: E402
from test_audit_hybrid_harness import HybridEngine, prompt_of, serve  # noqa: E402


@pytest.mark.parametrize("prompt_tokens", [197, 224, 225])
def test_a_restarted_engine_hits_attention_and_state_of_one_length(tmp_path: Path, prompt_tokens: int) -> None:
    prompt = prompt_of(2, prompt_tokens)
    serve(tmp_path, tmp_path / "store", {"w": prompt}, 4)
    reader = serve(tmp_path, tmp_path / "store", {"r": prompt, "longer": prompt + prompt_of(3, 70)}, 4)
    assert reader.first["r"] == (prompt_tokens - 1) // harness.BS * harness.BS
    assert reader.first["longer"] >= reader.first["r"]


def test_chunked_prefill_stores_states_at_every_chunk_end(tmp_path: Path) -> None:
    """Chunks of 100 tokens (vLLM's align mode cuts them to 96): every chunk's
    end is a boundary state offered; a reader of a prefix ending at any of
    them hits there with the right state."""
    prompt = prompt_of(4, 301)
    serve(tmp_path, tmp_path / "store", {"w": prompt}, 3, batched_tokens=100)
    reader = serve(tmp_path, tmp_path / "store", {"r": prompt[:200] + prompt_of(5, 40)}, 3)
    assert reader.first["r"] == 192


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async_scheduling"])
def test_preempted_and_resumed_requests_store_right_states(tmp_path: Path, overlapped: bool) -> None:
    """Two requests decoding in too few blocks: vLLM preempts one (its
    blocks freed) and resumes it (its prompt and outputs recomputed, or hit
    from the store); what they stored serves a reader of the same tokens
    right. Also under vLLM's async scheduling (steps overlapped)."""
    prompts = {"w": prompt_of(6, 150), "x": prompt_of(9, 150)}
    writer = serve(tmp_path, tmp_path / "store", prompts, 90, num_blocks=17, overlapped=overlapped)
    assert writer.preempted, "no request was preempted: the scenario did not happen"
    for req_id, prompt in prompts.items():
        full = prompt + writer.outputs[req_id]
        reader = serve(tmp_path, tmp_path / "store", {"r": full[:205] + prompt_of(7, 5)}, 3, overlapped=overlapped)
        assert reader.first["r"] == 192


def test_decode_boundaries_serve_right_states(tmp_path: Path) -> None:
    prompt = prompt_of(8, 40)
    writer = serve(tmp_path, tmp_path / "store", {"w": prompt}, 100, extra={"save_decode": True})
    full = prompt + writer.outputs["w"]
    reader = serve(tmp_path, tmp_path / "store", {"r": full[:131]}, 3)
    assert reader.first["r"] == 128


@pytest.mark.parametrize("kinds", [("window", "full"), ("mamba", "window", "full")], ids="+".join)
@pytest.mark.parametrize("writer_chunk", [2048, 100])
def test_a_window_group_loads_what_its_window_reads(tmp_path: Path, kinds: tuple[str, ...], writer_chunk: int) -> None:
    """A sliding-window group (64 tokens) beside full attention (and SSM
    state): a restarted engine loads the window's blocks, skips vLLM's null
    blocks, and computes what recomputing gives, for a prompt, a longer
    one and one that shares part of it; a second reader request over
    vLLM's own cache of the first too."""
    prompt = prompt_of(12, 300)
    serve(tmp_path, tmp_path / "store", {"w": prompt}, 3, kinds=kinds, batched_tokens=writer_chunk)
    reader = serve(tmp_path, tmp_path / "store", {"part": prompt[:170] + prompt_of(13, 60), "r": prompt,
                                                   "longer": prompt + prompt_of(14, 100)}, 3, kinds=kinds, one_by_one=True)
    assert reader.first["r"] > 0


@pytest.mark.parametrize("kinds", [("window", "full"), ("mamba", "window", "full")], ids="+".join)
def test_window_groups_preempted_and_resumed(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    prompts = {"w": prompt_of(15, 150), "x": prompt_of(16, 150)}
    writer = serve(tmp_path, tmp_path / "store", prompts, 90, num_blocks=24 if "mamba" in kinds else 20, kinds=kinds)
    assert writer.preempted, "no request was preempted: the scenario did not happen"
    for req_id, prompt in prompts.items():
        full = prompt + writer.outputs[req_id]
        serve(tmp_path, tmp_path / "store", {"r": full[:205] + prompt_of(7, 5)}, 3, kinds=kinds)


def test_hashes_finer_than_the_block_hit_whole_blocks_with_their_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``prefix_match_unit`` of 32 tokens inside 64-token blocks (its
    own cache may hit inside a block): ucm-db's hits stay at whole blocks
    with the state of the same boundary, over vLLM's own hits of every cut."""
    monkeypatch.setattr(harness, "BS", 64)  # every group's block size (vLLM-CPU raises it for the state page)
    prompt = prompt_of(17, 300)
    serve(tmp_path, tmp_path / "store", {"w": prompt}, 3, match_unit=32)
    for cut in (96, 161, 224):
        reader = serve(tmp_path, tmp_path / "store", {f"a{cut}": prompt[:cut], f"b{cut}": prompt}, 3, match_unit=32,
                        one_by_one=True)
        assert reader.first[f"b{cut}"] == 256


@pytest.mark.parametrize("kinds", [("mamba", "full"), ("mamba", "window", "full")], ids="+".join)
def test_a_store_too_small_for_what_is_saved_serves_only_right_hits(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """Evictions take attention tails and states apart (each group's
    namespace evicts on its own): whatever is left, a hit is attention and
    state of one boundary, or a shorter hit, or none."""
    extra = {"capacity_bytes": 1 << 20}
    prompts = {f"p{i}": prompt_of(20 + i % 3, 130 + 37 * i) for i in range(8)}
    serve(tmp_path, tmp_path / "store", prompts, 2, extra=extra, kinds=kinds, batched_tokens=96)
    reader = serve(tmp_path, tmp_path / "store", {f"r{i}": p for i, p in enumerate(prompts.values())}, 2, extra=extra,
                    kinds=kinds)
    assert any(reader.first.values()), "nothing was hit: the scenario did not happen"


def _storage_view(events: list[Any]) -> dict[int, set[Any]]:
    """A router's view of the STORAGE blocks from the events: group -> block hashes."""
    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored

    view: dict[int, set[Any]] = {}
    for event in events:
        if getattr(event, "medium", None) != MEDIUM_STORAGE:
            continue
        if isinstance(event, BlockStored):
            view.setdefault(event.group_idx, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            view.setdefault(event.group_idx, set()).difference_update(event.block_hashes)
    return {g: hashes for g, hashes in view.items() if hashes}


@pytest.mark.parametrize("kinds", [("mamba", "full"), ("mamba", "window", "full")], ids="+".join)
def test_the_events_and_the_replay_tell_what_each_group_holds(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """Saves and evictions of every group of a hybrid model: the STORAGE
    events vLLM published equal, group by group, the store's evented
    blocks, and so does ``ucm-db events`` (its hashes as vLLM publishes them)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    extra = {"capacity_bytes": 1 << 20}
    prompts = {f"p{i}": prompt_of(30 + i % 3, 130 + 37 * i) for i in range(8)}
    engine = HybridEngine(tmp_path, tmp_path / "store", extra=extra, kinds=kinds, batched_tokens=96, events=True)
    for req_id, prompt in prompts.items():
        engine.add(req_id, prompt, 2)
    engine.run()
    engine.runner.connector._worker.drain()  # type: ignore[union-attr]
    engine.published.extend(engine.sched.connector.take_events())  # type: ignore[union-attr]  # the last commits
    parts = engine.sched.connector._scheduler.parts  # type: ignore[union-attr]
    held = {g: {maybe_convert_block_hash(BlockHash(r.fields.block_hash)) for r in part.store.event_inventory(namespace=part.namespace).records}
            for g, part in enumerate(parts)}
    evictions = parts[0].store.stats().evictions
    held = {g: hashes for g, hashes in held.items() if hashes}
    assert evictions > 0, "nothing was evicted: the scenario did not happen"
    assert _storage_view(engine.published) == held
    replay: dict[int, set[Any]] = {}
    # `ucm-db events` in a process of its own (this one holds the store open, as the engine does).
    lines = subprocess.run([str(Path(sys.executable).with_name("ucm-db")), "events", str(tmp_path / "store")],
                           capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    for event in map(json.loads, lines):
        replay.setdefault(event["group_idx"], set()).update(
            int(h, 16) & ((1 << 64) - 1) if isinstance(h, str) else h for h in event["block_hashes"])
    assert replay == held
    # reset_cache (a weight update): every group's blocks are withdrawn at the next step; what is
    # announced after it is what this engine stored since, at its own epoch (the request served after it).
    assert engine.sched.reset_prefix_cache(reset_connector=True)
    engine.add("after", prompts["p7"], 1)
    engine.run()
    engine.runner.connector._worker.drain()  # type: ignore[union-attr]
    engine.published.extend(engine.sched.connector.take_events())  # type: ignore[union-attr]
    now = {g: {maybe_convert_block_hash(BlockHash(r.fields.block_hash))
               for r in part.store.event_inventory(namespace=part.namespace).records if r.fields.epoch == part.epoch}
           for g, part in enumerate(parts)}
    engine.close()
    assert all(part.epoch >= 1 << 63 for part in parts)  # its private epoch (connector/epochs.py)
    assert _storage_view(engine.published) == {g: hashes for g, hashes in now.items() if hashes} != held
