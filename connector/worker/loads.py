"""A worker's loads: blocks read from the store into the paged KV cache.

Invariants:
    * Loads of a step finish within the step: in ``block`` mode before the
      forward (``start_load_kv``); in ``layer`` mode a background thread
      decodes every block, then fills layer after layer, and each attention
      layer waits only for its own layer (``wait_for_layer_load``; KV caches
      on an accelerator: every layer once the load is done,
      :mod:`~ucm_db.connector.worker.device_loads`). Either
      way the loader is joined before the step's load errors are reported.
      In ``async`` mode a request's hit loads beside later steps
      (:mod:`ucm_db.connector.worker.async_loads`) and the request is reported by
      :meth:`WorkerLoads.finished_loads` once its blocks are filled, with
      its failed blocks in the same step's load errors (or, through
      :meth:`WorkerLoads.finished_requests`, with the requests that failed
      instead: a hybrid model's, hybrid.py).
    * On an accelerator, a load's writes into the KV caches wait for the
      model stream's mark made when its step handed it over (an async load:
      the latest step's), and a load is reported only once they are done.
    * A block that fails to load (missing, corrupt: the store verifies every
      payload) is reported by :meth:`WorkerLoads.take_load_errors` so vLLM
      recomputes it; no unverified byte reaches the KV cache. A block loads
      only if all of this rank's units of it do. Every failed block counts in
      ``load_errors`` (a load that raised: all of its blocks); the warning is
      logged at most once a minute (a store that fails every read fails every step).
      The step's ``stale_reads`` (blocks the scheduler found stale and read
      by a request of the step) are reported with them, and counted in neither.
    * The blocks this worker failed to load in its last
      :data:`FAILED_STEPS_KEPT` steps stay known (:meth:`WorkerLoads.recent_failures`):
      a save computed over one is dropped (worker.py); a block id a later
      synchronous load filled right (vLLM gave it to another request)
      leaves them, or that request's right saves were dropped on this rank
      alone (a review found a TP=2 block stored for one KV head only).
    * Each step's loads are timed (wall time of the read and the copy into
      the KV caches) and handed back once, with the step's number, by
      :meth:`WorkerLoads.take_worker_meta`: the scheduler's cost model
      learns the local tier's load rate from them (cost_model.py). Async
      loads are handed back apart (``background_loads``): they ran beside
      the steps, not inside them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db import cpu_placement
from ucm_db.connector.worker.async_loads import AsyncLoader
from ucm_db.connector.worker.device_loads import DeviceLoads
from ucm_db.connector.worker.split_reads import SplitReads, auto_load_threads, local_workers
from ucm_db.connector.layouts import KVLayout
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata
from ucm_db.connector.metrics import Counters, LogLimit
from ucm_db.keys.units import KVGrid, UnitSpan, unit_keys_of

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
#: Steps whose failed loads a worker keeps: saves of a step planned before
#: the previous steps' outputs were back may be computed over them.
FAILED_STEPS_KEPT = 4


class _LayerLoad:
    """A load running in a background thread, layer by layer."""

    def __init__(self, num_layers: int) -> None:
        self.ready = [threading.Event() for _ in range(num_layers)]
        self.thread: threading.Thread | None = None

    def finish(self) -> None:
        for event in self.ready:
            event.set()


class WorkerLoads:
    """The loads of one worker (module invariants); bound to its store and
    KV caches by :meth:`bind` (until then every load fails)."""

    def __init__(self, load_mode: str, block_size: int, counters: Counters, load_threads: int | str = 1) -> None:
        self._load_mode = load_mode
        self._load_threads = load_threads
        self._reads = SplitReads(1)  # sized at bind, by the layout (split_reads.py)
        self._device: DeviceLoads | None = None  # KV caches on an accelerator (device_loads.py), made at the first load
        self._handed_over: torch.Event | None = None  # the model stream's mark at the last step's hand-over (layouts.mark)
        self._block_size = block_size
        self.counters = counters
        self._store: ucm_db.Store | None = None
        self._layout: KVLayout | None = None
        self._load_errors: set[int] = set()
        # Blocks the last few steps' own loads failed (under _errors_lock): a
        # step may be planned before the last one's output is back.
        self._recent_failed: deque[set[int]] = deque(maxlen=FAILED_STEPS_KEPT)
        self._errors_lock = threading.Lock()
        self._layer_load: _LayerLoad | None = None
        self._step = -1  # the step whose metadata was bound last
        self._step_loads: dict[tuple[str, str], tuple[int, float]] = {}  # its load timings (under _errors_lock)
        self._background_loads: dict[tuple[str, str], tuple[int, float]] = {}  # async loads ended since (same lock)
        self._async: AsyncLoader | None = None  # started by the first async load
        self._fault_log, self._miss_log = LogLimit(), LogLimit()  # loads that raised / missed blocks: a line a minute each

    def bind(self, store: ucm_db.Store, layout: KVLayout, namespace: ucm_db.Namespace, grid: KVGrid, spans: Sequence[UnitSpan],
             ranks: int = 1) -> None:
        """Loads go to ``store`` and ``layout`` from now on; ``ranks``: the
        engine's TP x PP ranks (``load_threads: "auto"`` shares the node's CPUs among those on it)."""
        self._store, self._layout, self._namespace, self._grid, self._spans = store, layout, namespace, grid, list(spans)
        self._device = None
        threads = self._load_threads
        if threads == "auto":
            on_accelerator = layout.device.type != "cpu"
            threads = auto_load_threads(on_accelerator, layout.unit_bytes, workers=local_workers(ranks) if on_accelerator else 1)
        assert isinstance(threads, int)
        if threads != self._reads.threads:
            self._reads.close()
            self._reads = SplitReads(threads)

    def unbind(self) -> None:
        """Every later load fails and is reported (vLLM recomputes it)."""
        self._store = None

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches was not called")
        return self._layout

    def start(self, meta: UcmDbConnectorMetadata) -> None:
        """Binds the step and starts its loads (and submits its async loads)."""
        self._step = meta.step
        with self._errors_lock:
            self._recent_failed.append(set())
            self._load_errors.update(meta.stale_reads)  # stale KV a request of the step reads (scheduler/stale_blocks.py)
        if (meta.async_loads or meta.loads) and self._layout is not None:
            # Another thread's writes into the KV caches wait for what the model's stream holds now (layouts.mark).
            self._handed_over = self._layout.mark()
        if meta.async_loads:
            if self._async is None:
                # An async load waits for the latest mark: at least its own step's, never an earlier one.
                self._async = AsyncLoader(lambda load: self._load_checked([load], None, background=True, after=self._handed_over))
            self._async.submit(meta.async_loads)
        if not meta.loads:
            return
        if self._load_mode == "layer" and self._store is not None:  # unbound: every load fails below, reported
            job = _LayerLoad(len(self.layout.layers))
            job.thread = threading.Thread(target=self._load, args=(meta.loads, job, self._handed_over), name="ucm-db-loader", daemon=True)
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

    def _load(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None, after: torch.Event | None = None) -> None:
        if job is not None:  # layer mode's thread: beside the model, off its cores where it is bound
            cpu_placement.place_current_thread()
        failed = self._load_checked(loads, job, after=after)
        with self._errors_lock:
            self._load_errors.update(failed)
            if any(self._recent_failed):  # a block written right again (another request's now) is no longer failed
                loaded = {b for t in loads for b in t.block_ids}.difference(failed)
                for recent in self._recent_failed:
                    recent.difference_update(loaded)
            if self._recent_failed:
                self._recent_failed[-1].update(failed)

    def _load_checked(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None, *, background: bool = False,
                      after: torch.Event | None = None) -> set[int]:
        """Loads ``loads``; returns the block ids that failed (all of them
        if the load raised: a failed load becomes recompute, not a crash).
        ``after``: the mark the KV caches' writes wait for (layouts.mark)."""
        try:
            if self._store is None:
                return {b for t in loads for b in t.block_ids}
            if self.layout.device.type != "cpu":
                return self._load_on_device(loads, job, background, after)
            return self._load_blocks(loads, job, background)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            failed = {b for t in loads for b in t.block_ids}
            self.counters.add(load_errors=len(failed))
            held = self._fault_log.due()
            if held is not None:
                logger.error("ucm-db: loading KV blocks failed; they will be recomputed (%d blocks, counted in load_errors; "
                             "%d more failed loads since the last such line, at most one a minute): %s", len(failed), held, exc,
                             exc_info=exc)
            return failed
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
        for layer in range(len(self.layout.layers)) if job is not None else (None,):
            if unit_ids and units is not None:
                self.layout.scatter_units(unit_ids, units, layer=layer)
            if job is not None and layer is not None:
                job.ready[layer].set()
        self._count_load(len(unit_ids), failed, started, background)
        return failed

    def _load_on_device(self, loads: Sequence[BlockTransfer], job: _LayerLoad | None, background: bool,
                        after: torch.Event | None) -> set[int]:
        """A load into KV caches on an accelerator: chunk by chunk through
        pinned staging (device_loads.py); a layer-mode load hands every
        layer over at its end."""
        assert self._store is not None
        started = time.perf_counter()
        block_keys = [k for t in loads for k in t.keys]
        block_ids = [b for t in loads for b in t.block_ids]
        touch = not all(t.touched for t in loads)
        store, unit_bytes = self._store, self.layout.unit_bytes

        def read(keys: Sequence[bytes], rows: memoryview) -> list[bool]:
            return self._reads.get_into(store, self._namespace, keys, rows, unit_bytes, touch=touch)

        if self._device is None:
            self._device = DeviceLoads(self.layout)
        loaded, failed = self._device.load(read, unit_keys_of(block_keys, self._spans, self._grid), block_ids, after) if block_keys else ([], set())
        if job is not None:
            for ready in job.ready:
                ready.set()
        self._count_load(len(loaded), failed, started, background)
        return failed

    def _count_load(self, good: int, failed: set[int], started: float, background: bool) -> None:
        held = self._miss_log.due() if failed else None
        if held is not None:
            logger.warning("ucm-db: %d of %d blocks failed to load (missing or corrupt); vLLM will recompute them (counted "
                           "in load_errors; %d more such loads since the last line, at most one a minute)",
                           len(failed), good + len(failed), held)
        load_s = time.perf_counter() - started
        self.counters.add(loaded_blocks=good, loaded_bytes=good * self.layout.block_bytes, load_s=load_s, load_errors=len(failed))
        self.counters.observe("load", load_s)
        self._time_load(good * self._block_size, load_s, background)

    def _time_load(self, tokens: int, seconds: float, background: bool = False) -> None:
        """Adds a load to the timings the scheduler gets back (the local
        tier's: a remote block was promoted by the scheduler's lookup before
        it was planned): this step's, or with ``background`` an async one."""
        key = (self._namespace.id.hex(), "local")
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

    def finished_requests(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose async loads ended since the last call, and those
        of them with a failed block, reported per request: their block ids
        are not load errors (a hybrid model's, hybrid.py). ``wait_s`` as
        :meth:`finished_loads`."""
        if self._async is None:
            return set(), set()
        return self._async.take_finished_requests(wait_s)

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
        # Units the scheduler touched when it planned them are read without
        # touching: this process writes no recency (PrefixLookup.touch).
        touch = not all(t.touched for t in loads)
        if staging is None:
            ok = self._store.get_into(self._namespace, keys, self.layout.unit_slabs(block_ids), touch=touch)
        else:  # unit i into row i (block-major, as the keys), filling it exactly (ScatterSlabs' invariants)
            rows = staging.numpy()
            ok = self._reads.get_into(self._store, self._namespace, keys, memoryview(rows.reshape(-1)), rows.shape[2], touch=touch)
        if all(ok):  # the common case, without a pass per block
            return block_ids, staging, set()
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

    def close(self) -> None:
        """Joins a running layer load and stops the async loader."""
        self.finish_loads()
        if self._async is not None:
            self._async.close()
            self._async = None
        self._reads.close()
