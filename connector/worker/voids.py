"""Voids: the writer deletes what it stored for saves a later step found wrong.

A ``kv_producer`` commits a save over a load within its step (roles.py); if
a load that save's KV depends on failed (on another rank, or in another
connector), the scheduler voids the save a step later (``void_saves``,
metadata.py, settlement.py). The store's put is first-writer-wins: a unit
stored already (another engine's right KV, or ours from an earlier right
computation) is not written again, so deleting the save's keys would take
blocks it never wrote, and their descendants (an audit's lost saves). A void
deletes the units the writer stored for that save, nothing else.

With a remote (``publish: "remote"`` writes through; a write-back queue may
have sent them too) the units were uploaded before their void: the delete
takes their remote objects too, and they are never read back from the
remote on this node (``Store.delete``: ucm_db/index/retractions.py). Without
that, the next lookup of the prompt promoted the wrong units back, the
recomputed right ones were "already present", and every node of the remote
was served the voided KV (tests/connector/test_void_retracts_remote.py).

Invariants:
    * A save that may be voided (``BlockTransfer.voidable``: committed at
      once over another rank's or another connector's loads; it carries a
      :class:`VoidTag`) leaves, once its writer round is done, a record of
      the first unit its round stored for it in each of its unit chains
      (``PutResult.stored_keys``), kept per save: a unit another save of
      the round named too is that save's where it came first in the batch
      (the saves no void can take come first: :func:`batch_order`), so a
      void never deletes another save's units (a review found a producer's
      void deleting, with its own, another request's units of the same
      blocks). A chain's stored units are a suffix of
      it (a stored unit's parent is stored: the prefix invariant), so that
      unit and its descendants are all it stored; its void deletes them,
      with any descendant stored since (the prefix invariant needs that too).
    * A put that raised after perhaps committing (a write-through upload
      failed, a commit process lost mid-request: anything but a missing
      parent or a full store, which write nothing) counts as having stored
      every unit it named: wrong KV left stored is worse than a lost save.
    * A save that stored nothing (dropped, its copy failed, refused, every
      unit stored already) leaves no record, and its void deletes nothing.
    * A void's delete is ``Store.delete``: with a remote, it records a
      retraction of every unit it removes (descendants too) in its local
      transaction and deletes their remote objects before it returns,
      children first, within ten lookup deadlines; what fails is retried by
      the uploader, and the units are never promoted back meanwhile. Readers
      of the remote in the step before the void (other nodes) may have
      taken copies: the same window as the local tier's.
    * A void whose delete fails (an I/O error; a full disk: an LMDB delete
      needs pages) is kept, with its units, and retried before every later
      writer round and void, oldest first, until it succeeds: none is given
      up (each is a few keys, and voids are rare); past
      :data:`MAX_FAILED_VOIDS` kept, an error naming ``ucm-db invalidate``
      is logged at most once a minute. A second failed void of the same
      save id (the save recomputed and voided again) merges its units into
      the first's. The list lives in memory; the store knows the units as
      provisional (:mod:`~ucm_db.connector.worker.provisional`): a clean
      close leaves them to the store's sweep, as a death leaves every save
      not settled. Until its retry succeeds
      the voided units stay stored, and every reader of the store (this
      engine's lookups once the scheduler's fence lifts, a step after the
      void: settlement.py; other engines at once) may load them; a save of
      the same keys meanwhile stores nothing under them (first writer wins)
      and the retry deletes them with their descendants, so what is left
      stored after it is right. Failures are logged at most once a minute.
    * A void counts the blocks of its save in ``saves_voided`` when its
      delete succeeds, on every worker rank whose writer stored some of it
      (vLLM sums the ranks, as for ``saved_blocks`` and a held save a rank
      drops): the unit is blocks per writing rank.
    * Only the writer thread records and deletes: a void is queued behind
      every save queued before it (it comes a step later), so its save's
      round is done and recorded when it runs. A record no void takes is
      forgotten :data:`KEEP_STEPS` worker steps after its save's step (the
      scheduler voids a save within MAX_PENDING_STEPS steps, or never).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm.logger import init_logger

import ucm_db
from ucm_db.connector.metadata import BlockTransfer
from ucm_db.connector.metrics import Counters
from ucm_db.connector.scheduler.settlement import MAX_PENDING_STEPS
from ucm_db.connector.worker.provisional import ProvisionalTags
from ucm_db.keys import Namespace
from ucm_db.keys.units import UnitKeys

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
#: Worker steps a save's record waits for its void (twice what the scheduler waits for a step's output).
KEEP_STEPS = 2 * MAX_PENDING_STEPS
#: Voids whose delete failed past which an error line (at most once a minute) names ``ucm-db invalidate``;
#: every one is still kept and retried (module invariants).
MAX_FAILED_VOIDS = 256
_FAILURE_LOG_INTERVAL_S = 60.0

#: A save as its void names it again: (request id, first block key, blocks).
SaveId = tuple[str, bytes, int]


def batch_order(chains: Sequence[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """A round's ``(save job, chain)`` pairs, with the saves no void can take
    first where one of them names a unit a voidable save names too: the
    store keeps the batch's first payload of a unit, so the right save's,
    which a void of the other then never deletes. Otherwise in queue order
    (a child put before its parent fails the batch, and the writer puts
    save by save: not in a round that needs no reordering)."""
    voidable = {key for job, j in chains if job.void_tag is not None for key in job.chains[j]}
    if not any(job.void_tag is None and not voidable.isdisjoint(job.chains[j]) for job, j in chains):
        return list(chains)
    return sorted(chains, key=lambda pair: pair[0].void_tag is not None)


def save_id(transfer: BlockTransfer) -> SaveId:
    """The id under which a save's record waits for its void (the void's
    transfer is the save's own)."""
    return transfer.req_id, transfer.keys[0] if transfer.keys else b"", len(transfer.keys)


