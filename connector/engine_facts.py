"""What the connector reads of the vLLM engine it starts in, beside its
config: this worker's ranks, a KV cache group's event metadata, and the CPUs
the model thread leaves spare (:mod:`ucm_db.cpu_placement`).

Invariants:
    * Each reads vLLM's state only; none raises outside a distributed run or
      on another platform (a plain default instead).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

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


def ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed run."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 0
