"""Review: can a LoRA request's KV be stored under a key that names other
adapter files than the ones vLLM computed it with?

The scheduler keys a request's chain by its adapter's content digest when it
first looks the request up (``request_keys.request_extras`` ->
``fingerprints.adapter_key``). vLLM's worker reads the adapter's files later:
in ``execute_model``'s ``set_active_loras`` ->
``LRUCacheWorkerLoRAManager.add_adapter`` -> ``_load_adapter``
(``PEFTHelper.from_local_dir``, ``LoRAModel.from_local_checkpoint``), and only
where its CPU LRU (``max_cpu_loras``) does not hold that ``lora_int_id`` (or
the request asks ``load_inplace``). ``fingerprints._adapter_ids`` ("the digest
vLLM loaded under an id") is the digest the *scheduler* first keyed under it;
before ``connector/lora_loads.py`` nothing in ucm-db observed the worker's read.
Now the plugin wraps vLLM's adapter load, records what it read, and the worker
saves a LoRA request's blocks only where that is what its chain names.

Driven here: ucm-db's real scheduler and worker halves on real stores
(tmp_path), and vLLM's real ``LRUCacheWorkerLoRAManager`` over a one-layer
Llama built on CPU, whose LoRA ``qkv_proj`` computes the K rows an engine
writes into its KV cache (seeded hidden states and weights). A second engine
with the old adapter files (another replica, a rollback) then looks up and
loads what the first stored.

Invariants checked:
    * Where vLLM loaded an adapter before the files changed, a request keyed
      after the change is ``unsettled`` and vLLM does compute with the old
      files: the documented mechanism holds (passes).
    * vLLM reads the files when its worker first runs the id, after the
      scheduler keyed the request, and keeps what it read while the id is
      cached (the mechanism behind the review's three findings).
    * Every KV a D1 request is served is KV computed with D1, in the three
      windows the review found storing D2's KV under D1's key (each failed
      before lora_loads.py): files rewritten between keying and the worker's
      load; two adapters under one id run out of keying order; an adapter
      evicted from vLLM's LRU, reloaded and rolled back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm.config import LoadConfig, LoRAConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager  # noqa: E402

from tests.connector.test_scheduler_worker import BS, _admit, _kv, _new_step, _request, _shape  # noqa: E402
from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.metadata import UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))
HIDDEN, HEADS, HEAD_DIM, RANK, ALPHA = 64, 2, 32, 4, 8
KV_DIM = HEADS * HEAD_DIM  # K columns of qkv_proj's output: [HIDDEN, HIDDEN + KV_DIM)
SEEDS = {"v1": 101, "v2": 202, "x": 303, "y": 404, "other": 505}  # adapter versions' weights
BLOCKS = [0, 1, 2, 3]     # the first engine's blocks
TARGETS = [10, 11, 12, 13]  # the second engine's
FINGERPRINT_STATE = ("_memo", "_warned", "_adapters", "_adapter_ids", "_resettled", "_named", "_renamed")


@dataclass
class VllmLoraWorker:
    """vLLM's worker-side LoRA manager over a tiny Llama, and the inputs and
    base weight of its layer 0 ``qkv_proj`` (with LoRA)."""

    manager: LRUCacheWorkerLoRAManager
    qkv: torch.nn.Module
    base_k: torch.Tensor  # the K rows of qkv_proj's base weight
    hidden: torch.Tensor  # TOKENS' hidden states entering qkv_proj

    def k_rows(self, lora: LoRARequest) -> torch.Tensor:
        """What the worker's step computes for a request of ``lora``:
        ``set_active_loras`` (vLLM reads the files here, if it must), then
        the forward; the K rows it writes into the KV cache."""
        n = len(TOKENS)
        ids = lora.lora_int_id
        self.manager.set_active_adapters({lora}, LoRAMapping((ids,) * n, (ids,), is_prefill=True))
        with torch.no_grad():
            out = self.qkv(self.hidden)
        out = out[0] if isinstance(out, tuple) else out
        return out[:, HIDDEN:HIDDEN + KV_DIM].clone()

    def k_rows_of(self, seed: int) -> torch.Tensor:
        """The K rows an adapter written with ``seed`` computes (PEFT's math, no vLLM)."""
        lora_a, lora_b = _adapter_tensors(seed)
        return self.hidden @ self.base_k.T + (ALPHA / RANK) * (self.hidden @ lora_a.T) @ lora_b.T


def _adapter_tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(RANK, HIDDEN, generator=gen) * 0.1, torch.randn(KV_DIM, RANK, generator=gen) * 0.1


def _write_adapter(path: Path, seed: int) -> Path:
    """A PEFT adapter of ``k_proj`` (what changes K), saved (again) in place."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": ALPHA, "target_modules": ["k_proj"],
                                                          "bias": "none"}))
    lora_a, lora_b = _adapter_tensors(seed)
    prefix = "base_model.model.model.layers.0.self_attn.k_proj"
    save_file({f"{prefix}.lora_A.weight": lora_a, f"{prefix}.lora_B.weight": lora_b},
              str(path / "adapter_model.safetensors"))
    return path


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to bf16 storage (adapters of different seeds differ by ~0.3)."""
    return torch.allclose(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def _computed_with(lw: VllmLoraWorker, served: torch.Tensor | None) -> str | None:
    """Which adapter version (a :data:`SEEDS` name) computed the served K rows (None: nothing served)."""
    if served is None:
        return None
    return next((name for name, seed in SEEDS.items() if _same_rows(served, lw.k_rows_of(seed)[:len(served)])), "none")


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmLoraWorker]:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 model_parallel_is_initialized)
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from ucm_db.connector.plugin import register

    root = tmp_path_factory.mktemp("lora-llama")
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False}))
    model_config = ModelConfig(model=str(root), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    lora_config = LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=8)  # one id cached: vLLM's LRU evicts
    config = VllmConfig(model_config=model_config, lora_config=lora_config,
                        load_config=LoadConfig(load_format="dummy"))
    ours = not torch.distributed.is_initialized() and not model_parallel_is_initialized()
    with set_current_vllm_config(config):
        if ours:  # one rank, torn down after the module: other tests see no process group
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{root}/dist")
            initialize_model_parallel(1, 1)
        model = LlamaForCausalLM(vllm_config=config)  # type: ignore[abstract] # vLLM sets lora_manager
        register()  # what vLLM runs in every process before it loads anything (the plugin's hooks, if any)
        manager = LRUCacheWorkerLoRAManager(config, torch.device("cpu"), getattr(model, "embedding_modules", {}))
        manager.create_lora_manager(model, config)
        qkv = manager._adapter_manager.modules["model.layers.0.self_attn.qkv_proj"]
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            qkv.base_layer.weight.copy_(torch.randn(qkv.base_layer.weight.shape, generator=gen) * 0.05)
        base_k = qkv.base_layer.weight[HIDDEN:HIDDEN + KV_DIM].detach().clone()
        qkv.base_layer.quant_method.process_weights_after_loading(qkv.base_layer)  # vLLM's CPU GEMM setup
        yield VllmLoraWorker(manager, qkv, base_k, torch.randn(len(TOKENS), HIDDEN, generator=gen))
        if ours:
            destroy_model_parallel()
            destroy_distributed_environment()