@dataclass(frozen=True)
class VoidTag:
    """Marks a save a later step may void: its id and the worker step that saved it."""

    save: SaveId
    step: int


@dataclass(frozen=True)
class VoidJob:
    """A void: delete the units the writer stored for save ``save`` (with
    their descendants); ``step``: the worker step that queued it."""

    namespace: Namespace
    save: SaveId
    blocks: int
    step: int = 0
    nbytes: int = 0
    queued_bytes: int = 0  # no staging: the writer queue's byte count is unchanged


class SaveVoids:
    """The writer's records of what it stored for saves that may be voided,
    and the voids' deletes (module invariants). Writer thread only."""

    def __init__(self, store: ucm_db.Store, counters: Counters | None = None) -> None:
        self._store = store
        self._tags = ProvisionalTags(store)  # the saves' durable marks (provisional.py)
        self._counters = counters  # saves_voided: the blocks of each save whose void deleted something
        self._failed: dict[SaveId, tuple[VoidJob, list[bytes]]] = {}  # voids whose delete failed, oldest first
        self._failure_logged_s = -_FAILURE_LOG_INTERVAL_S
        self._overflow_logged_s = -_FAILURE_LOG_INTERVAL_S  # the error line while over MAX_FAILED_VOIDS
        self._round: dict[SaveId, set[bytes]] = {}  # per voidable save: keys the round stored for it (or may have)
        self._recording = False  # the current round holds a voidable save: only then are its keys kept
        self._records: dict[SaveId, tuple[int, list[bytes]]] = {}  # save -> (step, first stored unit per chain)

    def tag_for(self, job: Any) -> bytes | None:
        """The provisional tag of a voidable save's units in this round (None: not voidable, or no owner)."""
        return self._tags.tag_for(job.void_tag.save) if job.void_tag is not None else None

    def close(self) -> None:
        """Ends the owner of the tags: the store's sweep deletes the units of the voids still failing (provisional.py)."""
        self._tags.close(self._failed)

    def begin_round(self, voidable: bool) -> None:
        """Starts a writer round (or a void); ``voidable``: it holds a save a
        later step may void. Retries the voids whose delete failed first."""
        self._recording = voidable
        for save, (job, units) in list(self._failed.items()):
            if not self._delete(job, units):
                return  # still failing: the later ones wait too
            del self._failed[save]
            self._tags.settle(save)

    def stored(self, keys: Iterable[bytes], job: Any) -> None:
        """Keys a put of ``job``'s chains alone stored, or may have (module
        invariants); kept only for a voidable save (``job.void_tag``)."""
        if self._recording and job.void_tag is not None:
            self._round.setdefault(job.void_tag.save, set()).update(keys)

    def maybe_stored(self, chains: Sequence[tuple[Any, int]]) -> None:
        """A put of ``chains`` raised after perhaps committing: every unit a
        voidable save among them named counts as stored (module invariants)."""
        for job, j in chains:
            self.stored(job.chains[j], job)

    def stored_by(self, chains: Sequence[tuple[Any, int]], keys: Iterable[bytes]) -> None:
        """Keys one put of several saves' ``chains`` (in its batch order:
        :func:`batch_order`) stored, or may have: a key named by several is
        the first naming save's (the store keeps a batch's first payload of
        a key), kept only where that save is voidable."""
        if not self._recording:
            return
        left = set(keys)
        for job, j in chains:
            mine = [key for key in job.chains[j] if key in left]
            left.difference_update(mine)
            if job.void_tag is not None:
                self._round.setdefault(job.void_tag.save, set()).update(mine)

    def end_round(self, saves: Sequence[tuple[VoidTag, tuple[UnitKeys, ...]]]) -> None:
        """Records, for each voidable save of the round just done (its tag
        and unit chains), the first unit the round stored in each chain."""
        for tag, chains in saves:
            own = self._round.get(tag.save, set())
            firsts = [key for key in (next((k for k in chain if k in own), None) for chain in chains) if key is not None]
            self._records.pop(tag.save, None)  # a newer save of the same blocks replaces it, last in age order
            if firsts:
                self._records[tag.save] = (tag.step, firsts)
            elif tag.save not in self._failed:
                self._tags.settle(tag.save)  # stored nothing: no mark
            self._forget_before(tag.step - KEEP_STEPS)
        self._round.clear()
        self._tags.end_round()

    def delete(self, job: VoidJob) -> None:
        """Deletes what the writer stored for ``job``'s save (nothing if it stored nothing)."""
        record = self._records.pop(job.save, None)
        self._forget_before(job.step - KEEP_STEPS)
        if record is None or self._delete(job, record[1]):
            if job.save not in self._failed:
                self._tags.settle(job.save)  # settled at end_round, which the writer calls after a void too
            return
        self._keep_failed(job, record[1])

    def _keep_failed(self, job: VoidJob, units: list[bytes]) -> None:
        """Keeps a void whose delete failed for its retry: a failed void of the
        same save id already kept (the save recomputed and voided again) keeps
        its place and gains these units, so neither's units are lost."""
        kept = self._failed.get(job.save)
        if kept is not None:
            units = kept[1] + [unit for unit in units if unit not in kept[1]]
            job = replace(kept[0], blocks=kept[0].blocks + job.blocks)
        self._failed[job.save] = (job, units)
        now = time.monotonic()
        if len(self._failed) > MAX_FAILED_VOIDS and now - self._overflow_logged_s >= _FAILURE_LOG_INTERVAL_S:
            self._overflow_logged_s = now
            logger.error("ucm-db: %d voids of blocks saved over a failed load are still failing to delete: their "
                         "wrong units stay stored (and may be served) until a retry succeeds; every one is kept "
                         "and retried. `ucm-db invalidate` the namespace to drop them now (logged at most once a "
                         "minute)", len(self._failed))

    def _delete(self, job: VoidJob, units: list[bytes]) -> bool:
        """Deletes ``units`` (with their descendants) for ``job``; False where that failed (logged)."""
        try:
            self._store.delete(job.namespace, units, remote=True)  # wrong KV: off the remote too
        except Exception as exc:  # noqa: BLE001 - kept and retried whatever failed (module invariants)
            now = time.monotonic()
            if now - self._failure_logged_s >= _FAILURE_LOG_INTERVAL_S:
                self._failure_logged_s = now
                logger.warning("ucm-db: deleting %d blocks saved over a failed load failed: they stay stored, and are "
                               "deleted before a later save round once the store takes deletes again (logged at most "
                               "once a minute): %s", job.blocks, exc)
            return False
        if self._counters is not None:
            self._counters.add(saves_voided=job.blocks)
        return True

    def _forget_before(self, step: int) -> None:
        """Drops the records of saves before ``step`` (the dict is in step order)."""
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][0] >= step:
                return
            del self._records[oldest]
            if oldest not in self._failed:
                self._tags.settle(oldest)  # its save stands
