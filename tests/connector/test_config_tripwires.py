"""Tripwires over the vLLM configs beside ``ModelConfig`` that can change
the K/V bytes of a token prefix: ``AttentionConfig``, ``LoRAConfig``,
``KernelConfig``, ``CacheConfig`` and ``ParallelConfig``.

Every field of each is judged here, in one word and a reason: ``keyed``
(and where ucm-db keys it), ``refused`` (a deployment using it is refused,
and where), ``no`` (why it leaves the K/V of a given prefix as they are, or
only moves their rounding, which is policy: docs/connector.md, "Identity:
what a key names") or ``MISSED`` (it changes the K/V and nothing keys it
yet: :data:`KNOWN_MISSED`, printed by the test, until someone keys it). A
field vLLM adds or drops fails the test, naming it, until it is judged here.
Where a ``keyed`` judgement is cheap to check, it is checked below (the
config fields ``tests/connector/test_identity_inputs.py`` already moves
through the namespace are named there, in ``KV_CHANGING``).

Real vLLM config objects and specs; no engine, no GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.test_identity_inputs import KV_CHANGING, _namespace_of, _set, _vllm_config, model_dir  # noqa: E402,F401
from ucm_db.connector.hybrid.groups import group_namespace, kv_groups  # noqa: E402
from ucm_db.connector.identity_guards import lora_engine_inputs  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

#: Fields that change the K/V of a prefix and that ucm-db does not key (yet):
#: judged "MISSED" below; the test prints them and does not fail on them.
KNOWN_MISSED: set[str] = set()

_SPARSE = "refused: sparse-indexer models only (their indexer K cache is a second spec: hybrid/groups.kv_groups)"
_Q_FP8 = "with a quantized KV cache (fp8/nvfp4)"

ATTENTION_CONFIG_FIELDS = {
    "backend": f"keyed: numerics.numerics_inputs {_Q_FP8}: the backend decides whether queries are quantized "
               "to fp8 (attention.py query_quant: Triton on CUDA does, FlashInfer on SM89/SM120 keeps model-dtype Q); "
               "else rounding only",
    "backend_per_kind": "keyed: numerics.numerics_inputs, as backend, per KV cache group",
    "flash_attn_version": f"keyed: numerics.numerics_inputs {_Q_FP8}: on SM90 FA4 keeps bf16 queries, FA3 "
                          "quantizes them (flash_attn.py supports_quant_query_input)",
    "use_trtllm_attention": f"keyed: numerics.numerics_inputs {_Q_FP8}: on SM90/SM12x XQA decode keeps model-dtype "
                            "queries, FlashInfer's own decode quantizes them (flashinfer.py get_q_data_type)",
    "mla_prefill_backend": f"keyed: numerics.numerics_inputs {_Q_FP8}: use_prefill_query_quantization takes effect "
                           "only with FLASHINFER/TRTLLM_RAGGED/TOKENSPEED_MLA prefill "
                           "(mla_attention.backend_supports_prefill_query_quantization)",
    "use_prefill_query_quantization": "keyed: identity.namespace_inputs (prefill_query_fp8)",
    "disable_flashinfer_q_quantization": "keyed: identity.namespace_inputs (flashinfer_query_fp8_off)",
    "minimax_m3_msa_decode_backend": _SPARSE,
    "indexer_kv_dtype": _SPARSE + "; key it if they are ever stored: it moves the top-k the attention reads",
    "indexer_sparse_logits": _SPARSE,
    "hisparse_config": _SPARSE,
    "sparse_mla_force_mqa": _SPARSE,
    "sparse_mla_prefill_workspace_factor": _SPARSE,
    "use_non_causal": "no: asks for a backend able to attend non-causally; a layer that does flips its spec's "
                      "non_causal, refused by identity_guards.refuse_unstorable",
    "flash_attn_max_num_splits_for_cuda_graph": "no: split-KV count, rounding only",
    "tokenspeed_mla_min_split_kv": "no: split-KV floor, rounding only",
    "tq_max_kv_splits_for_cuda_graph": "no: split-KV count, rounding only",
    "flex_attn_block_m": "no: kernel tile size, rounding only",
    "flex_attn_block_n": "no: kernel tile size, rounding only",
    "flex_attn_q_block_size": "no: block-mask granularity; partial blocks are masked per token",
    "flex_attn_kv_block_size": "no: block-mask granularity; partial blocks are masked per token",
}

LORA_CONFIG_FIELDS = {
    "lora_dtype": "keyed: identity_guards.lora_engine_inputs (adapter requests' chains)",
    "target_modules": "keyed: identity_guards.lora_engine_inputs",
    "enable_mixed_moe_lora_format": "keyed: identity_guards.lora_engine_inputs",
    "enable_moe_shared_loras": "keyed: identity_guards.lora_engine_inputs",
    "enable_tower_connector_lora": "keyed: vLLM then names the adapter in an adapter request's multimodal identifiers "
                                   "(input_processor._get_mm_identifier), which request_keys keys",
    "default_mm_loras": "no: the serving layer sets the request's adapter (entrypoints/serve/engine/serving.py), "
                        "keyed per request",
    "max_lora_rank": "no: a capacity (an adapter above it is rejected: lora/peft_helper.py)",
    "max_loras": "no: adapters per batch",
    "max_cpu_loras": "no: a cache size",
    "fully_sharded_loras": "no: how LoRA matmuls split across TP ranks, rounding only (as TP)",
    "specialize_active_lora": "no: CUDA graph capture",
    "max_lora_cls_labels": "no: a classification head, after the KV",
}

KERNEL_CONFIG_FIELDS = {
    "linear_backend": "keyed: numerics.numerics_inputs (a quantized model; else rounding only)",
    "linear_backend_per_quant": "keyed: numerics.numerics_inputs (a quantized model)",
    "moe_backend": "keyed: numerics.numerics_inputs (a quantized model; else rounding only)",
    "sparse_indexer_topk_backend": _SPARSE,
    "ir_op_priority": "no: implementations of one IR op (rms_norm ...), held to vllm/ir/tolerances.py",
    "enable_flashinfer_autotune": "no: tactic choice, rounding only",
    "enable_rocm_segmented_attn_autotune": "no: tactic choice, rounding only",
    "enable_cutedsl_warmup": "no: warmup",
    "enable_jit_warmup": "no: warmup",
}

CACHE_CONFIG_FIELDS = {
    "block_size": "keyed: Namespace.block_size (identity.kv_shape)",
    "cache_dtype": "keyed: the layout's cache_dtype and Namespace.kv_dtype (identity.kv_shape)",
    "kv_cache_dtype_skip_layers": "keyed: identity.namespace_inputs",
    "mamba_cache_dtype": "keyed: numerics.numerics_inputs (every group's namespace: the attention layers compute "
                         "from what the SSM layers kept) and the SSM group's state spec (hybrid/groups._state_spec)",
    "mamba_ssm_cache_dtype": "keyed: as mamba_cache_dtype (the SSM state alone)",
    "mamba_cache_mode": "refused: 'none' (hybrid/groups._state_spec); 'align' is what ucm-db stores",
    "sliding_window": "no: a copy of the model's window (hashed config; disable_sliding_window keyed)",
    "is_attention_free": "no: a copy of the model's (a model with no attention group is refused: groups.kv_groups)",
    "kv_cache_layout": "no: the physical stride order of one logical cache (vllm/v1/kv_cache_layout.py); units are "
                       "copied through the logical view (connector/layouts.py)",
    "kv_sharing_fast_prefill": "no: layers that read another layer's KV skip prefill tokens; they write no KV",
    "swa_bounded_replay": "no: which KV is cached, not its values (DeepSeek-V4.1, refused for its indexer)",
    "use_replayssm": "no: the same recurrence; vLLM flushes the exact state at every align boundary "
                     "(mamba_attn.py), rounding only",
    "replayssm_buffer_len": "no: ReplaySSM's flush interval, rounding only",
    "use_kda_recoverssm": "no: derived; a speculative-decode path",
    "mamba_block_size": "no: where SSM state is checkpointed, not its value",
    "enable_mamba_shared_prefix_checkpoint": "no: an extra checkpoint",
    "mamba_page_size_padded": "no: page padding",
    "skip_page_size_padded": "no: page padding",
    "enable_prefix_caching": "no: vLLM's own cache (with the processor cache off: counter identifiers, "
                             "identity_guards.counter_identifiers)",
    "prefix_caching_hash_algo": "no: vLLM's own block hash; ucm-db keys its own",
    "prefix_match_unit": "no: vLLM's hash granularity",
    "prefix_cache_retention_interval": "no: which checkpoints vLLM keeps",
    "hash_block_size": "no: derived hash granularity",
    "cache_hit_alignment_tokens": "no: derived hit granularity",
    "user_specified_block_size": "no: bookkeeping",
    "_block_size_resolved": "no: bookkeeping",
    "gpu_memory_utilization": "no: sizing",
    "kv_cache_memory_bytes": "no: sizing",
    "num_gpu_blocks_override": "no: sizing",
    "num_gpu_blocks": "no: sizing",
    "num_cpu_blocks": "no: sizing",
    "effective_attention_block_size": "no: derived",
    "kv_cache_size_tokens": "no: sizing",
    "kv_cache_max_concurrency": "no: sizing",
    "kv_offloading_size": "no: offload",
    "kv_offloading_backend": "no: offload",
}

_CP = "refused: only with context parallelism, which identity_guards.refuse_unstorable refuses"
_TRANSPORT = "no: placement, transport or process setup"

PARALLEL_CONFIG_FIELDS = {
    "prefill_context_parallel_size": "refused: identity_guards.refuse_unstorable (above 1)",
    "decode_context_parallel_size": "refused: identity_guards.refuse_unstorable (above 1)",
    "dcp_kv_cache_interleave_size": _CP,
    "cp_kv_cache_interleave_size": _CP,
    "_allow_auto_resolve_cp_interleave_size": _CP,
    "dcp_comm_backend": _CP,
    "dcp_q_replicate": _CP,
    "tensor_parallel_size": "no: units of one KV head (docs/tp.md), rounding only (keyed for dummy weights: load_inputs)",
    "pipeline_parallel_size": "no: units of one stage's layers (docs/tp.md)",
    "data_parallel_size": "no: MoE sharding, rounding only (keyed for dummy weights with EP: load_inputs)",
    "enable_expert_parallel": "no: EP, rounding only by policy (keyed for dummy weights: load_inputs)",
    "enable_eplb": "no: EPLB, the same experts' weights elsewhere",
    "eplb_config": "no: EPLB, the same experts' weights elsewhere",
    "expert_placement_strategy": "no: which rank holds an expert",
    "enable_ep_weight_filter": "no: each rank reads only its experts, the same weights",
    "enable_elastic_ep": "no: EP scaling",
    "elastic_ep_max_dp_size": "no: EP scaling",
    "all2all_backend": "no: EP traffic; it quantizes only where the model's keyed quantization does "
                       "(fused_moe/all2all_utils.py; the FP4/FP8 env switches are keyed)",
    "enable_hc_sp": "no: HyperConnection split across TP ranks, rounding only",
    "enable_dbo": "no: micro-batching, rounding only",
    "ubatch_size": "no: micro-batching",
    "dbo_decode_token_threshold": "no: micro-batching",
    "dbo_prefill_token_threshold": "no: micro-batching",
    "disable_custom_all_reduce": "no: all-reduce kernel (unquantized), rounding only",
    "enable_batch_sharded_sampling": "no: sampling",
    "is_moe_model": "no: derived",
    "worker_cls": "no: the platform's worker (a plug-in's weight updates are outside config: /tmp/tripwires.md)",
    "worker_extension_cls": "no: adds collective_rpc methods (weight updates through them: /tmp/tripwires.md)",
    "max_parallel_loading_workers": "no: loading",
    "enable_shm_tensor_arena": _TRANSPORT,
    "data_parallel_size_local": _TRANSPORT,
    "data_parallel_rank": _TRANSPORT,
    "data_parallel_rank_local": _TRANSPORT,
    "data_parallel_master_ip": _TRANSPORT,
    "data_parallel_rpc_port": _TRANSPORT,
    "dp_sync_interval": _TRANSPORT,
    "data_parallel_master_port": _TRANSPORT,
    "data_parallel_backend": _TRANSPORT,
    "data_parallel_external_lb": _TRANSPORT,
    "data_parallel_hybrid_lb": _TRANSPORT,
    "data_parallel_index": _TRANSPORT,
    "disable_nccl_for_dp_synchronization": _TRANSPORT,
    "ray_workers_use_nsight": _TRANSPORT,
    "ray_runtime_env": _TRANSPORT,
    "placement_group": _TRANSPORT,
    "distributed_executor_backend": _TRANSPORT,
    "master_addr": _TRANSPORT,
    "master_port": _TRANSPORT,
    "node_rank": _TRANSPORT,
    "nnodes": _TRANSPORT,
    "numa_bind": _TRANSPORT,
    "numa_bind_nodes": _TRANSPORT,
    "numa_bind_cpus": _TRANSPORT,
    "assigned_physical_gpu_ids": _TRANSPORT,
    "distributed_timeout_seconds": _TRANSPORT,
    "cpu_distributed_timeout_seconds": _TRANSPORT,
    "world_size": _TRANSPORT,
    "rank": _TRANSPORT,
    "_data_parallel_master_port_list": _TRANSPORT,
    "_coord_store_port": _TRANSPORT,
    "_api_process_count": _TRANSPORT,
    "_api_process_rank": _TRANSPORT,
    "enable_fault_tolerance": _TRANSPORT,
    "fault_tolerance_config": _TRANSPORT,
}

CONFIG_FIELDS = {
    "AttentionConfig": ATTENTION_CONFIG_FIELDS,
    "LoRAConfig": LORA_CONFIG_FIELDS,
    "KernelConfig": KERNEL_CONFIG_FIELDS,
    "CacheConfig": CACHE_CONFIG_FIELDS,
    "ParallelConfig": PARALLEL_CONFIG_FIELDS,
}

_VERDICTS = ("keyed: ", "refused: ", "no: ", "MISSED: ")


def _fields(config: str) -> set[str]:
    import vllm.config

    cls = getattr(vllm.config, config)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.model_fields)  # a pydantic model


@pytest.mark.parametrize("config", sorted(CONFIG_FIELDS))
def test_every_field_of_the_configs_beside_the_model_config_is_judged(config: str) -> None:
    judged = CONFIG_FIELDS[config]
    print(f"known missed (changes K/V, not keyed yet): {sorted(KNOWN_MISSED)}")
    fields = _fields(config)
    new, gone = sorted(fields - set(judged)), sorted(set(judged) - fields)
    assert not new, f"vLLM's {config} has new fields {new}: judge whether each changes K/V ({config} in this file)"
    assert not gone, f"vLLM's {config} lost fields {gone}: drop them here (and from connector/identity*.py)"
    unjudged = sorted(name for name, why in judged.items() if not why.startswith(_VERDICTS))
    assert not unjudged, f"{config}: judgements of {unjudged} start with none of {_VERDICTS}"


def test_the_missed_fields_are_the_known_ones() -> None:
    missed = {f"{config}.{name}" for config, judged in CONFIG_FIELDS.items()
              for name, why in judged.items() if why.startswith("MISSED")}
    print(f"known missed (changes K/V, not keyed yet): {sorted(KNOWN_MISSED)}")
    assert missed == KNOWN_MISSED, (f"judged MISSED but not in KNOWN_MISSED: {sorted(missed - KNOWN_MISSED)}; "
                                    f"in KNOWN_MISSED but judged otherwise: {sorted(KNOWN_MISSED - missed)}")


# -- keyed judgements, checked -------------------------------------------------

#: Keyed fields whose check lives in test_identity_inputs.KV_CHANGING.
_CHECKED_THERE = {
    "AttentionConfig.use_prefill_query_quantization": "attention_config.use_prefill_query_quantization",
    "AttentionConfig.disable_flashinfer_q_quantization": "attention_config.disable_flashinfer_q_quantization",
    "CacheConfig.block_size": "cache_config.block_size",
    "CacheConfig.cache_dtype": "cache_config.cache_dtype",
    "CacheConfig.kv_cache_dtype_skip_layers": "cache_config.kv_cache_dtype_skip_layers",
}
#: Keyed fields checked in this file.
_CHECKED_HERE = {
    "KernelConfig.linear_backend", "KernelConfig.linear_backend_per_quant", "KernelConfig.moe_backend",
    "AttentionConfig.backend", "AttentionConfig.backend_per_kind", "AttentionConfig.flash_attn_version",
    "AttentionConfig.use_trtllm_attention", "AttentionConfig.mla_prefill_backend",
    "CacheConfig.mamba_cache_dtype", "CacheConfig.mamba_ssm_cache_dtype",
    "LoRAConfig.lora_dtype", "LoRAConfig.target_modules", "LoRAConfig.enable_mixed_moe_lora_format",
    "LoRAConfig.enable_moe_shared_loras", "LoRAConfig.enable_tower_connector_lora",
}


def test_every_keyed_judgement_has_a_check() -> None:
    keyed = {f"{config}.{name}" for config, judged in CONFIG_FIELDS.items()
             for name, why in judged.items() if why.startswith("keyed")}
    assert keyed == set(_CHECKED_THERE) | _CHECKED_HERE, f"unchecked: {sorted(keyed - set(_CHECKED_THERE) - _CHECKED_HERE)}"
    assert set(_CHECKED_THERE.values()) <= set(KV_CHANGING), "a case named here is gone from KV_CHANGING"


_KERNEL_CHANGES = {
    "linear_backend": "marlin",
    "moe_backend": "triton",
    "linear_backend_per_quant": {"nvfp4_w4a16": "humming"},
}


@pytest.mark.parametrize("field", sorted(_KERNEL_CHANGES))
def test_a_quantized_models_named_kernel_backend_reaches_the_namespace(model_dir: Path, field: str) -> None:
    base, changed = _vllm_config(model_dir), _vllm_config(model_dir)
    for config in (base, changed):
        _set(("model_config.quantization", "fp8"))(config)
    _set((f"kernel_config.{field}", _KERNEL_CHANGES[field]))(changed)
    assert _namespace_of(changed).digest != _namespace_of(base).digest, f"kernel_config.{field} does not reach the namespace"
    # Not quantized: a kernel choice, rounding only (policy): one namespace.
    plain, plain_changed = _vllm_config(model_dir), _vllm_config(model_dir)
    _set((f"kernel_config.{field}", _KERNEL_CHANGES[field]))(plain_changed)
    assert _namespace_of(plain_changed).digest == _namespace_of(plain).digest


@pytest.mark.parametrize("change", [{"lora_dtype": "float16"}, {"target_modules": ["o_proj"]},
                                    {"enable_mixed_moe_lora_format": True}, {"enable_moe_shared_loras": True}],
                         ids=lambda change: next(iter(change)))
def test_how_the_engine_applies_adapters_is_keyed(change: dict) -> None:
    from vllm.config import LoRAConfig

    default = lora_engine_inputs(SimpleNamespace(lora_config=LoRAConfig()))
    assert lora_engine_inputs(SimpleNamespace(lora_config=LoRAConfig(**change))) != default


def test_tower_connector_lora_names_the_adapter_in_multimodal_identifiers() -> None:
    """vLLM, not ucm-db, carries it: with the option on, an adapter request's
    multimodal identifier names the adapter, and ucm-db keys identifiers."""
    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.input_processor import InputProcessor

    adapter = LoRARequest("tuned", 1, "/adapters/tuned")
    on = SimpleNamespace(lora_config=LoRAConfig(enable_tower_connector_lora=True))
    off = SimpleNamespace(lora_config=LoRAConfig())
    assert InputProcessor._get_mm_identifier(on, "img", adapter) != InputProcessor._get_mm_identifier(off, "img", adapter)
    assert InputProcessor._get_mm_identifier(on, "img", None) == "img"  # no adapter: the same embeddings


# -- refused and missed judgements, checked ---------------------------------------


def test_a_sparse_indexer_cache_beside_the_attention_is_refused() -> None:
    """The fields judged refused for sparse-indexer models rest on this: the
    indexer's K cache is an MLA spec of another head size, so vLLM groups it
    with the attention as ``UniformTypeKVCacheSpecs`` (or a group of its own)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    attention = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    names = ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"]
    together = UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=dict(zip(names, (attention, indexer))))
    apart = [KVCacheGroupSpec([names[0]], attention), KVCacheGroupSpec([names[1]], indexer)]
    for groups in ([KVCacheGroupSpec(names, together)], apart):
        with pytest.raises(ConfigError, match="cannot store"):
            kv_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))


