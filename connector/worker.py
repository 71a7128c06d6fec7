"""Worker side of the connector: loads into and saves out of the paged KV cache.

Invariants:
    * Loads of a step finish within the step: in ``block`` mode before the
      forward (``start_load_kv``); in ``layer`` mode a background thread
      decodes every block, then fills layer after layer, and each attention
      layer waits only for its own layer (``wait_for_layer_load``). Either
      way the loader is joined before the step's load errors are reported.
    * A block that fails to load (missing, corrupt: the store verifies every
      payload) is reported by :meth:`UcmDbWorker.take_load_errors` so vLLM
      recomputes it; no unverified byte reaches the KV cache.
    * Saves copy blocks out of the KV cache in ``wait_for_save`` (the
      blocks may be reused by the next step) and leave encoding and commit
      to the :class:`~ucm_db.connector.writer.BackgroundWriter`.
    * With MLA only TP rank 0 saves; every rank loads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db.connector.identity import KVShape, namespace_index, rank_namespace, writes_blocks
from ucm_db.connector.layouts import KVCacheEntry, KVLayout, detect_layout
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata
from ucm_db.connector.metrics import Counters
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import acquire, release
from ucm_db.connector.writer import BackgroundWriter, SaveJob

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class _LayerLoad:
    """A load running in a background thread, layer by layer."""

    def __init__(self, num_layers: int) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.thread: threading.Thread | None = None

    def finish(self) -> None:
        for event in self.ready:
            event.set()


class UcmDbWorker:
    """Worker-side half of :class:`~ucm_db.connector.UcmDbConnector`."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape, num_blocks: int | None) -> None:
        self._settings = settings
        self._shape = shape
        self._num_blocks = num_blocks
        self._layout: KVLayout | None = None
        self._store: ucm_db.Store | None = None
        self._writer: BackgroundWriter | None = None
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._layer_load: _LayerLoad | None = None
        self.counters = Counters()

    # -- setup ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheEntry], tp_rank: int, pp_rank: int) -> None:
        self._layout = detect_layout(kv_caches, self._num_blocks)
        self._namespace = rank_namespace(self._shape, tp_rank, pp_rank)
        self._chain = namespace_index(self._shape, tp_rank, pp_rank)
        self._writes = writes_blocks(self._shape, tp_rank)
        self._store = acquire(self._settings)
        self._writer = BackgroundWriter(self._store, self._layout.frames, self.counters, self._settings.max_pending_save_bytes)
        logger.info(
            "ucm-db connector (worker tp=%d pp=%d): store %s, %s, load_mode=%s, namespace %s",
            tp_rank, pp_rank, self._settings.path, self._layout.describe(), self._settings.load_mode, self._namespace.short_id,
        )

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches was not called")
        return self._layout

    # -- loads ---------------------------------------------------------------
    def start_load(self, meta: UcmDbConnectorMetadata) -> None:
        if not meta.loads or self._store is None:
            return
        if self._settings.load_mode == "layer":
            job = _LayerLoad(len(self.layout.layers))
            job.thread = threading.Thread(target=self._load, args=(meta.loads, job), name="ucm-db-loader", daemon=True)
            self._layer_load = job
            job.thread.start()
        else:
            self._load(meta.loads, None)

    def wait_for_layer(self, layer_name: str) -> None:
        job = self._layer_load
        if job is None:
            return
        index = self.layout.layer_index.get(layer_name)
        if index is None:
            self.finish_loads()
        else:
            job.ready[index].wait()

    def finish_loads(self) -> None:
        job, self._layer_load = self._layer_load, None
        if job is not None and job.thread is not None:
            job.thread.join()

    def _load(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None) -> None:
        try:
            self._load_blocks(loads, job)
        except Exception:  # noqa: BLE001 - a failed load must become recompute, not a crash
            logger.exception("ucm-db: loading KV blocks failed; they will be recomputed")
            with self._errors_lock:
                self._load_errors.update(b for t in loads for b in t.block_ids)
        finally:
            if job is not None:
                job.finish()

    def _load_blocks(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None) -> None:
        assert self._store is not None
        started = time.perf_counter()
        keys = [k for t in loads for k in t.keys[self._chain]]
        block_ids = [b for t in loads for b in t.block_ids]
        staging = self.layout.new_staging(len(keys))
        rows = staging.numpy()
        ok = self._store.get_into(self._namespace, keys, [rows[i] for i in range(len(keys))])
        good = [i for i, flag in enumerate(ok) if flag]
        failed = {block_ids[i] for i, flag in enumerate(ok) if not flag}
        if failed:
            with self._errors_lock:
                self._load_errors.update(failed)
            logger.warning("ucm-db: %d of %d blocks failed to load (missing or corrupt); vLLM will recompute them", len(failed), len(keys))
        if len(good) != len(keys):
            staging = staging.index_select(0, torch.as_tensor(good, dtype=torch.long))
        good_ids = [block_ids[i] for i in good]
        if job is None:
            self.layout.scatter(good_ids, staging)
        else:
            for layer in range(len(self.layout.layers)):
                self.layout.scatter(good_ids, staging, layer=layer)
                job.ready[layer].set()
        self.counters.add(
            loaded_blocks=len(good), loaded_bytes=len(good) * self.layout.block_bytes,
            load_s=time.perf_counter() - started, load_errors=len(failed),
        )

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------
    def save(self, meta: UcmDbConnectorMetadata) -> None:
        """Copies this step's newly computed blocks out and queues them."""
        self.finish_loads()
        if not meta.saves or not self._writes or self._writer is None:
            return
        started = time.perf_counter()
        for transfer in meta.saves:
            staging = self.layout.new_staging(len(transfer.block_ids))
            self.layout.gather(transfer.block_ids, staging)
            parent = transfer.parents[self._chain] if transfer.parents else None
            self._writer.submit(SaveJob(self._namespace, transfer.keys[self._chain], parent, staging))
        self.counters.add(save_copy_s=time.perf_counter() - started)

    def drain(self) -> None:
        """Waits until every queued save is committed (tests, benchmarks)."""
        if self._writer is not None:
            self._writer.drain()

    def shutdown(self) -> None:
        self.finish_loads()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._store is not None:
            release(self._store)
            self._store = None
