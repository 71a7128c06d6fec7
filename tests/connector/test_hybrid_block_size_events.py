"""KV cache events of a model whose KV cache groups have different block
sizes (connector/hybrid/servable_events.py, docs/events.md).

The tiny Gemma 4 of test_hybrid_block_sizes.py: a sliding-window group of
64-token blocks (vLLM enlarged it) beside a full-attention group of 32;
vLLM hashes requests at 32 tokens and its scheduler works in 64 (the lcm).
vLLM publishes its own cache of such a model per group, each block at its
group's block size with vLLM's hash at the block's end (the 64-token
group's blocks carry every other 32-token hash), and only up to a multiple
of the lcm. A hit from ucm-db ends at a multiple of the lcm that every
group holds whole.

Before, ucm-db announced the full-attention group's blocks alone, every
one stored (224 tokens of a 229-token prompt), and nothing of the
sliding-window group (its saves had no hashes at 64 tokens): a router saw
a stored prefix a lookup cuts to 192, and a group-aware router saw none.
Now the storage tier is announced as vLLM announces its own cache of the
same prefix: each group's blocks of the prefix every group holds, cut to
the lcm, and a removal of any group's block withdraws every block it makes
unservable. (vLLM's GPU tier may leave out sliding-window blocks no GPU hit
reads, its tail-window mask; with 192 tokens and a 128-token window it keeps
them all, so the two views are compared whole. On a real Gemma 4 engine of
300-token prompts, checked by hand, the full-attention group's views were
equal, and ucm-db announced 4 sliding-window blocks a prompt where vLLM
keeps the last 2.)

Real parts: vLLM's ``Scheduler`` (prefix caching and KV events on; it makes
ucm-db's scheduler half, takes its events and publishes them beside its
own), vLLM's groups made by ``unify_kv_cache_spec_page_size``, ucm-db's
worker half with CPU KV tensors, a real store; no model runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.hybrid.hooks import GroupedScheduler, group_shape  # noqa: E402
from ucm_db.connector.identity import grid, reader_spans  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

from test_hybrid import _vllm_config, model_dir  # noqa: E402,F401
from test_hybrid_block_sizes import BS, NUM_BLOCKS, TOKENS, WINDOW_BS, _groups, _kv  # noqa: E402
from test_hybrid_failed_loads import _run  # noqa: E402

init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)  # vLLM hashes at the groups' gcd (32)
WINDOW, FULL = 0, 1  # group indices


OTHER = TOKENS[:5 * BS] + [t + 500 for t in TOKENS[5 * BS:]]  # shares the first 160 tokens (2.5 blocks of 64)


def _request(req_id: str, tokens: list[int] = TOKENS) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER)  # type: ignore[arg-type]


class View:
    """A router's view of one medium from vLLM's published events:
    (group, hash) -> the event that stored it."""

    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.blocks: dict[tuple[int | None, Any], BlockStored] = {}

    def apply(self, events: list[Any]) -> None:
        for event in events:
            if getattr(event, "medium", None) != self.medium:  # AllBlocksCleared (no medium) is vLLM's own, at its reset
                continue
            if isinstance(event, BlockStored):
                assert len(event.block_hashes) * event.block_size == len(event.token_ids)
                for i, h in enumerate(event.block_hashes):
                    parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                    one = event.block_size
                    self.blocks[event.group_idx, h] = BlockStored(
                        block_hashes=[h], parent_block_hash=parent, token_ids=event.token_ids[i * one:(i + 1) * one],
                        block_size=one, lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name,
                        group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert (event.group_idx, h) in self.blocks, ("removed what was never stored", event)
                    del self.blocks[event.group_idx, h]

    def hashes(self, group: int) -> set[Any]:
        return {h for g, h in self.blocks if g == group}

    def shape(self) -> set[tuple[Any, ...]]:
        """What a router reads of each block: group, hash, parent, block size, tokens, spec kind."""
        return {(g, h, e.parent_block_hash, e.block_size, tuple(e.token_ids), e.kv_cache_spec_kind)
                for (g, h), e in self.blocks.items()}


class _Engine:
    """vLLM's scheduler with prefix caching and KV events on, ucm-db's worker half; every published event kept."""

    def __init__(self, model_dir: Path, store: Path) -> None:
        config = _vllm_config(model_dir, {"path": str(store)})
        config.cache_config.enable_prefix_caching = True
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        # What vLLM's engine core passes: the groups' lcm, and hashes at their gcd (resolve_kv_cache_block_sizes).
        self.sched = Scheduler(config, _groups(), StructuredOutputManager(config), WINDOW_BS, BS)
        self.published: list[Any] = []
        self.sched.kv_event_publisher.publish = lambda batch: self.published.extend(batch.events)  # type: ignore[method-assign]
        self.worker = UcmDbConnector(config, KVConnectorRole.WORKER, _groups())
        self.worker.register_kv_caches(_kv(1))
        self.ours = self.sched.connector._scheduler  # type: ignore[union-attr]
        assert isinstance(self.ours, GroupedScheduler)

    def run(self, req: Request) -> int:
        """Runs the request to its end; its hit."""
        self.sched.add_request(req)
        hit = _run(self.sched, self.worker)[req.request_id]
        self.worker._worker.drain()  # type: ignore[union-attr]
        self.take()
        return hit

    def take(self) -> None:
        """What the next steps would publish of the store (its commits, a replay in a thread)."""
        for _ in range(8):
            events = list(self.sched.connector.take_events())  # type: ignore[union-attr]
            assert not any(isinstance(e, AllBlocksCleared) for e in events)  # never from ucm-db (events.md)
            self.published.extend(events)
            time.sleep(0.06)

    def storage(self) -> View:
        view = View(MEDIUM_STORAGE)
        view.apply(self.published)
        return view

    def delete(self, group: int, block: int, tokens: list[int] = TOKENS) -> None:
        """Removes one group's block (its every KV head unit), as another process's eviction would."""
        part = self.ours.parts[group]
        shape = group_shape(self.worker.shape, self.ours.groups[group])
        key = part.keys_for(_request("k", tokens), block + 1)[block]
        part.store.delete(part.namespace, [k for span in reader_spans(shape) for k in UnitKeys([key], grid(shape), span)])

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]


def _hashes(tokens: list[int] = TOKENS) -> list[Any]:
    """vLLM's hashes of the tokens at 32 tokens, as it publishes them."""
    return [maybe_convert_block_hash(h) for h in _request("h", tokens).block_hashes]


