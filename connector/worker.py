"""Worker side of the connector: loads into and saves out of the paged KV cache.

Invariants:
    * Loads of a step finish within the step: in ``block`` mode before the
      forward (``start_load_kv``); in ``layer`` mode a background thread
      decodes every block, then fills layer after layer, and each attention
      layer waits only for its own layer (``wait_for_layer_load``). Either
      way the loader is joined before the step's load errors are reported.
      In ``async`` mode a request's hit loads beside later steps
      (:mod:`ucm_db.connector.async_loads`) and the request is reported by
      :meth:`UcmDbWorker.finished_loads` once its blocks are filled, with
      its failed blocks in the same step's load errors.
    * A block that fails to load (missing, corrupt: the store verifies every
      payload) is reported by :meth:`UcmDbWorker.take_load_errors` so vLLM
      recomputes it; no unverified byte reaches the KV cache.
    * Saves copy blocks out of the KV cache in ``wait_for_save`` (the
      blocks may be reused by the next step) and leave encoding and commit
      to the :class:`~ucm_db.connector.writer.BackgroundWriter`. A save whose
      ``after_loads`` include a block this worker failed to load in its
      last few steps is dropped (its KV attended to a stale slot); a held
      save waits for the scheduler's verdict (metadata.py), and the saves a
      step's metadata voids (a producer's, after another rank's failure)
      are deleted behind every queued save.
    * A save's blocks are read only while its request holds them: saves go
      through :class:`~ucm_db.connector.preemptions.PendingSaves`, and
      :meth:`UcmDbWorker.handle_preemptions` (vLLM's hook at the start of
      each step) drops those of preempted requests not yet copied and waits
      for their copies in flight (counted as ``saves_preempted``).
    * A worker reads and writes the units of its own KV heads and pipeline
      stage (:func:`~ucm_db.connector.identity.rank_spans`), whatever TP size
      wrote them; a block loads only if all its units do. Each head has one
      writer rank (replicated GQA heads: the first rank holding it; MLA: TP
      rank 0); every rank loads.
    * Only units are read (one storage generation; the scheduler refuses a
      store holding older ones, :mod:`ucm_db.pre_units`).
    * Each step's loads are timed (wall time of the read and the copy into
      the KV caches) and handed back once, with the step's number, by
      :meth:`UcmDbWorker.take_worker_meta`: the scheduler's cost model
      learns the local tier's load rate from them (cost_model.py). Async
      loads are handed back apart (``background_loads``): they ran beside
      the steps, not inside them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db import cpu_placement
from ucm_db.connector.async_loads import AsyncLoader
from ucm_db.connector.events import evented_chain
from ucm_db.connector.identity import KVShape, grid, namespace, rank_spans, writes_units
from ucm_db.connector.layouts import KVCacheEntry, KVLayout, detect_layout
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import Counters
from ucm_db.connector.preemptions import PendingSaves
from ucm_db.connector.roles import RolePolicy
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.stores import acquire, release
from ucm_db.connector.writer import BackgroundWriter, SaveJob, VoidJob
from ucm_db.errors import ConfigError
from ucm_db.units import UnitKeys, unit_keys_of

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
#: Steps whose failed loads a worker keeps: saves of a step planned before
#: the previous steps' outputs were back may be computed over them.
_FAILED_STEPS_KEPT = 4


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

    def __init__(self, settings: ConnectorSettings, shape: KVShape, num_blocks: int | None, role: RolePolicy = RolePolicy(),
                 group_namespace: ucm_db.Namespace | None = None) -> None:
        self._settings = settings
        self._group_namespace = group_namespace  # a hybrid model's KV cache group's (hybrid.py)
        self._role = role  # a kv_consumer never saves; a kv_producer commits within the step
        self._shape = shape
        self._num_blocks = num_blocks
        self._layout: KVLayout | None = None
        self._store: ucm_db.Store | None = None
        self._writer: BackgroundWriter | None = None
        self._load_errors: set[int] = set()
        # Blocks the last few steps' own loads failed (under _errors_lock): a
        # step may be planned before the last one's output is back.
        self._recent_failed: deque[set[int]] = deque(maxlen=_FAILED_STEPS_KEPT)
        self._held: dict[int, SaveJob] = {}  # saves kept until the scheduler's verdict (metadata.py)
        self._epoch: int | None = None  # the namespace epoch of the last bound step (connector/epochs.py)
        self._pending = PendingSaves()  # saves whose blocks are not copied out yet (preemptions.py)
        self._errors_lock = threading.Lock()
        self._layer_load: _LayerLoad | None = None
        self._step = -1  # the step whose metadata was bound last
        self._step_loads: dict[tuple[str, str], tuple[int, float]] = {}  # its load timings (under _errors_lock)
        self._background_loads: dict[tuple[str, str], tuple[int, float]] = {}  # async loads ended since (same lock)
        self._async: AsyncLoader | None = None  # started by the first async load
        self.counters = Counters()

    # -- setup ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheEntry], tp_rank: int, pp_rank: int) -> None:
        self._layout = detect_layout(kv_caches, self._num_blocks)
        self._namespace = self._group_namespace or namespace(self._shape)
        self._grid = grid(self._shape)
        self._spans = rank_spans(self._shape, tp_rank, pp_rank)
        self._evented_chain = evented_chain(self._spans)  # whose units carry KV event fields (events.py)
        _check_layout(self._layout, self._spans, tp_rank, pp_rank)
        self._writes = writes_units(self._shape, tp_rank)
        self._store = acquire(self._settings)
        publish_codec = self._settings.publish_codec
        self._writer = BackgroundWriter(
            self._store, self._layout.unit_frames, self.counters, self._settings.max_pending_save_bytes,
            codec_name=publish_codec if self._role.publishes and publish_codec != "store" else None,
        )
        logger.info(
            "ucm-db connector (worker tp=%d pp=%d): store %s, %s, load_mode=%s, namespace %s, heads %d-%d, layers %d-%d%s",
            tp_rank, pp_rank, self._settings.path, self._layout.describe(), self._settings.load_mode, self._namespace.short_id,
            self._spans[0].head_start, self._spans[-1].head_stop - 1, self._spans[0].layer_start, self._spans[0].layer_stop - 1,
            "" if self._writes else " (reads only: another rank writes these heads)",
        )

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches was not called")
        return self._layout

    # -- loads ---------------------------------------------------------------
    def start_load(self, meta: UcmDbConnectorMetadata) -> None:
        self._step = meta.step
        with self._errors_lock:
            self._recent_failed.append(set())
        if meta.epoch != self._epoch:
            self._new_epoch(meta.epoch)
        self._settle_held(meta.held_commits, meta.held_drops)
        if meta.void_saves:
            self._void(meta.void_saves)
        if meta.async_loads:
            if self._async is None:
                self._async = AsyncLoader(lambda load: self._load_checked([load], None, background=True))
            self._async.submit(meta.async_loads)
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
        if job is not None:  # layer mode's thread: beside the model, off its cores where it is bound
            cpu_placement.place_current_thread()
        failed = self._load_checked(loads, job)
        if failed:
            with self._errors_lock:
                self._load_errors.update(failed)
                if self._recent_failed:
                    self._recent_failed[-1].update(failed)

    def _load_checked(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None, *, background: bool = False) -> set[int]:
        """Loads ``loads``; returns the block ids that failed (all of them
        if the load raised: a failed load becomes recompute, not a crash)."""
        try:
            if self._store is None:
                return {b for t in loads for b in t.block_ids}
            return self._load_blocks(loads, job, background)
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("ucm-db: loading KV blocks failed; they will be recomputed")
            return {b for t in loads for b in t.block_ids}
        finally:
            if job is not None:
                job.finish()

    def _load_blocks(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None, background: bool) -> set[int]:
        assert self._store is not None
        started = time.perf_counter()
        # Units go straight into the KV caches where the layout allows
        # (a zstd unit is decompressed into a reused scratch buffer, hot in
        # cache, and copied out to its slabs in one C call: faster than a
        # fresh staging tensor and torch's scatter, `ucm-db bench load`),
        # except for a layer-by-layer load, which hands each layer over as
        # it is scattered.
        in_place = job is None and self.layout.writes_units_in_place
        unit_ids, units, failed = self._read_units(loads, in_place=in_place)
        if failed:
            total = sum(len(t.block_ids) for t in loads)
            logger.warning("ucm-db: %d of %d blocks failed to load (missing or corrupt); vLLM will recompute them", len(failed), total)
        for layer in range(len(self.layout.layers)) if job is not None else (None,):
            if unit_ids and units is not None:
                self.layout.scatter_units(unit_ids, units, layer=layer)
            if job is not None and layer is not None:
                job.ready[layer].set()
        good = len(unit_ids)
        load_s = time.perf_counter() - started
        self.counters.add(loaded_blocks=good, loaded_bytes=good * self.layout.block_bytes, load_s=load_s, load_errors=len(failed))
        self._time_load(good * self._shape.block_size, load_s, background)
        return failed

    def _time_load(self, tokens: int, seconds: float, background: bool = False) -> None:
        """Adds a load to the timings the scheduler gets back (the local
        tier's: a remote block was promoted by the scheduler's lookup before
        it was planned): this step's, or with ``background`` an async one."""
        key = (self._namespace.digest[:16].hex(), "local")
        with self._errors_lock:
            timings = self._background_loads if background else self._step_loads
            have_tokens, have_s = timings.get(key, (0, 0.0))
            timings[key] = (have_tokens + tokens, have_s + seconds)

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose async loads ended since the last call; their
        failed blocks join the load errors :meth:`take_load_errors` reports
        next (vLLM asks for both in the same step, in this order). With
        ``wait_s``, waits that long at most for one (see AsyncLoader)."""
        if self._async is None:
            return set()
        finished, failed = self._async.take_finished(wait_s)
        if failed:
            with self._errors_lock:
                self._load_errors.update(failed)
        return finished

    def take_worker_meta(self) -> UcmDbWorkerMetadata | None:
        """The bound step's number and load timings, once (None if no step
        was bound since the last call); joins a running layer load first."""
        self.finish_loads()
        if self._step < 0:
            return None
        with self._errors_lock:
            loads, self._step_loads = self._step_loads, {}
            background, self._background_loads = self._background_loads, {}
        meta, self._step = UcmDbWorkerMetadata(self._step, loads, background), -1
        return meta

    def _read_units(self, loads: Sequence[BlockTransfer], *, in_place: bool = False) -> tuple[list[int], torch.Tensor | None, set[int]]:
        """Decodes this rank's units of ``loads``: (block ids with every
        unit loaded, their unit staging rows, block ids failed). With
        ``in_place`` the units are decoded straight into the KV caches'
        slabs and no staging comes back (None): nothing is left to scatter.
        A failed block may then hold part of its units; vLLM recomputes it
        (and every block after it) over them."""
        assert self._store is not None
        block_keys = [k for t in loads for k in t.keys]
        block_ids = [b for t in loads for b in t.block_ids]
        if not block_keys:
            return [], None, set()
        spans = self._spans
        keys = unit_keys_of(block_keys, spans, self._grid)
        staging = None if in_place else self.layout.new_unit_staging(len(block_keys))
        if staging is None:
            buffers: list[Any] = self.layout.unit_slabs(block_ids)
        else:
            rows = staging.numpy()
            buffers = [rows[i, j] for i in range(len(block_keys)) for j in range(len(spans))]
        ok = self._store.get_into(self._namespace, keys, buffers)
        per_block = len(spans)
        good = [i for i in range(len(block_keys)) if all(ok[i * per_block : (i + 1) * per_block])]
        failed = set(block_ids) - {block_ids[i] for i in good}
        if staging is not None and len(good) != len(block_keys):
            staging = staging.index_select(0, torch.as_tensor(good, dtype=torch.long))
        return [block_ids[i] for i in good], staging, failed

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def recent_failures(self, also: set[int] | None = None) -> set[int]:
        """Blocks this worker failed to load in its last few steps; ``also``
        (another KV cache group's failures, hybrid.py) joins them first."""
        with self._errors_lock:
            if also and self._recent_failed:
                self._recent_failed[-1].update(also)
            return set().union(*self._recent_failed)

    # -- saves ---------------------------------------------------------------
    def save(self, meta: UcmDbConnectorMetadata) -> None:
        """Copies this step's newly computed blocks out and queues them."""
        self.finish_loads()
        if not meta.saves or not self._writes or self._writer is None or not self._role.saves:
            return
        started = time.perf_counter()
        failed = self.recent_failures()
        self._pending.add(meta.saves)
        while (transfer := self._pending.take()) is not None:
            try:
                self._copy_out(transfer, failed)
            finally:
                self._pending.done(transfer)
        self.counters.add(save_copy_s=time.perf_counter() - started)
        if self._role.publishes:
            # Read-after-write: a producer's blocks are committed (and
            # uploaded, publish="remote") before this step's output leaves.
            self._writer.drain()
            self.counters.add(publish_wait_s=time.perf_counter() - started)

    def _copy_out(self, transfer: BlockTransfer, failed: set[int]) -> None:
        """Copies one save's units out of the KV cache and queues (or holds) them."""
        assert self._writer is not None
        if failed.intersection(transfer.after_loads):
            # Computed over a block this worker failed to load: wrong KV.
            self.counters.add(saves_voided=len(transfer.block_ids))
            return
        staging = self.layout.new_unit_staging(len(transfer.block_ids))
        self.layout.gather_units(transfer.block_ids, staging)
        block_keys = [transfer.parent, *transfer.keys] if transfer.parent is not None else list(transfer.keys)
        start = 1 if transfer.parent is not None else 0
        chains = tuple(UnitKeys(block_keys, self._grid, span, start) for span in self._spans)
        job = SaveJob(self._namespace, chains, staging, transfer.event_fields, self._evented_chain)
        if transfer.hold_id >= 0:
            self._held[transfer.hold_id] = job
        else:
            self._writer.submit(job)

    def handle_preemptions(self, meta: UcmDbConnectorMetadata) -> None:
        """vLLM's hook at the start of each step, before it loads or computes
        anything: no save of a request preempted since reads its freed blocks
        (preemptions.py). Held saves are copies already: they stay."""
        dropped = self._pending.drop(set(meta.preempted))
        if dropped:
            self.counters.add(saves_preempted=dropped)
            logger.info("ucm-db: %d blocks of preempted requests not saved (their blocks were freed)", dropped)

    def _settle_held(self, commits: Sequence[int], drops: Sequence[int]) -> None:
        """Commits or discards held saves, as the scheduler decided (in
        planning order: a request's earlier save goes first)."""
        for hold_id in drops:
            job = self._held.pop(hold_id, None)
            if job is not None:
                self.counters.add(saves_voided=job.blocks)
        for hold_id in sorted(commits):
            job = self._held.pop(hold_id, None)
            if job is not None and self._writer is not None:
                self._writer.submit(job)

    def _new_epoch(self, epoch: int) -> None:
        """The namespace's epoch moved (a reset, or ``ucm-db invalidate``):
        held saves are keyed at the older epoch, which is never served
        again, so they are dropped rather than committed."""
        if self._epoch is not None and self._held:
            self.counters.add(saves_voided=sum(job.blocks for job in self._held.values()))
            logger.info("ucm-db: namespace epoch %d: %d held saves of the older epoch dropped", epoch, len(self._held))
            self._held.clear()
        self._epoch = epoch

    def _void(self, transfers: Sequence[BlockTransfer]) -> None:
        """Deletes this rank's units of saves that another rank's failed
        load made wrong (metadata.py), behind every save queued before."""
        if not self._writes or self._writer is None or not self._role.saves:
            return
        for transfer in transfers:
            keys = list(transfer.keys)
            chains = tuple(UnitKeys(keys, self._grid, span) for span in self._spans)
            self._writer.void(VoidJob(self._namespace, chains, len(keys)))

    def drain(self) -> None:
        """Waits until every queued save is committed (tests, benchmarks)."""
        if self._writer is not None:
            self._writer.drain()

    def shutdown(self) -> None:
        self.finish_loads()
        if self._held:  # their verdict never came: nothing unconfirmed is committed
            logger.info("ucm-db: %d held saves dropped at shutdown (no verdict from the scheduler)", len(self._held))
            self._held.clear()
        if self._async is not None:
            self._async.close()
            self._async = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._store is not None:
            release(self._store)
            self._store = None


def _check_layout(layout: KVLayout, spans: Sequence[object], tp_rank: int, pp_rank: int) -> None:
    """Refuses KV caches that do not hold the heads and layers the
    deployment's shape gives this rank (the units would be wrong)."""
    first = spans[0]
    layers = first.layer_stop - first.layer_start  # type: ignore[attr-defined]
    if layout.heads != len(spans) or len(layout.layers) != layers:
        raise ConfigError(
            f"worker tp={tp_rank} pp={pp_rank} registered KV caches with {layout.heads} KV heads and "
            f"{len(layout.layers)} layers; the model's config gives this rank {len(spans)} heads and {layers} layers",
            hint="report this model to ucm-db (its KV cache layout is not what its config says)",
        )
