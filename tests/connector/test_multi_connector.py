"""ucm-db composed under vLLM's own ``MultiConnector`` (issue 27 item 6),
without an engine: two ucm-db children on two stores, built by vLLM's real
MultiConnector class from real vLLM config objects, with the hybrid KV cache
manager's two groups (tests/vllm/test_hybrid_engine.py runs it in an engine).

MultiConnector asks every child for hits and loads from the first that has
some; every child saves; ``take_events`` chains the children's events; the
children's stats are merged by class name and rebuilt by name in the front
end (connector/plugin.py registers the name).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorStats  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metrics import UcmDbConnectorStats  # noqa: E402

from test_hybrid import (  # noqa: E402,F401
    BS, FULL_LAYERS, TOKENS, WINDOW, WINDOW_LAYERS, _Engine, _groups, _kv, _step, admit, model_dir,
)

init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


def _child(path: Path) -> dict[str, Any]:
    return {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": str(path)}}


def _multi_config(model_dir: Path, paths: list[Path]) -> VllmConfig:
    """The config ``--kv-transfer-config`` gives vLLM for the README's snippet, events on."""
    transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"connectors": [_child(p) for p in paths]})
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
        cache_config=CacheConfig(block_size=BS), kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER)  # type: ignore[arg-type]


class _Multi:
    """Both halves of a MultiConnector, as vLLM makes them for one engine."""

    def __init__(self, config: VllmConfig, kv: dict[str, torch.Tensor]) -> None:
        self.scheduler = MultiConnector(config, KVConnectorRole.SCHEDULER, _groups())
        self.worker = MultiConnector(config, KVConnectorRole.WORKER, _groups())
        self.worker.register_kv_caches(kv)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _stored(events: list[object]) -> list[tuple[int, object]]:
    out = []
    for event in events:
        assert isinstance(event, BlockStored) and event.medium == MEDIUM_STORAGE
        out.extend((event.group_idx, h) for h in event.block_hashes)
    return sorted(out, key=repr)


def _filled_store(model_dir: Path, store: Path, kv: dict[str, torch.Tensor]) -> None:
    """A single ucm-db engine stores the prompt's 6 whole blocks in both groups (with their event fields)."""
    writer = _Engine(model_dir, store, kv)
    assert writer.run(_request("w", TOKENS), (list(range(1, 8)), list(range(11, 18)))) == 0
    writer.close()


def test_two_ucm_db_children_keep_the_hybrid_manager_load_from_the_one_with_hits_and_merge_events(
    model_dir: Path, tmp_path: Path,
) -> None:
    saved = _kv(1)
    _filled_store(model_dir, tmp_path / "filled", saved)
    config = _multi_config(model_dir, [tmp_path / "empty", tmp_path / "filled"])
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)  # vLLM keeps its hybrid manager
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is not True
    fresh = _kv(None)
    multi = _Multi(config, fresh)
    empty, filled = multi.scheduler.sub_connectors
    assert isinstance(empty, UcmDbConnector) and isinstance(filled, UcmDbConnector)
    assert empty.settings.path != filled.settings.path and empty._held_store is not filled._held_store

    req = _request("r", TOKENS)
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes[:6]]
    # The first take replays each child's store: the filled one's 6 blocks of both groups, in child order.
    replayed = list(multi.scheduler.take_events())
    assert _stored(replayed) == sorted(((g, h) for g in (0, 1) for h in hashes), key=repr)
    # Each group's spec, as vLLM's own caches and OffloadingConnector publish it (a router classifies groups by it).
    assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in replayed} == {
        (0, "sliding_window", WINDOW), (1, "full_attention", None)}

    # vLLM leaves the sliding-window group's blocks outside the window null (block 0).
    ids = ([0, 0, 23, 24, 25, 26, 27], list(range(31, 38)))
    assert admit(multi.scheduler, multi.worker, req, ids) == 6 * BS  # a hybrid model's hit loads asynchronously
    assert multi.scheduler._requests_to_connector["r"] == 1  # the empty store is asked first and has none
    meta = multi.scheduler.build_connector_meta(_step(req, ids, req.num_tokens - req.num_computed_tokens))
    multi.worker.bind_connector_metadata(meta)
    multi.worker.start_load_kv(None)  # type: ignore[arg-type]
    assert multi.worker.get_block_ids_with_load_errors() == set()
    multi.worker.wait_for_save()
    multi.worker.clear_connector_metadata()
    # The empty child's save is over blocks the other loaded: held until the step's outcome is back.
    _drain(multi)
    assert empty._held_store.stats().blocks == 0  # type: ignore[union-attr]
    multi.scheduler.update_connector_output(_Output(multi.worker.build_connector_worker_meta(), set()))  # type: ignore[arg-type]
    worker_stats = multi.worker.get_kv_connector_stats()  # the first step's loads and copies
    _run_next_step(multi, req, ids)  # its metadata commits the held save
    assert multi.scheduler.request_finished_all_groups(req, ids) == (False, None)

    for layer, new_ids in [(n, ids[0]) for n in WINDOW_LAYERS] + [(n, ids[1]) for n in FULL_LAYERS]:
        old_ids = list(range(1, 7)) if layer in WINDOW_LAYERS else list(range(11, 17))
        for old, new in zip(old_ids, new_ids[:6]):
            if new:
                assert torch.equal(fresh[layer][new], saved[layer][old]), (layer, old, new)
    # The empty child saved what the other loaded: its full-attention group
    # whole; its sliding-window group's save met vLLM's null blocks (dropped).
    assert sorted(ns.blocks for ns in empty._held_store.stats().namespaces.values()) == [6 * 2]  # type: ignore[union-attr]
    # Only the empty child's new blocks are news: group 1 (full attention), vLLM's block hashes.
    assert _stored(list(multi.scheduler.take_events())) == sorted(((1, h) for h in hashes), key=repr)

    # Stats: both children's, merged under the class name by MultiConnector.
    worker_stats = worker_stats.aggregate(multi.worker.get_kv_connector_stats())
    sched_stats = multi.scheduler.get_kv_connector_stats()
    assert isinstance(worker_stats, MultiKVConnectorStats) and isinstance(sched_stats, MultiKVConnectorStats)
    merged = worker_stats.aggregate(sched_stats)
    ucm = merged["UcmDbConnector"]
    assert isinstance(ucm, UcmDbConnectorStats)
    assert ucm.data["lookups"] == 2 and ucm.data["hit_tokens"] == 6 * BS  # a lookup per child; the hit of the one that loads
    assert ucm.data["loaded_blocks"] > 0 and ucm.data["saved_blocks"] > 0
    multi.close()
    _front_end_rebuilds(merged.to_dict())


