"""The stand-in engine of the hybrid audit tests (test_audit_hybrid_ssm_scenarios.py):
vLLM's real ``Scheduler`` in ``mamba_cache_mode="align"`` over SSM state,
sliding-window and full-attention groups, ucm-db's worker half on CPU
tensors and a real store, and a stand-in for the model runner.

The stand-in does what vLLM's align-mode worker does with the state
(``preprocess_mamba``: the running state lives in the block
``cdiv(computed + scheduled, block) - 1``, copied there from the previous
one; a new or resumed request starts from block ``(computed - 1) //
block``) and computes, per token, a state from the previous state, and a KV
slot from the previous slot, the state and (a window group) the window's
first and last slots: a state or a KV slot read wrong changes every later
slot and every output token, so the outputs equal :func:`greedy` only if
every hit was exactly what recomputing gives. vLLM's null block is never
read by a right computation (a read of it gives a wrong value) and must
stay zero (:meth:`HybridEngine.close` checks).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec, compute_layer_kv_cache_shape_bytes,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402

BS = 32
WINDOW = 64  # the sliding-window group's, in tokens
#: Each group kind's one layer.
LAYERS = {"mamba": "model.layers.0.linear_attn", "window": "model.layers.1.self_attn.attn",
          "full": "model.layers.3.self_attn.attn"}
VOCAB = 97
MASK = (1 << 20) - 1  # attention values a float32 holds exactly
STATE0 = 0x5EED


def _mix(*values: int) -> int:
    x = 12345
    for v in values:
        x = ((x ^ v) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFFFFFF
        x ^= x >> 19
    return x


def _state(prev: int, token: int, q: int) -> int:
    return _mix(prev, token, q, 1) & ((1 << 40) - 1)


def _slot(prev_slot: int, state: int, token: int, q: int, near: int, far: int) -> int:
    """The KV of position ``q``: of the previous position's, the state
    before it, and (a window group) the window's first and last slots."""
    return _mix(prev_slot, state, token, q, near, far, 2) & MASK


def _sample(slot: int, state: int) -> int:
    return _mix(slot, state, 3) % VOCAB


def greedy(prompt: list[int], n: int, kinds: tuple[str, ...] = ("mamba", "full")) -> list[int]:
    """The right ``n`` output tokens of ``prompt``, computed from scratch."""
    tokens, slots, state = list(prompt), [], STATE0
    out: list[int] = []
    while len(out) < n:
        while len(slots) < len(tokens):
            q = len(slots)
            near, far = _window_reads(kinds, q, slots.__getitem__)
            slots.append(_slot(slots[-1] if q else 0, state, tokens[q], q, near, far))
            if "mamba" in kinds:
                state = _state(state, tokens[q], q)
        out.append(_sample(slots[-1], state))
        tokens.append(out[-1])
    return out


def _window_reads(kinds: tuple[str, ...], q: int, read: Any) -> tuple[int, int]:
    """What position ``q`` reads of a window group: its previous slot and the window's first."""
    if "window" not in kinds:
        return 0, 0
    return (read(q - 1) if q else 0), (read(q - WINDOW + 1) if q >= WINDOW - 1 else 0)


def _model_dir(root: Path) -> Path:
    out = root / "tiny"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
            "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    return out


def _mamba() -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((3, 64), (2, 8, 8)), dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")


def _kv_cache_config(num_blocks: int, kinds: tuple[str, ...]) -> KVCacheConfig:
    specs = {"mamba": _mamba(),
             "window": SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=WINDOW),
             "full": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)}
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([LAYERS[k]], specs[k]) for k in kinds])


def _config(root: Path, store: Path, num_blocks: int, batched_tokens: int, extra: dict[str, Any],
            match_unit: int | None = None) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="UcmDbConnector", kv_connector_module_path="ucm_db.connector", kv_role="kv_both",
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"path": str(store), "codec": "none", "save_process": False, **extra})
    config = VllmConfig(
        model_config=ModelConfig(model=str(_model_dir(root)), skip_tokenizer_init=True, dtype="float32", max_model_len=4096),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=match_unit),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=16, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


