"""Worker side of the connector: saves out of the paged KV cache, and the
step's loads into it (delegated to :mod:`ucm_db.connector.worker.loads`).

Invariants:
    * Loads (:mod:`ucm_db.connector.worker.loads`) finish within their step
      (``block`` and ``layer`` modes) or beside later steps (``async``); a
      block that fails to load is reported so vLLM recomputes it, and no
      unverified byte reaches the KV cache.
    * Saves copy blocks out of the KV cache in ``wait_for_save`` (the
      blocks may be reused by the next step; beside an accelerator the copy
      is queued on a save stream that vLLM's stream waits for on the device,
      :mod:`~ucm_db.connector.device_saves`) and leave encoding and commit
      to the :class:`~ucm_db.connector.worker.writer.BackgroundWriter`, in staging
      reused across saves (:mod:`~ucm_db.connector.worker.staging`). A save whose
      ``after_loads`` include a block this worker failed to load in its
      last few steps is dropped (its KV attended to a stale slot); a held
      save waits for the scheduler's verdict (metadata.py), and of the saves
      a step's metadata voids (a producer's, after another rank's failure)
      the units this worker's writer stored are deleted behind every queued
      save, never units stored before them (:mod:`~ucm_db.connector.worker.voids`).
    * A save's blocks are read only while its request holds them: saves go
      through :class:`~ucm_db.connector.worker.preemptions.PendingSaves`, and
      :meth:`UcmDbWorker.handle_preemptions` (vLLM's hook at the start of
      each step) drops those of preempted requests not yet copied and waits
      for their copies in flight (counted as ``saves_preempted``).
    * A worker reads and writes the units of its own KV heads and pipeline
      stage (:func:`~ucm_db.connector.identity.rank_spans`), whatever TP size
      wrote them; a block loads only if all its units do. Each head has one
      writer rank (replicated GQA heads: the first rank holding it; MLA: TP
      rank 0); every rank loads.
    * A worker starts only on KV caches laid out as its namespace says
      (kind, a head's block, head slots: :mod:`~ucm_db.connector.layout_views`).
    * Only units are read and written (one storage generation; the
      scheduler refuses a store holding older ones, :mod:`ucm_db.maintenance.pre_units`).
    * ``save_process`` (resolved by :func:`_commits_in_child`): a rank that writes starts a commit process
      (:mod:`ucm_db.committer`) and stages its saves in buffers shared with
      it; one that cannot start logs why and commits in-process, as without.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db import cpu_placement
from ucm_db.connector import lora_loads
from ucm_db.committer import CommitProcess
from ucm_db.connector.drafts import is_draft_layer
from ucm_db.connector.events import evented_chain
from ucm_db.connector.identity import KVShape, grid, namespace, rank_spans, schedulers_namespace, writes_units
from ucm_db.connector.layout_views import named_view, refuse_other_view
from ucm_db.connector.layouts import KVCacheEntry, KVLayout, detect_layout
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import Counters
from ucm_db.connector.worker.preemptions import PendingSaves
from ucm_db.connector.roles import RolePolicy
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.worker.staging import StagingPool
from ucm_db.connector.stores import acquire, acquire_committer, release
from ucm_db.connector.worker.loads import WorkerLoads
from ucm_db.connector.worker.voids import VoidJob, VoidTag, save_id
from ucm_db.connector.worker.writer import BackgroundWriter, SaveJob
from ucm_db.errors import CommitProcessError, ConfigError
from ucm_db.keys.units import UnitKeys

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_MAX_FREE_STAGING_BYTES = 256 << 20  # idle save staging kept for reuse (staging.py)


class UcmDbWorker:
    """Worker-side half of :class:`~ucm_db.connector.UcmDbConnector`."""

    def __init__(self, settings: ConnectorSettings, shape: KVShape, num_blocks: int | None, role: RolePolicy = RolePolicy(),
                 group_namespace: ucm_db.Namespace | None = None) -> None:
        self._settings = settings
        self._group_namespace = group_namespace  # a hybrid model's KV cache group's (hybrid.py)
        self._role = role  # a kv_consumer never saves; a kv_producer commits within the step
        self._shape = shape
        self._ranks = shape.tp_size * shape.pp_size  # the engine's TP x PP workers (load_threads "auto")
        self._num_blocks = num_blocks
        self._layout: KVLayout | None = None
        self._store: ucm_db.Store | None = None
        self._writer: BackgroundWriter | None = None
        self._held: dict[int, SaveJob] = {}  # saves kept until the scheduler's verdict (metadata.py)
        self._epoch: int | None = None  # the namespace epoch of the last bound step (connector/epochs.py)
        self._steps = 0  # steps bound: the clock of voidable saves' records (voids.py)
        self.refused = False  # the scheduler's namespace is not this worker's (_agree): nothing loaded or saved
        self._pending = PendingSaves()  # saves whose blocks are not copied out yet (preemptions.py)
        self.counters = Counters()
        self._loads = WorkerLoads(settings.load_mode, shape.block_size, self.counters, settings.load_threads)  # worker_loads.py

    # -- setup ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheEntry], tp_rank: int, pp_rank: int) -> None:
        if self._group_namespace is None and not self._shape.draft_layers:  # a hybrid's groups: by their facade
            kv_caches = _without_draft_layers(kv_caches, self._shape.layers)
        self._layout = detect_layout(kv_caches, self._num_blocks)
        self._namespace = self._group_namespace or namespace(self._shape)
        self._grid = grid(self._shape)
        self._spans = rank_spans(self._shape, tp_rank, pp_rank)
        self._evented_chain = evented_chain(self._spans)  # whose units carry KV event fields (events.py)
        _check_layout(self._layout, self._spans, tp_rank, pp_rank)
        # The bytes a unit holds are the namespace's view of the KV, never another (layout_views.py).
        refuse_other_view(self._layout, named_view(self._shape, self._namespace, len(self._spans)), f"worker tp={tp_rank} pp={pp_rank}")
        self._writes = writes_units(self._shape, tp_rank)
        self._store = acquire(self._settings)
        self._loads.bind(self._store, self._layout, self._namespace, self._grid, self._spans, self._ranks)
        publish_codec = self._settings.publish_codec
        committer = _start_committer(self._settings) if _commits_in_child(self._settings.save_process) and self._writes else None
        new_staging = self._layout.new_unit_staging if committer is None else _shared_staging(committer, self._layout)
        self._staging = StagingPool(new_staging, min(self._settings.max_pending_save_bytes, _MAX_FREE_STAGING_BYTES))
        self._writer = BackgroundWriter(
            self._store, self._layout.unit_frames, self.counters, self._settings.max_pending_save_bytes,
            codec_name=publish_codec if self._role.publishes and publish_codec != "store" else None,
            committer=committer, frame_bytes=self._layout.unit_layer_bytes,
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

    # -- loads (worker_loads.py) -----------------------------------------------
    def start_load(self, meta: UcmDbConnectorMetadata) -> None:
        """Binds the step: its epoch, the held saves' verdicts and voided
        saves it carries, then its loads."""
        self._steps += 1
        if meta.namespace and meta.namespace != self._namespace.id and self._store is not None and not self.refused:
            self._agree(meta.namespace, meta.namespace_inputs)
        if meta.epoch != self._epoch:
            self._new_epoch(meta.epoch)
        self._settle_held(meta.held_commits, meta.held_drops)
        if meta.void_saves:
            self._void(meta.void_saves)
        self._loads.start(meta)

    def wait_for_layer(self, layer_name: str) -> None:
        self._loads.wait_for_layer(layer_name)

    def finish_loads(self) -> None:
        self._loads.finish_loads()

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose async loads ended since the last call (WorkerLoads.finished_loads)."""
        return self._loads.finished_loads(wait_s)

    def finished_requests(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose async loads ended, and the failed ones among them (WorkerLoads.finished_requests)."""
        return self._loads.finished_requests(wait_s)

    def take_worker_meta(self) -> UcmDbWorkerMetadata | None:
        """The bound step's number and load timings, once (WorkerLoads.take_worker_meta),
        and whether this worker refused the scheduler's namespace."""
        meta = self._loads.take_worker_meta()
        if meta is not None and self.refused:
            meta.refused = True
        return meta

    def take_load_errors(self) -> set[int]:
        return self._loads.take_load_errors()

    def recent_failures(self, also: set[int] | None = None) -> set[int]:
        """Blocks this worker failed to load in its last few steps; ``also``
        (another KV cache group's failures, hybrid.py) joins them first."""
        return self._loads.recent_failures(also)

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
        if transfer.adapter and not lora_loads.computed_with(*transfer.adapter):
            self.counters.add(save_errors=len(transfer.block_ids))  # computed with other adapter files than keyed
            return
        if failed.intersection(transfer.after_loads):
            # Computed over a block this worker failed to load: wrong KV.
            self.counters.add(saves_voided=len(transfer.block_ids))
            return
        lease = self._staging.take(len(transfer.block_ids))
        try:
            copy = self.layout.gather_units_async(transfer.block_ids, lease.staging)
        except RuntimeError as exc:  # the device's memory or copy: this save is lost, never the engine's step
            lease.release()
            self.counters.add(save_errors=len(transfer.block_ids))
            logger.warning("ucm-db: copying %d blocks out of the KV cache failed; they are not saved: %s", len(transfer.block_ids), exc)
            return
        block_keys = [transfer.parent, *transfer.keys] if transfer.parent is not None else list(transfer.keys)
        start = 1 if transfer.parent is not None else 0
        chains = tuple(UnitKeys(block_keys, self._grid, span, start) for span in self._spans)
        voidable = transfer.voidable  # committed at once over another rank's or connector's loads (voids.py)
        job = SaveJob(self._namespace, chains, lease.staging, transfer.event_fields, self._evented_chain, lease.release,
                      lease.held_bytes, copy, VoidTag(save_id(transfer), self._steps) if voidable else None)
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
                job.done()
        for hold_id in sorted(commits):
            job = self._held.pop(hold_id, None)
            if job is not None and self._writer is not None:
                self._writer.submit(job)

    def _agree(self, scheduler_id: bytes, scheduler_inputs: str) -> None:
        """The scheduler keys requests under another namespace than this
        worker derived. Where only inputs read from the config object differ
        (identity.schedulers_namespace), the worker takes the scheduler's;
        otherwise (other model files, layout or local files: other KV) it
        stops loading (every load fails: vLLM recomputes) and saving, for
        good, and tells the scheduler (:attr:`refused`, worker metadata)."""
        ours = self._namespace
        theirs = schedulers_namespace(ours, self._shape.extra, scheduler_id, scheduler_inputs)
        if theirs is not None:
            logger.warning("ucm-db: this worker's namespace inputs %s differ from the scheduler's %s only where a model "
                           "constructor changes the config object (or this node lacks the config's files): the "
                           "scheduler's are used", self._shape.extra, scheduler_inputs)
            self._namespace = theirs
            self._loads.bind(self._store, self.layout, theirs, self._grid, self._spans, self._ranks)  # type: ignore[arg-type]
            return
        logger.error("ucm-db: the scheduler's namespace %s (inputs %s) is not this worker's %s (inputs %s, model %s): "
                     "this worker computes other KV; it loads and saves nothing until a restart", scheduler_id.hex()[:12],
                     scheduler_inputs, ours.id.hex()[:12], self._shape.extra, ours.model)
        self.refused = True
        self._loads.unbind()
        self._writes = False

    def _new_epoch(self, epoch: int) -> None:
        """The namespace's epoch moved (a reset, or ``ucm-db invalidate``):
        held saves are keyed at the older epoch, which is never served
        again, so they are dropped rather than committed."""
        if self._epoch is not None and self._held:
            self.counters.add(saves_voided=sum(job.blocks for job in self._held.values()))
            logger.info("ucm-db: namespace epoch %d: %d held saves of the older epoch dropped", epoch, len(self._held))
            self._drop_held()
        self._epoch = epoch

    def _drop_held(self) -> None:
        for job in self._held.values():
            job.done()
        self._held.clear()

    def _void(self, transfers: Sequence[BlockTransfer]) -> None:
        """Deletes the units this rank's writer stored for saves that another
        rank's failed load made wrong (metadata.py), behind every save queued
        before (voids.py: never units stored before those saves)."""
        if not self._writes or self._writer is None or not self._role.saves:
            return
        for transfer in transfers:
            self._writer.void(VoidJob(self._namespace, save_id(transfer), len(transfer.keys), self._steps))

    def drain(self) -> None:
        """Waits until every queued save is committed (tests, benchmarks)."""
        if self._writer is not None:
            self._writer.drain()

    def shutdown(self) -> None:
        self.finish_loads()
        if self._held:  # their verdict never came: nothing unconfirmed is committed
            logger.info("ucm-db: %d held saves dropped at shutdown (no verdict from the scheduler)", len(self._held))
            self._drop_held()
        self._loads.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._store is not None:
            release(self._store)
            self._store = None


def _commits_in_child(save_process: bool | str) -> bool:
    """``save_process`` resolved: ``"auto"`` is on where the model thread is
    bound and background cores are named (settings.py)."""
    if save_process == "auto":
        return bool(cpu_placement.background_cpus())
    return bool(save_process)


def _start_committer(settings: ConnectorSettings) -> CommitProcess | None:
    """The commit process for this worker's saves, shared with the other
    worker halves over the same store (a hybrid model's groups); None
    (logged) if it cannot start."""
    try:
        committer = acquire_committer(settings)
    except (CommitProcessError, ConfigError) as exc:
        logger.warning("ucm-db: save_process: %s; saves commit in the worker process", exc)
        return None
    logger.info("ucm-db: saves commit in process %d (save_process)", committer.pid)
    return committer


def _shared_staging(committer: CommitProcess, layout: KVLayout) -> Callable[[int], torch.Tensor]:
    """``new_unit_staging`` in buffers the commit process maps; plain
    memory once it is gone (those saves commit in the worker)."""
    def new_staging(num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, layout.heads, layout.unit_bytes)
        if committer.alive:
            try:
                buffer = committer.share(num_blocks * layout.heads * layout.unit_bytes)
                return torch.frombuffer(buffer.memory, dtype=torch.uint8).view(shape)
            except CommitProcessError:
                pass  # the writer logs it at its next commit
        return layout.new_unit_staging(num_blocks)
    return new_staging


def _without_draft_layers(kv_caches: Mapping[str, KVCacheEntry], model_layers: int) -> Mapping[str, KVCacheEntry]:
    """The KV caches of the model's ``model_layers`` layers: a
    speculative-decoding draft's that are not stored with them
    (:mod:`ucm_db.connector.drafts`) are left out, with one warning."""
    draft = [name for name in kv_caches if is_draft_layer(name, model_layers)]
    if not draft:
        return kv_caches
    logger.warning("ucm-db: %d KV cache layers of a speculative-decoding draft (%s) are not stored or loaded (another KV "
                   "spec than the model's, several pipeline stages or a hybrid model): over a hit the drafter attends to "
                   "KV it did not compute there, so fewer drafts are accepted",
                   len(draft), ", ".join(draft[:4]) + (" ..." if len(draft) > 4 else ""))
    left_out = set(draft)
    return {name: entry for name, entry in kv_caches.items() if name not in left_out}


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
