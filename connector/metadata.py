"""Scheduler -> worker metadata of one engine step.

Invariants:
    * A :class:`BlockTransfer` names consecutive blocks of one request's key
      chain (block keys, the same for every rank: each worker derives the
      keys of its own units from them, see :mod:`ucm_db.keys.units`):
      ``keys[i]`` belongs in vLLM block ``block_ids[i]``, and ``parent`` is
      the block key just before ``keys[0]`` (None at the chain's start), so
      each unit chain of a save is a valid ``Store.put`` segment.
    * A load reads the blocks' units: the one storage generation the
      connector reads (older ones are converted by ``ucm-db migrate``,
      :mod:`ucm_db.maintenance.pre_units`).
    * ``loads`` complete (or are reported failed) within their step;
      ``async_loads`` (``load_mode: "async"``, one transfer per request,
      whose blocks vLLM holds for it) complete in a later step, which
      reports the request finished; saves are copied out of the KV caches
      within their step. ``idle``: the step schedules no tokens (a worker
      may wait a little for async loads instead of letting the engine spin).
    * A save's ``after_loads`` names the blocks loaded (synchronously) by
      this step or by earlier steps whose output is not back yet that its
      blocks' KV is computed over: vLLM runs a step's forward pass before it
      learns that a load failed, so the KV computed after a failed block is
      wrong. A worker drops a save over a block it failed to load in its
      last few steps (the scheduler, told of the failure by the step's
      output, rewinds the save's request, settlement.py). With several
      ranks (each sees only its own failures) such a save is held
      (``hold_id``): the worker keeps the copied-out units and commits
      them only when a later step's ``held_commits``
      names it, or discards them (``held_drops``), once every rank's output
      for the steps it depends on is back. So no rank commits KV computed
      over a failed load. A ``kv_producer`` commits within the step: its
      saves are not held, and one another rank's failure made wrong comes
      back in ``void_saves``: every worker deletes the units its writer
      stored for it (behind its earlier saves, so the delete follows the
      commit; never units stored before it, connector/worker/voids.py).
    * ``stale_reads`` names the blocks of vLLM's KV cache still stale after
      a failed load that a request of the step reads: every worker reports
      them as failed loads, so vLLM rewinds that request and skips its
      output of the step, whose saves are not planned
      (connector/scheduler/stale_blocks.py).
    * ``preempted`` names the requests vLLM preempted since the last step
      (its blocks freed): a worker's ``handle_preemptions`` drops their saves
      not yet copied out (connector/worker/preemptions.py); the scheduler rewinds
      them to the blocks known stored, so what they compute again is saved.
    * ``epoch``: the namespace epoch (connector/epochs.py) the scheduler's
      keys are rooted at when it built the step; a worker that sees it move
      drops the saves it holds (keyed at the older epoch: never served).
    * ``groups``: for a model with several KV cache groups (hybrid.py), each
      group's own metadata, in vLLM's group order; the top level then holds
      only the step's number, ``idle``, ``epoch`` and ``preempted``.
    * Only plain values: vLLM ships this object to worker processes.
    * Every step's metadata carries the scheduler's ``step`` number; a
      worker echoes it in its :class:`UcmDbWorkerMetadata` with the step's
      load timings, so the scheduler's cost model pairs each step's round
      trip with its own loads (cost_model.py), whatever the order outputs
      arrive in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ucm_db import BlockEventFields

#: Longest a step that schedules no tokens waits for background work (an
#: async load in ``get_finished``, a background remote lookup in the
#: scheduler's lookup): the engine would otherwise spin through empty
#: steps, taking the CPU that work needs.
IDLE_WAIT_S = 0.01


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to load or save this step."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes | None = None
    after_loads: tuple[int, ...] = ()  # a save: loaded blocks (of unsettled steps) its KV was computed over
    hold_id: int = -1  # a save: >= 0 if workers keep it until the scheduler's verdict
    voidable: bool = False  # a save committed at once that the scheduler may void a step later (voids.py)
    event_fields: tuple[BlockEventFields, ...] = ()  # a save: vLLM's KV event fields per block, or () (events.py)
    touched: bool = False  # a load: the scheduler touched its units (Store.touch), so workers read with touch=False
    adapter: tuple[int, str] | tuple[()] = ()  # a LoRA request's save: (lora_int_id, its chain's adapter key) (lora_loads.py)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} block ids")
        if self.event_fields and len(self.event_fields) != len(self.block_ids):
            raise ValueError(f"{len(self.event_fields)} event fields for {len(self.block_ids)} blocks")


@dataclass
class UcmDbConnectorMetadata(KVConnectorMetadata):
    """All loads and saves of one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    step: int = -1  # the scheduler's step number (-1: not numbered)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    idle: bool = False  # no tokens scheduled this step
    void_saves: list[BlockTransfer] = field(default_factory=list)  # committed saves computed over a failed load
    held_commits: list[int] = field(default_factory=list)  # hold ids to commit now
    held_drops: list[int] = field(default_factory=list)  # hold ids to discard
    epoch: int = 0  # the namespace epoch the step's keys are rooted at (-1: unreadable; connector/epochs.py)
    preempted: tuple[str, ...] = ()  # requests preempted since the last step: their blocks are freed (preemptions.py)
    groups: list[UcmDbConnectorMetadata] = field(default_factory=list)  # a hybrid model's, one per KV cache group (hybrid.py)
    namespace: bytes = b""  # the scheduler's namespace id: a worker of another namespace neither loads nor saves
    namespace_inputs: str = ""  # its inputs (identity.namespace_inputs): a worker may adopt them (schedulers_namespace)
    unloadable: tuple[str, ...] = ()  # requests whose claimed load has no transfer: reported failed (recomputed)
    stale_reads: tuple[int, ...] = ()  # stale blocks a request of the step reads: reported as invalid (stale_blocks.py)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.async_loads or self.void_saves or self.held_commits or self.held_drops
                    or self.stale_reads
                    or any(not group.empty for group in self.groups))


@dataclass
class UcmDbWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what one step's loads cost.

    ``loads`` maps ``(namespace id, tier)`` to ``(tokens loaded, seconds)``
    of the step's own loads; ``background_loads`` the same for async loads
    that ended since the last report (they ran beside the steps, so they are
    no part of a step's time). Ranks load their own heads of the same blocks
    in parallel, so the aggregate over ranks keeps the most tokens and the
    longest time.
    """

    step: int = -1
    loads: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    background_loads: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    refused: bool = False  # a worker refused the scheduler's namespace: the scheduler claims and saves nothing more

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, UcmDbWorkerMetadata):
            self.step = max(self.step, other.step)
            self.refused = self.refused or other.refused
            _merge_max(self.loads, other.loads)
            _merge_max(self.background_loads, other.background_loads)
        return self


def _merge_max(into: dict[tuple[str, str], tuple[int, float]], other: dict[tuple[str, str], tuple[int, float]]) -> None:
    for key, (tokens, seconds) in other.items():
        have_tokens, have_s = into.get(key, (0, 0.0))
        into[key] = (max(have_tokens, tokens), max(have_s, seconds))
