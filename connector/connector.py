"""``UcmDbConnector``: the vLLM ``KVConnectorBase_V1`` facade.

Enable it with::

    --kv-transfer-config '{"kv_connector": "UcmDbConnector",
        "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/var/cache/ucm-db"}}'

The facade only dispatches: scheduler-role calls go to
:class:`~ucm_db.connector.scheduler.hooks.UcmDbScheduler`, worker-role calls to
:class:`~ucm_db.connector.worker.hooks.UcmDbWorker`.

Start-up: a bad setting or an unusable store stops the engine with one log
line ``ucm-db connector cannot start: <error> (hint: <fix>)`` ahead of vLLM's
tracebacks. Settings are parsed and the store is opened (and held until
``shutdown``) in the constructor of both roles; before that, the engine core
asks :meth:`UcmDbConnector.get_required_kvcache_layout` right after loading
the weights (before profiling, KV allocation and compilation), which runs
the same checks. A ``kv_consumer`` whose store is on a read-only volume
opens it read-only (:func:`ucm_db.connector.stores.role_store_options`).

Invariants:
    * Every vLLM call reaching the wrong role is a no-op with an empty
      answer (no tokens matched, empty metadata, nothing finished), never an
      AttributeError or AssertionError: vLLM may call either side's hooks
      on either role (tests/connector/test_connector_roles.py).
    * With ``load_mode`` ``block`` or ``layer`` loads are synchronous from
      vLLM's point of view (``load_kv_async`` False): a hit is fully in the
      KV cache, or reported failed, by the end of the step that uses it.
      Under vLLM's async scheduling every hit loads asynchronously instead
      (scheduler/hooks.py: vLLM 0.32 cannot recover a sync load that fails
      while the request's next step runs).
      A model with several KV cache groups loads asynchronously whatever
      the mode, and reports a failed load per request in ``failed_recving``
      (``get_transfer_results``), never as block ids (hybrid.py). With
      ``async`` a hit loads beside later steps (``load_kv_async`` True) and
      ``get_finished`` names the request once it is in place; a step with
      nothing else to run waits up to
      :data:`~ucm_db.connector.metadata.IDLE_WAIT_S` there for a load to
      end. A request waiting for a producer's announced blocks gets ``None``
      from ``get_num_new_matched_tokens`` until they are visible or its
      ``load_deadline_s`` passed. vLLM's null block is never loaded into
      nor saved from (hybrid/null_blocks.py).
    * ``SupportsHMA``: vLLM keeps its hybrid KV cache manager with ucm-db
      on and calls ``request_finished_all_groups`` (one block list per KV
      cache group) instead of ``request_finished`` for every model. A model
      with one group is served as before; one with several, group by group
      (:mod:`ucm_db.connector.hybrid.hooks`); groups ucm-db cannot store (an SSM
      state without block boundaries, chunked local attention ...) stop the
      engine in the constructor, before the worker allocates the KV cache.
    * ``kv_role`` picks the prefill/decode role (:mod:`ucm_db.connector.roles`):
      ``kv_producer`` commits within the step and returns what it published
      as ``kv_transfer_params``; ``kv_consumer`` never saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults, SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import ucm_db
from ucm_db.connector import engine_facts
from ucm_db.connector.events import FeedEvents, GroupEvents
from ucm_db.connector.hybrid.hooks import GroupedScheduler, GroupedWorker, check_hybrid
from ucm_db.connector.hybrid.null_blocks import NullBlockGuard
from ucm_db.connector.identity import kv_shape, stored_groups
from ucm_db.connector.metadata import IDLE_WAIT_S, UcmDbConnectorMetadata
from ucm_db.connector.metrics import UcmDbConnectorStats, UcmDbPromMetrics
from ucm_db.connector.scheduler.hooks import UcmDbScheduler
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import acquire, check_openable, refuse_older_generations, release, role_settings
from ucm_db.connector.worker.hooks import UcmDbWorker
from ucm_db.errors import UcmDbError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class UcmDbConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector storing full KV blocks in a ucm-db store; every KV cache
    group of a hybrid model apart (hybrid.py)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._held_store: ucm_db.Store | None = None
        self._scheduler: UcmDbScheduler | GroupedScheduler | None = None
        self._null_blocks = NullBlockGuard(active=False)
        self._events: GroupEvents | None = None  # KV cache events from the store's change feed (events.py)
        self._worker: UcmDbWorker | GroupedWorker | None = None
        if role != KVConnectorRole.SCHEDULER:
            engine_facts.use_spare_cpus(vllm_config)  # before the store opens: its threads start off the model's cores
        try:
            self.settings, self.pd_role = role_settings(
                self._kv_transfer_config.kv_connector_extra_config, self._kv_transfer_config.kv_role,
            )
            # Opened here, held until shutdown: a bad path or an unusable
            # store stops the engine now, not at the first request.
            self._held_store = acquire(self.settings)
        except Exception as exc:  # a UcmDbError, or one ucm-db did not expect: the one line either way
            _log_start_failure(exc)
            raise
        try:
            self._start(vllm_config, role, kv_cache_config)
        except BaseException as exc:
            # A refused start closes the store it opened: its threads would
            # otherwise run on in a process that goes on without ucm-db.
            self.shutdown()
            if isinstance(exc, Exception):
                _log_start_failure(exc)
            raise

    def _start(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None) -> None:
        """The role's half, on the store opened in ``__init__``."""
        assert self._held_store is not None
        # The worker's connector is made before vLLM allocates the KV
        # cache: a model whose groups ucm-db cannot store stops here.
        self.shape = kv_shape(vllm_config, kv_cache_config, self.settings.model_id)
        self.groups = stored_groups(vllm_config, kv_cache_config)
        check_hybrid(self.groups, self.shape, self.settings)
        # Blocks of an older storage generation: `ucm-db migrate` converts them (pre_units).
        refuse_older_generations(self._held_store, self.settings, self.shape)
        hybrid = len(self.groups) > 1
        # A lone group's table may hold vLLM's null block (a window, skipped blocks: hybrid/null_blocks.py).
        self._null_blocks = NullBlockGuard(active=not hybrid)
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "ucm-db: kv_load_failure_policy=%r makes a corrupt or evicted block fail its request; "
                    "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            # refuse_older_generations ran above, once for every role and group.
            steps_overlap = engine_facts.steps_overlap(vllm_config)  # every claim async (hooks.py)
            if steps_overlap and not hybrid and self.settings.load_mode != "async":
                logger.info("ucm-db: this engine plans a step before the last one's output is back (async scheduling or a "
                            "pipeline-parallel batch queue), so every hit loads asynchronously (load_mode %r is for engines "
                            "without it): vLLM recovers from a failed load only before it computes over it",
                            self.settings.load_mode)
            self._scheduler = (GroupedScheduler(self.settings, self.shape, self.pd_role, self.groups, generations_checked=True)
                               if hybrid else UcmDbScheduler(self.settings, self.shape, self.pd_role, generations_checked=True,
                                                             steps_overlap=steps_overlap))
            events_config = vllm_config.kv_events_config
            if events_config is not None and events_config.enable_kv_cache_events:
                parts = self._scheduler.parts if isinstance(self._scheduler, GroupedScheduler) else [self._scheduler]
                specs = [engine_facts.event_spec(kv_cache_config, group.index) for group in self.groups]  # parts are in group order
                self._events = GroupEvents([FeedEvents(part.store, part.namespace, lambda part=part: part.epoch, spec)
                                            for part, spec in zip(parts, specs)])
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = (GroupedWorker(self.settings, self.shape, num_blocks, self.pd_role, self.groups) if hybrid
                            else UcmDbWorker(self.settings, self.shape, num_blocks, self.pd_role))

    @property
    def requires_kv_delivery(self) -> bool:
        # vLLM reads it once: True drops a preempted request's output still
        # in flight (it is computed again once the request resumes) instead
        # of delivering it. That output may have been sampled over a load
        # whose failure its step's output has not reported yet (the step
        # after it, planned before, preempted the request), and vLLM rewinds
        # only the requests it runs: delivered, it would be a wrong token.
        # Without overlapping steps nothing is in flight at a preemption.
        return True

    # -- worker side ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            tp_rank, pp_rank = engine_facts.ranks()
            self._worker.register_kv_caches(kv_caches, tp_rank, pp_rank)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Blocks are saved whole at wait_for_save: a layer's KV is not final
        # for the block until the step ends, and whole-block copies are
        # cheaper than per-layer ones here.
        return

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save(self._metadata())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM calls it at the start of each step, before loads and forward:
        # no save of a preempted request reads its freed blocks (preemptions.py).
        if self._worker is not None and isinstance(kv_connector_metadata, UcmDbConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves are copied out within their step: no request waits to free
        # its blocks. Requests wait on us only for async loads.
        if self._worker is None:
            return None, None
        idle = self.has_connector_metadata() and self._metadata().idle
        done = self._worker.finished_loads(IDLE_WAIT_S if idle else 0.0)
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's failed loads: per request (in finished_recving too),
        # never as block ids, which stop vLLM 0.32's engine (hybrid.py).
        results = super().get_transfer_results(finished_req_ids)
        if isinstance(self._worker, GroupedWorker):
            results.failed_recving = self._worker.take_failed_loads()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        # The step's load timings, for the scheduler's cost model.
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        part = self._worker or self._scheduler
        return part.counters.take() if part is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        held, self._held_store = self._held_store, None
        if held is not None:
            release(held)

    def _metadata(self) -> UcmDbConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, UcmDbConnectorMetadata):
            raise TypeError(f"ucm-db's worker was bound {type(meta).__name__}, not the metadata its scheduler builds")
        return meta

    # -- scheduler side ---------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """ucm-db's hits by tier for ``vllm:prompt_tokens_cached_by_source``:
        the local tier as ``disk`` (an LMDB file read through the page
        cache), blocks its lookups fetched from the remote tier as
        ``external_unspecified`` (vLLM has no label for a remote store)."""
        if num_external_tokens <= 0:
            return {}
        split = {"disk": num_external_tokens} if self._scheduler is None else self._scheduler.hit_sources(request, num_external_tokens)
        labels = {"disk": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}
        return {labels[name]: count for name, count in split.items() if count}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmDbConnectorMetadata:
        if self._scheduler is None:
            return UcmDbConnectorMetadata()
        return self._null_blocks.apply(self._scheduler.build_connector_meta(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: vLLM calls this for every model, one block list per KV cache group.
        if self._scheduler is None:
            return False, None
        if isinstance(self._scheduler, GroupedScheduler):
            return self._scheduler.request_finished(request, block_ids)
        self._null_blocks.forget(request.request_id)
        return self._scheduler.request_finished(request, block_ids[0])

    def take_events(self) -> list[KVCacheEvent]:
        """``BlockStored``/``BlockRemoved`` (medium ``STORAGE``) of every block stored or removed since
        the last step by any process on the store (events.py), where vLLM's KV cache events are on."""
        return self._events.take() if self._events is not None else []

    def reset_cache(self) -> bool | None:
        # reset_prefix_cache(reset_connector=True): epochs.py.
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Failed loads -> void the saves computed over them; workers' load
        # timings and the step's round trip -> cost model.
        if self._scheduler is None:
            return
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if isinstance(self._scheduler, GroupedScheduler):  # its failed loads come per request (hybrid.py)
            self._scheduler.observe_output(worker_meta, invalid, set(getattr(connector_output, "failed_recving", None) or ()))
        else:
            self._scheduler.observe_output(worker_meta, invalid)

    # -- start-up checks ---------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # vLLM's engine core asks this right after loading the weights, before
        # it profiles memory, allocates the KV cache and compiles: the earliest
        # call that carries the whole config on every platform. Settings and
        # store are checked here so a mistake costs seconds, not a warm-up.
        try:
            settings, _ = role_settings(vllm_config.kv_transfer_config.kv_connector_extra_config,
                                        vllm_config.kv_transfer_config.kv_role)
            check_openable(settings)
        except Exception as exc:
            _log_start_failure(exc)
            raise
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Asked while vLLM builds its config (before any engine process starts)
        # where full CUDA graphs are on: settings are checked there too. Layer
        # mode loads in a thread that attention layers wait for, which a
        # captured graph cannot do.
        try:
            return ConnectorSettings.from_extra_config(extra_config).load_mode == "layer"
        except Exception as exc:
            _log_start_failure(exc)
            raise

    # -- metrics -------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return UcmDbConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return UcmDbPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _log_start_failure(exc: Exception) -> None:
    """One log line with the error and its hint ahead of vLLM's tracebacks (one ucm-db did not expect: its type and text)."""
    text = str(exc) if isinstance(exc, UcmDbError) else (f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]} (hint: the "
                                                         "traceback that follows shows where; check the settings and the store path)")
    logger.error("ucm-db connector cannot start: %s", text)