class _Runner:
    """The worker: ucm-db's worker half and the stand-in model (module docstring)."""

    def __init__(self, config: VllmConfig, num_blocks: int, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.kv = {kind: torch.zeros(compute_layer_kv_cache_shape_bytes(_mamba(), num_blocks), dtype=torch.int8)
                   if kind == "mamba" else torch.zeros(num_blocks, 2, BS, 128, dtype=torch.float32) for kind in kinds}
        self.connector = UcmDbConnector(config, KVConnectorRole.WORKER, _kv_cache_config(num_blocks, kinds))
        self.connector.register_kv_caches({LAYERS[kind]: tensor for kind, tensor in self.kv.items()})
        self.reqs: dict[str, dict[str, Any]] = {}
        self.state_idx: dict[str, int] = {}  # vLLM's mamba_state_idx

    def _read_state(self, block: int) -> int:
        return int(self.kv["mamba"][block].flatten()[:8].view(torch.int64)[0])

    def _write_state(self, block: int, value: int) -> None:
        self.kv["mamba"][block].flatten()[:8].view(torch.int64)[0] = value

    def _read_slot(self, req: dict[str, Any], kind: str, q: int) -> int:
        block = req["tables"][kind][q // BS]
        if block == 0:
            return -2  # vLLM's null block: never read by a right computation
        values = set(self.kv[kind][block, :, q % BS, :].flatten().tolist())
        return int(values.pop()) if len(values) == 1 else -1

    def _write_slot(self, req: dict[str, Any], q: int, value: int) -> None:
        for kind in ("window", "full"):
            if kind in self.kinds:
                self.kv[kind][req["tables"][kind][q // BS], :, q % BS, :] = float(value)

    def _new(self, tokens: list[int], computed: int, block_ids: Any, prompt: int) -> dict[str, Any]:
        return {"tokens": list(tokens), "computed": computed, "prompt": prompt,
                "tables": {kind: list(ids) for kind, ids in zip(self.kinds, block_ids)}}

    def _update(self, so: Any) -> None:
        cached = so.scheduled_cached_reqs
        for req_id in [*so.finished_req_ids, *(so.preempted_req_ids or ()), *cached.resumed_req_ids]:
            self.state_idx.pop(req_id, None)  # cleanup_mamba_state_idx
        for req_id in [*so.finished_req_ids, *(so.preempted_req_ids or ())]:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = self._new(new.prompt_token_ids, new.num_computed_tokens, new.block_ids,
                                              len(new.prompt_token_ids))
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tokens = cached.all_token_ids[req_id]
                self.reqs[req_id] = self._new(tokens, cached.num_computed_tokens[i], ids, len(tokens) - cached.num_output_tokens[i])
                continue
            req = self.reqs[req_id]
            if ids is not None:
                for kind, more in zip(self.kinds, ids):
                    req["tables"][kind].extend(more)
            del req["tokens"][req["prompt"] + cached.num_output_tokens[i]:]
            req["computed"] = cached.num_computed_tokens[i]

    def _forward(self, req_id: str, req: dict[str, Any], n: int) -> list[int]:
        c = req["computed"]
        state = STATE0
        if "mamba" in self.kinds:  # preprocess_mamba
            table = req["tables"]["mamba"]
            prev = self.state_idx.get(req_id, (c - 1) // BS)
            curr = -(-(c + n) // BS) - 1
            self.state_idx[req_id] = curr
            if prev != -1 and prev != curr:
                self.kv["mamba"][table[curr]] = self.kv["mamba"][table[prev]]
            state = STATE0 if c == 0 else self._read_state(table[curr])
        slot = self._read_slot(req, "full", c - 1) if c else 0
        for q in range(c, c + n):
            near, far = _window_reads(self.kinds, q, lambda p: self._read_slot(req, "window", p))
            slot = _slot(slot, state, req["tokens"][q], q, near, far)
            self._write_slot(req, q, slot)
            if "mamba" in self.kinds:
                state = _state(state, req["tokens"][q], q)
        if "mamba" in self.kinds:
            self._write_state(req["tables"]["mamba"][curr], state)
        req["computed"] = c + n
        if req["computed"] < len(req["tokens"]):
            return []
        req["tokens"].append(_sample(slot, state))
        return [req["tokens"][-1]]

    def execute(self, so: Any) -> ModelRunnerOutput:
        self._update(so)
        meta, connector = so.kv_connector_metadata, self.connector
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)  # type: ignore[arg-type]
        for kind in self.kinds:
            connector.wait_for_layer_load(LAYERS[kind])
        sampled = {req_id: self._forward(req_id, self.reqs[req_id], n) for req_id, n in so.num_scheduled_tokens.items()}
        results = connector.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(finished_sending=None, finished_recving=results.finished_recving or None,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=set(connector.get_block_ids_with_load_errors()),
                                   kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.wait_for_save()
        connector.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled[r] for r in req_ids], kv_connector_output=kv_out)


class HybridEngine:
    """vLLM's scheduler and the stand-in runner, stepped as the engine core steps them."""

    def __init__(self, root: Path, store: Path, *, num_blocks: int = 96, batched_tokens: int = 2048,
                 extra: dict[str, Any] | None = None, match_unit: int | None = None,
                 kinds: tuple[str, ...] = ("mamba", "full"), events: bool = False, overlapped: bool = False) -> None:
        """``overlapped``: vLLM's ``AsyncScheduler`` with async scheduling on
        (each step planned before the last one's output is back); ``match_unit``: vLLM's ``prefix_match_unit`` (hashes, and hits of
        its own cache, at that many tokens inside a block); ``kinds``: the
        KV cache groups, in vLLM's order; ``events``: vLLM's KV cache events
        on, every batch vLLM publishes kept in :attr:`published`."""
        init_none_hash(sha256)
        config = _config(root, store, num_blocks, batched_tokens, extra or {}, match_unit)
        if events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        config.scheduler_config.async_scheduling = overlapped  # vLLM-CPU turns it off; the GPU default is on
        self.sched = (AsyncScheduler if overlapped else Scheduler)(config, _kv_cache_config(num_blocks, kinds), StructuredOutputManager(config), BS, match_unit or BS)
        self.runner = _Runner(config, num_blocks, kinds)
        self.hasher = get_request_block_hasher(match_unit or BS, sha256)
        self.outputs: dict[str, list[int]] = {}
        self.first: dict[str, int] = {}  # each request's computed tokens when first scheduled to compute (its hit)
        self.preempted: set[str] = set()  # requests vLLM preempted (its blocks ran out)
        self.published: list[Any] = []
        self._in_flight: tuple[Any, ModelRunnerOutput] | None = None  # overlapped: the step whose output is not back
        if events:
            publish = self.sched.kv_event_publisher.publish

            def keep(batch: Any) -> None:  # what vLLM's publisher sends, kept as it goes by
                self.published.extend(batch.events)
                publish(batch)

            self.sched.kv_event_publisher.publish = keep  # type: ignore[method-assign]

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                       None, block_hasher=self.hasher))

    def _update(self, so: Any, out: ModelRunnerOutput) -> None:
        for outputs in self.sched.update_from_output(so, out).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)

    def run(self, max_steps: int = 3000) -> None:
        """Steps until every request ended; overlapped, in the engine core's
        order: ``schedule(N+1)``, ``execute(N+1)``, ``update_from_output(N)``."""
        for _ in range(max_steps):
            if not self.sched.has_requests():
                if self._in_flight is None:
                    return
                self._update(*self._in_flight)
                self._in_flight = None
                continue
            so = self.sched.schedule()
            for new in so.scheduled_new_reqs:
                self.first.setdefault(new.req_id, new.num_computed_tokens)
            self.preempted.update(so.preempted_req_ids or ())
            out = self.runner.execute(so)
            if isinstance(self.sched, AsyncScheduler):
                if self._in_flight is not None:
                    self._update(*self._in_flight)
                self._in_flight = (so, out)
            else:
                self._update(so, out)
            if not so.num_scheduled_tokens:
                time.sleep(0.003)  # an async load in flight
        raise AssertionError("requests left unfinished")

    def close(self) -> None:
        self.runner.connector._worker.drain()  # type: ignore[union-attr]
        self.runner.connector.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]
        for kind, tensor in self.runner.kv.items():
            assert not tensor[0].any(), f"vLLM's null block of the {kind} group was written"


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 3 for i in range(n)]