def test_the_store_is_announced_as_vllm_announces_its_own_cache_of_the_prefix(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """229 tokens: the full-attention group stores 7 blocks of 32, the
    sliding-window group 3 of 64; a hit covers 192 tokens (3 lcm units).
    vLLM's own cache of the same run (prefix caching on) publishes the same
    blocks: the storage tier's view is the GPU tier's."""
    hashes = _hashes()
    writer = _Engine(model_dir, tmp_path / "store")
    assert writer.run(_request("a")) == 0
    storage = writer.storage()
    # Before: {FULL: hashes[:7]} and nothing of WINDOW (no hash at 64 tokens was given to its saves).
    assert storage.hashes(WINDOW) == {hashes[1], hashes[3], hashes[5]}  # each 64-token block: the hash at its end
    assert storage.hashes(FULL) == set(hashes[:6])  # not block 6 (224 tokens): no hit reaches it
    window_blocks = sorted((e for (g, _), e in storage.blocks.items() if g == WINDOW), key=lambda e: len(e.token_ids))
    assert [(e.block_size, e.parent_block_hash) for e in window_blocks] == [(64, None), (64, hashes[1]), (64, hashes[3])]
    assert window_blocks[2].token_ids == TOKENS[128:192]
    gpu = View("GPU")
    gpu.apply(writer.published)
    assert storage.shape() == gpu.shape()  # vLLM's own cache of the same prefix, field for field
    writer.close()

    # A restarted engine replays the inventory: the same view, and its hit is exactly the announced prefix.
    reader = _Engine(model_dir, tmp_path / "store")
    reader.take()
    assert reader.storage().shape() == storage.shape()
    assert reader.run(_request("b")) == 3 * WINDOW_BS == len(storage.hashes(FULL)) * BS
    reader.close()


def test_a_removal_in_any_group_withdraws_what_it_makes_unservable(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    hashes = _hashes()
    writer = _Engine(model_dir, tmp_path / "store")
    writer.run(_request("a"))
    writer.close()

    engine = _Engine(model_dir, tmp_path / "store")
    engine.take()
    # The full-attention group loses block 5 (tokens 160-192): the lcm unit 128-192 is no longer whole.
    engine.delete(FULL, 5)
    engine.take()
    view = engine.storage()
    assert view.hashes(FULL) == set(hashes[:4]) and view.hashes(WINDOW) == {hashes[1], hashes[3]}
    withdrawn = [e for e in engine.published if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE]
    assert sorted((e.group_idx, h) for e in withdrawn for h in e.block_hashes) == sorted(
        [(WINDOW, hashes[5]), (FULL, hashes[4]), (FULL, hashes[5])])

    # The sliding-window group loses its block 1 (tokens 64-128): 64 tokens stay servable.
    engine.delete(WINDOW, 1)
    engine.take()
    view = engine.storage()
    assert view.hashes(FULL) == set(hashes[:2]) and view.hashes(WINDOW) == {hashes[1]}

    # The request again: it hits what the view says, recomputes and stores the rest; all of it is announced again.
    assert engine.run(_request("b")) == 2 * BS
    view = engine.storage()
    assert view.hashes(FULL) == set(hashes[:6]) and view.hashes(WINDOW) == {hashes[1], hashes[3], hashes[5]}
    engine.close()


def test_a_block_two_prefixes_share_stays_while_either_is_servable(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Two prompts share 160 tokens: the full-attention group's block 4
    (tokens 128-160) lies in the lcm unit 128-192 of each. Losing one
    prompt's unit leaves it announced for the other's."""
    ours, other = _hashes(), _hashes(OTHER)
    assert ours[:5] == other[:5] and ours[5] != other[5]
    engine = _Engine(model_dir, tmp_path / "store")
    engine.run(_request("a"))
    engine.run(_request("b", OTHER))
    view = engine.storage()
    assert view.hashes(FULL) == set(ours[:6]) | {other[5]}
    assert view.hashes(WINDOW) == {ours[1], ours[3], ours[5], other[5]}

    engine.delete(WINDOW, 2)  # the first prompt's 64-token block 2 (tokens 128-192)
    engine.take()
    view = engine.storage()
    assert view.hashes(FULL) == set(ours[:5]) | {other[5]} and view.hashes(WINDOW) == {ours[1], ours[3], other[5]}
    engine.delete(WINDOW, 2, OTHER)
    engine.take()
    view = engine.storage()
    assert view.hashes(FULL) == set(ours[:4]) and view.hashes(WINDOW) == {ours[1], ours[3]}
    engine.close()


def test_reset_withdraws_every_group(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """reset_cache moves the namespace epoch on: what was announced is withdrawn in every group, and
    what the engine stores after it is announced as before."""
    hashes = _hashes()
    engine = _Engine(model_dir, tmp_path / "store")
    engine.run(_request("a"))
    assert engine.sched.reset_prefix_cache(reset_connector=True)  # what vLLM does for /reset_prefix_cache?reset_external=true
    engine.take()
    assert engine.storage().blocks == {}
    assert engine.run(_request("b")) == 0
    view = engine.storage()
    assert view.hashes(FULL) == set(hashes[:6]) and view.hashes(WINDOW) == {hashes[1], hashes[3], hashes[5]}
    engine.close()
