"""Namespaces of a vLLM deployment: what makes its KV bytes incompatible.

A namespace fingerprints the model (``model_id`` if configured, else the
model name and revision for hub models, or a digest of the config and
weight files for a local directory: never the directory's path, so a copied
model keeps its cache and two different models in one path never share),
the KV dtype, the block size, the tensor/pipeline rank and size, and a
layout descriptor (platform, attention ISA, spec kind, layers, heads, head
size).

Invariants:
    * The scheduler process and every worker derive identical namespaces
      from the same ``VllmConfig`` and ``KVCacheConfig``: nothing here looks
      at live tensors or process-local state except the rank a worker passes.
    * MLA caches are identical on every TP rank: they live under one
      namespace (``tp_rank=0, tp_size=1``) that rank 0 writes and all read.
    * A hit counts only if every rank can load it: :func:`reader_namespaces`
      lists every namespace a scheduler-side lookup must find the block in.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace

#: Weight files up to this size are hashed whole; larger ones are sampled.
_FULL_HASH_BYTES = 256 << 20
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class KVShape:
    """The KV cache facts both roles read from vLLM's configs."""

    model: str
    kv_dtype: str
    block_size: int
    use_mla: bool
    layout: str
    tp_size: int
    pp_size: int


def kv_shape(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> KVShape:
    """Reads :class:`KVShape` from vLLM's configs (see module invariants)."""
    if kv_cache_config is None:
        raise ConfigError("vLLM passed no KVCacheConfig to the connector", hint="use vLLM >= 0.11 (this ucm-db targets 0.32)")
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(
            f"the model has {len(groups)} KV cache groups; ucm-db stores models with one attention KV cache group",
            hint="use a model with full attention in every layer, or run without ucm-db",
        )
    spec = groups[0].kv_cache_spec
    use_mla = type(spec).__name__.startswith("MLA")
    dtype = str(spec.dtype).removeprefix("torch.")
    model_config = vllm_config.model_config
    layers = getattr(model_config.hf_text_config, "num_hidden_layers", len(groups[0].layer_names))
    parts = {
        "platform": _platform_tag(spec, vllm_config),
        "spec": type(spec).__name__,
        "layers": layers,
        "kv_heads": getattr(spec, "num_kv_heads", 1),
        "head_size": getattr(spec, "head_size", 0),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }
    parallel = vllm_config.parallel_config
    return KVShape(
        model=model_id or model_fingerprint(model_config),
        kv_dtype=dtype,
        block_size=int(vllm_config.cache_config.block_size),
        use_mla=use_mla,
        layout=json.dumps(parts, sort_keys=True, separators=(",", ":")),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )


def rank_namespace(shape: KVShape, tp_rank: int, pp_rank: int) -> Namespace:
    """The namespace a worker of ranks (tp_rank, pp_rank) reads and writes."""
    if shape.use_mla:
        tp_rank, tp_size = 0, 1
    else:
        tp_size = shape.tp_size
    return Namespace(
        model=shape.model, kv_dtype=shape.kv_dtype, block_size=shape.block_size,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=shape.pp_size, layout=shape.layout,
    )


def reader_namespaces(shape: KVShape) -> list[Namespace]:
    """Every namespace a block must be in before the scheduler claims it."""
    tp_ranks = [0] if shape.use_mla else list(range(shape.tp_size))
    return [rank_namespace(shape, tp, pp) for pp in range(shape.pp_size) for tp in tp_ranks]


def namespace_index(shape: KVShape, tp_rank: int, pp_rank: int) -> int:
    """Position of a worker's namespace in :func:`reader_namespaces`."""
    tp_count = 1 if shape.use_mla else shape.tp_size
    return pp_rank * tp_count + (0 if shape.use_mla else tp_rank)


def writes_blocks(shape: KVShape, tp_rank: int) -> bool:
    """MLA: only TP rank 0 writes the replicated cache."""
    return not shape.use_mla or tp_rank == 0


def model_fingerprint(model_config: Any) -> str:
    """Model identity: name@revision for hub models, a content digest for a
    local directory (config files plus sampled weight bytes)."""
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    path = Path(model)
    if not path.is_dir():
        return f"{model}@{revision or 'main'}"
    digest = hashlib.sha256(b"ucm-db/model\0")
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        name = file.name
        if name.endswith(".json") or name.endswith(_WEIGHT_SUFFIXES):
            digest.update(name.encode() + b"\0")
            _hash_file(file, digest)
    return f"local:{path.name}:{digest.hexdigest()[:32]}"


def _hash_file(file: Path, digest: Any) -> None:
    size = file.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with file.open("rb") as handle:
        if size <= _FULL_HASH_BYTES:
            for chunk in iter(lambda: handle.read(8 << 20), b""):
                digest.update(chunk)
            return
        # Sampling keeps start-up fast on multi-GB checkpoints; the header
        # (tensor names, shapes) and 64 spread samples tell models apart.
        step = max(1, (size - _SAMPLE_BYTES) // (_SAMPLES - 1))
        for at in range(0, size, step):
            handle.seek(at)
            digest.update(handle.read(_SAMPLE_BYTES))


def _platform_tag(spec: Any, vllm_config: Any) -> str:
    """Platform plus, on CPU, the attention ISA (kernel block layouts differ)."""
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:  # noqa: BLE001 - tests without a platform
        device = "unknown"
    if device != "cpu":
        return device
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(spec.dtype, int(vllm_config.cache_config.block_size), getattr(spec, "head_size", None),
                            str(vllm_config.cache_config.cache_dtype))
    except Exception:  # noqa: BLE001 - private helper; fall back to the CPU feature
        import torch

        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    return f"cpu-{isa}-{os.uname().machine}"