@pytest.fixture(autouse=True)
def fresh_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine process per test: its fingerprint records (fingerprints.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in FINGERPRINT_STATE:
        monkeypatch.setattr(fingerprints, name, type(getattr(fingerprints, name))())


def _new_process() -> None:
    """The fingerprint records of another engine's process."""
    for name in FINGERPRINT_STATE:
        getattr(fingerprints, name).clear()


@dataclass
class Engine:
    """One engine's ucm-db halves on the shared store, and its KV caches."""

    sched: UcmDbScheduler
    worker: UcmDbWorker
    kv: dict[str, torch.Tensor]

    @classmethod
    def start(cls, store: Path) -> Engine:
        settings = ConnectorSettings.from_extra_config({"path": str(store)})
        kv = _kv()
        worker = UcmDbWorker(settings, _shape(), next(iter(kv.values())).shape[0])
        worker.register_kv_caches(kv, 0, 0)
        return cls(UcmDbScheduler(settings, _shape()), worker, kv)

    def schedule(self, req_id: str, lora: LoRARequest) -> UcmDbConnectorMetadata:
        """vLLM's scheduler step for a new request (its lookup keys it)."""
        req = _request(req_id, list(TOKENS), lora_request=lora)
        hit = _admit(self.sched, req)
        return self.sched.build_connector_meta(_new_step(req, BLOCKS, len(TOKENS) - hit))

    def save_computed(self, meta: UcmDbConnectorMetadata, k_rows: torch.Tensor) -> None:
        """The worker's step: the K rows computed into the blocks, then ucm-db's save."""
        for cache in self.kv.values():
            for i, block in enumerate(BLOCKS):
                cache[block, 0, :, :KV_DIM] = k_rows[i * BS:(i + 1) * BS].to(cache.dtype)
        self.worker.save(meta)
        self.worker.drain()

    def served(self, lora: LoRARequest) -> torch.Tensor | None:
        """The K rows this engine loads from the store for a request of ``lora`` (None: no hit)."""
        req = _request("later", list(TOKENS), lora_request=lora)
        hit = _admit(self.sched, req)
        if hit == 0:
            return None
        meta = self.sched.build_connector_meta(_new_step(req, TARGETS, len(TOKENS) - hit))
        self.worker.start_load(meta)
        assert self.worker.take_load_errors() == set()
        cache = next(iter(self.kv.values()))
        return torch.cat([cache[block, 0, :, :KV_DIM] for block in TARGETS[:hit // BS]])

    def stop(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def _served_to_old_files(tmp_path: Path, seed: int) -> torch.Tensor | None:
    """What a second engine (its own process) serving a copy of the adapter
    files written with ``seed`` loads from the store."""
    _new_process()
    old = _write_adapter(tmp_path / f"replica-{seed}", seed)
    engine = Engine.start(tmp_path / "store")
    try:
        return engine.served(LoRARequest("replica", 1, str(old)))
    finally:
        engine.stop()


def _digest(path: Path) -> str:
    return "blake3:" + fingerprints.fingerprint(path, adapter=True).digest


@pytest.fixture()
def vllm_lora_fresh(vllm_lora: VllmLoraWorker) -> VllmLoraWorker:
    vllm_lora.manager.remove_all_adapters()  # a fresh worker: no adapter loaded
    return vllm_lora


def test_load_before_change_keys_unsettled_and_vllm_keeps_the_old_files(tmp_path: Path,
                                                                        vllm_lora_fresh: VllmLoraWorker) -> None:
    """The case the design covers: vLLM loaded D1 before the rewrite."""
    lw = vllm_lora_fresh
    adapter = _write_adapter(tmp_path / "tuned", SEEDS["v1"])
    lora = LoRARequest("tuned", 1, str(adapter))
    engine = Engine.start(tmp_path / "store")
    try:
        meta = engine.schedule("r1", lora)
        assert meta.saves and _same_rows(rows := lw.k_rows(lora), lw.k_rows_of(SEEDS["v1"]))
        engine.save_computed(meta, rows)
        _write_adapter(adapter, SEEDS["v2"])  # retrained, saved in place
        later = engine.schedule("r2", lora)
        assert str(engine.sched._requests["r2"].extras["lora"]).startswith(fingerprints.UNSETTLED_PREFIX)
        assert later.saves == [] and later.loads == []
        assert _same_rows(lw.k_rows(lora), lw.k_rows_of(SEEDS["v1"]))  # vLLM: the cached id, old files
    finally:
        engine.stop()
    assert _computed_with(lw, _served_to_old_files(tmp_path, SEEDS["v1"])) == "v1"  # the harness serves what was saved


def test_vllm_reads_the_files_at_the_workers_load_after_the_keying(tmp_path: Path,
                                                                  vllm_lora_fresh: VllmLoraWorker) -> None:
    """The window: the request's key names D1, and vLLM reads the adapter
    when its worker first runs id 1, after the scheduler keyed it."""
    lw = vllm_lora_fresh
    assert not _same_rows(lw.k_rows_of(SEEDS["v1"]), lw.k_rows_of(SEEDS["v2"]))  # the versions tell apart
    adapter = _write_adapter(tmp_path / "tuned", SEEDS["v1"])
    lora = LoRARequest("tuned", 1, str(adapter))
    d1 = _digest(adapter)
    engine = Engine.start(tmp_path / "store")
    try:
        meta = engine.schedule("r", lora)  # keyed: D1
        keys = namespace(_shape()).block_keys(TOKENS, {"lora": d1})
        assert [k for save in meta.saves for k in save.keys] == list(keys[:len(BLOCKS)])
        _write_adapter(adapter, SEEDS["v2"])  # in place, before the worker's first step of id 1
        assert _same_rows(lw.k_rows(lora), lw.k_rows_of(SEEDS["v2"]))  # vLLM read the new files now
        _write_adapter(adapter, SEEDS["v1"])
        assert _same_rows(lw.k_rows(lora), lw.k_rows_of(SEEDS["v2"]))  # and keeps them while id 1 is cached
    finally:
        engine.stop()


def test_files_rewritten_before_the_workers_load(tmp_path: Path, vllm_lora_fresh: VllmLoraWorker) -> None:
    lw = vllm_lora_fresh
    adapter = _write_adapter(tmp_path / "tuned", SEEDS["v1"])
    lora = LoRARequest("tuned", 1, str(adapter))
    engine = Engine.start(tmp_path / "store")
    try:
        meta = engine.schedule("r", lora)
        _write_adapter(adapter, SEEDS["v2"])
        engine.save_computed(meta, lw.k_rows(lora))
    finally:
        engine.stop()
    served = _computed_with(lw, _served_to_old_files(tmp_path, SEEDS["v1"]))
    assert served in (None, "v1"), f"the v1 adapter's request was served KV computed with {served}"


def test_two_adapters_under_one_id_run_out_of_keying_order(tmp_path: Path, vllm_lora_fresh: VllmLoraWorker) -> None:
    """A is keyed first (its digest claims id 7), B second (``unsettled``).
    B's step reaches the worker first (A deferred: its lookup returned None,
    or it waits for an async load; in one batch, gpu_input_batch keeps one
    LoRARequest per id, the last added): vLLM loads B's files under id 7 and
    computes A with them."""
    lw = vllm_lora_fresh
    lora_a = LoRARequest("x", 7, str(_write_adapter(tmp_path / "x", SEEDS["x"])))
    lora_b = LoRARequest("y", 7, str(_write_adapter(tmp_path / "y", SEEDS["y"])))
    engine = Engine.start(tmp_path / "store")
    try:
        meta_a = engine.schedule("a", lora_a)
        meta_b = engine.schedule("b", lora_b)
        engine.save_computed(meta_b, lw.k_rows(lora_b))  # unsettled: saves nothing
        engine.save_computed(meta_a, lw.k_rows(lora_a))
    finally:
        engine.stop()
    served = _computed_with(lw, _served_to_old_files(tmp_path, SEEDS["x"]))
    assert served in (None, "x"), f"the x adapter's request was served KV computed with {served}"


def test_evicted_reloaded_then_rolled_back(tmp_path: Path, vllm_lora_fresh: VllmLoraWorker) -> None:
    lw = vllm_lora_fresh
    adapter = _write_adapter(tmp_path / "tuned", SEEDS["v1"])
    lora = LoRARequest("tuned", 1, str(adapter))
    other = LoRARequest("other", 2, str(_write_adapter(tmp_path / "other", SEEDS["other"])))
    before = Engine.start(tmp_path / "before")  # the store of what precedes the rollback (r1 saved D1 rightly)
    try:
        before.save_computed(before.schedule("r1", lora), lw.k_rows(lora))
        before.save_computed(before.schedule("o", other), lw.k_rows(other))  # max_cpu_loras=1: evicts id 1
        _write_adapter(adapter, SEEDS["v2"])
        before.save_computed(before.schedule("r2", lora), lw.k_rows(lora))  # unsettled; vLLM reloads D2
    finally:
        before.stop()
    _write_adapter(adapter, SEEDS["v1"])  # rolled back: D1 again, as first keyed
    engine = Engine.start(tmp_path / "store")  # the same process (its fingerprint records), a store of what follows
    try:
        meta = engine.schedule("r3", lora)
        assert meta.saves  # keyed blake3:D1 (settled)
        engine.save_computed(meta, lw.k_rows(lora))  # vLLM still holds D2 under id 1
    finally:
        engine.stop()
    served = _computed_with(lw, _served_to_old_files(tmp_path, SEEDS["v1"]))
    assert served in (None, "v1"), f"the v1 adapter's request was served KV computed with {served}"