def _drain(multi: _Multi) -> None:
    for child in multi.worker.sub_connectors:
        child._worker.drain()  # type: ignore[attr-defined]


def _run_next_step(multi: _Multi, req: Request, ids: tuple[list[int], list[int]]) -> Any:
    """One more step of ``req`` (vLLM's next step: the request is cached, not new); its metadata."""
    after = _step(req, ids, req.num_tokens - req.num_computed_tokens)
    after.scheduled_new_reqs = []
    meta = multi.scheduler.build_connector_meta(after)
    multi.worker.bind_connector_metadata(meta)
    multi.worker.start_load_kv(None)  # type: ignore[arg-type]
    multi.worker.wait_for_save()
    multi.worker.clear_connector_metadata()
    _drain(multi)
    return meta


def _front_end_rebuilds(payload: dict[str, Any]) -> None:
    """vLLM's front end rebuilds MultiConnector stats from the engine core's
    dicts by child class name, in a process that never imported ucm-db's
    connector; vLLM loads its general plugins there first (connector/plugin.py)."""
    script = (
        "import json, sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector\n"
        "stats = MultiConnector.build_kv_connector_stats(data=json.loads(sys.argv[1]))\n"
        "print(json.dumps(stats.reduce()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, json.dumps(payload)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    reduced = json.loads(done.stdout.strip().splitlines()[-1])
    assert reduced["UcmDbConnector"]["lookups"] == payload["UcmDbConnector"]["lookups"]
    assert reduced["UcmDbConnector"]["hit_tokens"] == payload["UcmDbConnector"]["hit_tokens"]


class _Output:
    """The fields of vLLM's KVConnectorOutput the connectors read."""

    def __init__(self, worker_meta: object, invalid: set[int]) -> None:
        self.kv_connector_worker_meta = worker_meta
        self.invalid_block_ids = invalid


def test_a_failed_load_of_another_child_is_recomputed_before_any_child_saves(model_dir: Path, tmp_path: Path) -> None:
    """The filled child loads the prompt's blocks (asynchronously: a hybrid
    model's loads all are) and finds one lost between the lookup and the
    load: MultiConnector reports the request failed, vLLM recomputes it
    from its first token before computing anything over the failed blocks,
    so no child saves over them; both children rewind, neither claims it
    again, and the empty child saves it whole, over no load."""
    from ucm_db.connector.identity import grid, reader_spans
    from ucm_db.connector.hybrid.hooks import group_shape
    from ucm_db.keys.units import UnitKeys

    from test_hybrid import blocks_of

    _filled_store(model_dir, tmp_path / "filled", _kv(4))
    multi = _Multi(_multi_config(model_dir, [tmp_path / "empty", tmp_path / "filled"]), _kv(None))
    empty, filled = multi.scheduler.sub_connectors

    def lose_full_block_3(meta: Any) -> None:  # and, by the prefix invariant, what follows
        full = filled._scheduler.parts[1]  # type: ignore[union-attr]
        full_load = meta.metadata[1].groups[1].async_loads[0]
        shape = group_shape(filled.shape, filled._scheduler.groups[1])  # type: ignore[union-attr]
        full.store.delete(full._namespace, [k for span in reader_spans(shape) for k in UnitKeys([full_load.keys[3]], grid(shape), span)])

    req = _request("r", TOKENS)
    assert admit(multi.scheduler, multi.worker, req, ([0, 0, 23, 24, 25, 26], list(range(31, 37))), expect_failed=True,
                 before_load=lose_full_block_3) == 6 * BS
    assert empty._held_store.stats().blocks == 0  # type: ignore[union-attr]
    for child in (empty, filled):
        assert [part._requests["r"].saved_blocks for part in child._scheduler.parts] == [0, 0]  # type: ignore[union-attr]
    assert multi.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM's retry: recomputed
    ids = (list(range(1, 8)), list(range(11, 18)))  # a prefill of the whole prompt: every block real
    multi.scheduler.update_state_after_alloc(req, blocks_of(ids), 0)
    meta = multi.scheduler.build_connector_meta(_step(req, ids, req.num_tokens))
    assert [[(len(t.block_ids), t.after_loads, t.hold_id) for t in g.saves] for g in meta.metadata[0].groups] == [[(6, (), -1)]] * 2
    multi.worker.bind_connector_metadata(meta)
    multi.worker.start_load_kv(None)  # type: ignore[arg-type]
    multi.worker.wait_for_save()
    multi.worker.clear_connector_metadata()
    _drain(multi)
    assert empty._held_store.stats().blocks == 2 * 6 * 2  # type: ignore[union-attr]
    multi.close()