def test_the_ssm_state_dtype_is_keyed_in_the_ssm_groups_state_spec() -> None:
    """The SSM group's own part; every group's namespace carries the state
    dtypes too (:func:`test_the_ssm_state_dtype_reaches_every_groups_namespace`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    def namespaces(state_dtype: torch.dtype) -> list[Namespace]:
        attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        ssm = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(state_dtype,), mamba_cache_mode="align")
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention), KVCacheGroupSpec(["model.layers.1.mixer"], ssm)])
        groups = kv_groups(config)
        base = Namespace(model="m", kv_dtype="bfloat16", block_size=32)
        return [group_namespace(base, groups, group) for group in groups]

    fp32, bf16 = namespaces(torch.float32), namespaces(torch.bfloat16)
    assert fp32[1] != bf16[1]  # the SSM group's state spec names its dtype


@pytest.mark.parametrize("field", ["mamba_cache_dtype", "mamba_ssm_cache_dtype"])
def test_the_ssm_state_dtype_reaches_every_groups_namespace(model_dir: Path, field: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's attention layers compute from the hidden states its
    SSM layers made with their state in this dtype: the namespace every group
    derives from (``Namespace.extra``) names it where it is not ``auto``. A
    model without SSM layers is not keyed by it (vLLM sets it there too). The
    hybrid model is this Llama declared hybrid (a stand-in: the namespace
    inputs read only the flag)."""
    from vllm.config import ModelConfig

    def moved() -> bool:
        base, changed = _vllm_config(model_dir), _vllm_config(model_dir)
        for config in (base, changed):
            _set((f"cache_config.{field}", "bfloat16"))(config)
        _set((f"cache_config.{field}", "float32"))(changed)
        return _namespace_of(changed).digest != _namespace_of(base).digest

    assert not moved()
    monkeypatch.setattr(ModelConfig, "is_hybrid", property(lambda self: True))
    assert moved()


def _attention_choices() -> dict[str, object]:
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return {"backend": AttentionBackendEnum.TRITON_ATTN, "backend_per_kind": {"full": AttentionBackendEnum.FLASHINFER},
            "flash_attn_version": 4, "use_trtllm_attention": False, "mla_prefill_backend": next(iter(MLAPrefillBackendEnum))}


@pytest.mark.parametrize("field", ["backend", "backend_per_kind", "flash_attn_version", "use_trtllm_attention",
                                   "mla_prefill_backend"])
def test_under_a_quantized_kv_cache_the_attention_choice_reaches_the_namespace(model_dir: Path, field: str) -> None:
    """With an fp8 KV cache the attention backend decides whether queries are
    quantized too; without one, a backend changes rounding only (policy)."""
    value = _attention_choices()[field]
    for cache_dtype, moves in (("fp8", True), ("auto", False)):
        base, changed = _vllm_config(model_dir), _vllm_config(model_dir)
        for config in (base, changed):
            _set(("cache_config.cache_dtype", cache_dtype))(config)
        _set((f"attention_config.{field}", value))(changed)
        assert (_namespace_of(changed).digest != _namespace_of(base).digest) is moves, (field, cache_dtype)
