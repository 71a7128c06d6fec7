"""What the connector reads of the vLLM engine it starts in, beside its
config: whether its steps overlap, this worker's ranks, a KV cache group's
event metadata, the CPUs the model thread leaves spare
(:mod:`ucm_db.cpu_placement`), and the view of a layer's KV cache the
layout adapter will be handed (:func:`kv_view`).

Invariants:
    * Each reads vLLM's state only; none raises outside a distributed run or
      on another platform (a plain default instead).
    * :func:`kv_view` reads the spec and the platform only (the scheduler
      and every worker derive the same one), with vLLM's own allocator
      arithmetic; it is None, keeping the namespaces stores already hold,
      for the default CPU layout only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ucm_db import cpu_placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def use_spare_cpus(vllm_config: VllmConfig) -> None:
    """On vLLM-CPU with one worker and its thread binding on, names the CPUs
    the engine was started with that the model thread is not bound to (the
    reserved cores) for ucm-db's threads: compression, loads and uploads
    then run beside the model, not on its cores (:mod:`ucm_db.cpu_placement`).

    "Started with" is the parent process's affinity (the engine core, or
    the process that made the engine), so a ``taskset``/``numactl`` binding
    of the server holds. Nothing moves with several workers (each rank's
    model cores are its own to know: another rank's could look spare), on
    other platforms, or with ``VLLM_CPU_OMP_THREADS_BIND=nobind``."""
    from vllm.platforms import current_platform

    if (not current_platform.is_cpu() or vllm_config.parallel_config.world_size != 1
            or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "nobind"):
        return
    try:
        started_with = os.sched_getaffinity(os.getppid())
    except OSError:
        return
    spare = cpu_placement.spare_cpus(started_with)
    if spare:
        cpu_placement.set_background_cpus(spare)
        logger.info("ucm-db: background threads on CPUs %s (the model thread is bound to %s)",
                    sorted(spare), sorted(os.sched_getaffinity(0)))


def event_spec(kv_cache_config: KVCacheConfig | None, group_index: int) -> tuple[str | None, int | None]:
    """vLLM's event metadata of a KV cache group (spec kind, sliding window),
    as vLLM's KV cache manager and OffloadingConnector publish it."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    if kv_cache_config is None:
        return None, None
    spec = kv_cache_config.kv_cache_groups[group_index].kv_cache_spec
    return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)


def steps_overlap(vllm_config: VllmConfig) -> bool:
    """Whether the engine plans a step before the last one's output is back:
    vLLM's async scheduling, or a pipeline-parallel engine's batch queue (one
    batch in flight a stage). vLLM's ``max_concurrent_batches`` counts both;
    a build without it falls back to the two settings behind it.

    There a synchronous load that fails is reported after the next step
    computed over it, which the scheduler's stale-block tracker cannot judge
    (:mod:`ucm_db.connector.scheduler.stale_blocks`): every claim then loads
    asynchronously, and vLLM holds the request until its load is in."""
    batches = getattr(vllm_config, "max_concurrent_batches", None)
    if isinstance(batches, int):
        return batches > 1
    return bool(vllm_config.scheduler_config.async_scheduling) or int(vllm_config.parallel_config.pipeline_parallel_size) > 1


def ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed run."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 0


#: Device types whose KV caches vLLM's own model runner allocates (GPUModelRunner, its CPU and XPU subclasses;
#: ROCm's device type is ``cuda``): vLLM 0.32's allocator views every layer with paged KV as ``[blocks, heads,
#: block, content]`` whatever the attention backend (``vllm/v1/worker/utils.py: allocate_kv_cache``).
_VLLM_RUNNERS = ("cpu", "cuda", "xpu")


def kv_view(spec: Any, platform: Any) -> dict[str, Any] | None:
    """The layout kind and per-layer block shape the adapter will see
    (:func:`ucm_db.connector.layouts.detect_layout`), for the namespace's
    layout record; None for the default CPU layout (module invariants).

    On vLLM's own runners with 0.32's allocator: kind ``cpu`` (the 4-D view)
    and ``block`` = [tokens, content bytes] of one KV head's slot
    (FlashAttention, FlashInfer and Triton alike: ``[block, K|V]``; packed
    scales change it). Where a backend publishes head slots that are not one
    per KV head (ROCm AITER's shuffled layout: a K plane and a V plane of
    every head, tiles rearranged), this rank's slots and KV heads too: such
    a view is not per head, and only the same one reads it. Elsewhere (an
    older vLLM, whose backends chose their own shapes; a platform plug-in's
    runner, vllm-ascend's ``(k, v)`` tuples) the view is not a function of
    the spec: kind ``runner``, named by the package that lays the KV out and
    its version, so a change of either is a miss, never other bytes."""
    if platform is None or not hasattr(spec, "num_kv_heads"):  # no platform (the tag says "unknown"); not paged
        return None                                            # attention KV (an SSM group describes its own state)
    device = str(getattr(platform, "device_type", "") or "")
    view = _allocator_view(spec) if device in _VLLM_RUNNERS else None
    if view is None:
        return {"kind": "runner", "runner": _runner(platform)}
    head_size_v = getattr(spec, "head_size_v", None)  # MLA: 0 (the latent only)
    dense = {"kind": "cpu", "block": [int(spec.block_size), (int(spec.head_size) + int(spec.head_size if head_size_v is None
                                                                                    else head_size_v)) * int(spec.dtype.itemsize)]}
    return None if device == "cpu" and view == dense else view  # dense: one slot per KV head of its K then V, unpadded


def _allocator_view(spec: Any) -> dict[str, Any] | None:
    """vLLM 0.32's per-layer view ``[blocks, slots, tokens, content]`` of
    ``spec``, as :func:`kv_view` keys it (None before that allocator, or
    for a spec it does not view)."""
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    except ImportError:
        return None
    if not getattr(spec, "has_layer_views", False):
        return None
    _blocks, slots, tokens, content_bytes = compute_layer_kv_cache_shape_bytes(spec, 1)
    view: dict[str, Any] = {"kind": "cpu", "block": [int(tokens), int(content_bytes)]}
    if getattr(spec, "num_head_slots", None) is not None:
        view.update(head_slots=int(slots), rank_kv_heads=int(spec.num_kv_heads))
    return view


def _runner(platform: Any) -> str:
    """``package==version`` of the code defining ``platform`` (vLLM's, or a platform plug-in's)."""
    package = type(platform).__module__.split(".")[0]
    try:
        from importlib import metadata

        dists = metadata.packages_distributions().get(package) or [package]
        return f"{package}=={metadata.version(dists[0])}"
    except Exception:  # noqa: BLE001 - no distribution: the package alone
        return package