def serve(root: Path, store: Path, prompts: dict[str, list[int]], max_tokens: int, *, one_by_one: bool = False,
           **kwargs: Any) -> HybridEngine:
    """Serves ``prompts`` on an engine over ``store`` (at once, or
    ``one_by_one``: each after the last ended, over vLLM's own cache of it)
    and checks every output is what recomputing gives."""
    engine = HybridEngine(root, store, **kwargs)
    try:
        for req_id, prompt in prompts.items():
            engine.add(req_id, prompt, max_tokens)
            if one_by_one:
                engine.run()
        engine.run()
    finally:
        engine.close()
    for req_id, prompt in prompts.items():
        assert engine.outputs[req_id] == greedy(prompt, max_tokens, kwargs.get("kinds", ("mamba", "full"))), (
            req_id, engine.first.get(req_id))
    return engine


@pytest.mark.parametrize("kinds", [("mamba", "full"), ("window", "full"), ("mamba", "window", "full")], ids="+".join)
def test_the_stand_in_computes_what_recomputing_gives(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """No store hit (a fresh store): the stand-in's outputs are greedy's, so
    the audit tests' outputs test the hits."""
    engine = serve(tmp_path, tmp_path / "store", {"a": prompt_of(1, 197)}, 6, kinds=kinds)
    assert engine.first == {"a": 0}
