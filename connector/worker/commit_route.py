"""Where a writer round commits: in the commit process (``save_process``,
:mod:`ucm_db.committer`) or in the worker's own store handle.

Invariants:
    * A round goes to the commit process only if every job's staging lies
      in its shared buffers (contiguous ``[blocks, units, unit_bytes]``
      rows); otherwise it commits here, the same transaction either way.
    * The child found gone (at a commit, or by a staging allocation), the
      route logs it once, closes it and commits here from then on; the
      round under way commits here at once, its staging still intact.
    * A round is one transaction wherever it commits (the writer's rounds,
      writer.py): a round whose request is over the commit process's
      message limit (:data:`ucm_db.committer.wire.MAX_PAYLOAD_BYTES`: ~1M
      unit keys, fewer with event fields) is never split into requests; it
      commits here, whole, and the child (refused it unsent, alive) takes
      the later rounds. The first such round is logged.
    * A round names the buffer its staging lies in: a job holds its staging
      (so its buffer stays mapped) until it is done, and
      :meth:`~ucm_db.committer.CommitProcess.locate` never names a buffer
      dropped since (one whose address range a newer buffer took), even
      while its FORGET waits for the request this round sends.
    * :meth:`CommitRoute.put` returns the keys its transaction stored
      (``PutResult.stored_keys``); where the child was lost after the
      round's request was written whole (it may have committed it), every
      key of the chains. Where none of it reached the child
      (``CommitProcessError.request_sent`` False: found gone before or
      while it was written, or over the limit), only what the put here
      stored: a void deletes what this returns, and keys another engine
      stored first are not this round's (voids.py).
    * Committed here, a chain that continues the last unit of an earlier
      chain of the round (the same head's next step of a request) is one
      ``put_segments`` segment with it: the same units in the same
      transaction, each after its parent, at a segment's checks instead of
      one per job (16 KiB units of decode steps: 1.5 units a job).
    * :attr:`child_cpu_s` adds up the child's CPU seconds of the commits it
      ran since the caller last reset it (the writer counts them as commit
      CPU beside its own thread's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from vllm.logger import init_logger

import ucm_db
from ucm_db.committer import CommitProcess, SharedChain
from ucm_db.connector.stores import release_committer
from ucm_db.errors import CommitProcessError
from ucm_db.keys import BlockKeys, Namespace
from ucm_db.keys.units import UnitKeys

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class SaveJob(Protocol):
    """What a route reads of a save job (:class:`~ucm_db.connector.worker.writer.SaveJob`)."""

    @property
    def namespace(self) -> Namespace: ...

    @property
    def chains(self) -> tuple[UnitKeys, ...]: ...

    @property
    def staging(self) -> torch.Tensor: ...


class CommitRoute:
    """Commits chains of save jobs through ``committer`` where it can, else ``store`` (module invariants)."""

    def __init__(self, store: ucm_db.Store, frames: Callable[[np.ndarray], ucm_db.Framed], codec_name: str | None,
                 committer: CommitProcess | None, frame_bytes: Sequence[int] | None,
                 tag_of: Callable[[Any], bytes | None] | None = None) -> None:
        self._store = store
        self._tag_of = tag_of  # a voidable save's provisional tag (voids.py, provisional.py)
        self._frames = frames
        self._codec_name = codec_name
        self._committer = committer
        self._frame_bytes = frame_bytes
        self.child_cpu_s = 0.0
        self._logged_refused = False

    @property
    def committer(self) -> CommitProcess | None:
        """The commit process rounds go to (None: none, or lost)."""
        return self._committer

    def put(self, chains: list[tuple[SaveJob, int]], evented: dict[bytes, ucm_db.BlockEventFields] | None) -> list[bytes]:
        """One transaction of ``chains`` (a job and the index of one of its
        chains); returns the keys it stored (module invariants)."""
        namespace = chains[0][0].namespace
        if self._committer is not None and not self._committer.alive:  # found gone by a staging allocation
            self._lose_committer(self._committer.gone_reason or "")
        sent = False  # the child may have committed this round
        provisional = self._provisional(chains)
        if self._committer is not None:
            shared = self._shared(self._committer, chains)
            if shared is not None:
                try:
                    committed = self._committer.put_segments(
                        namespace, shared, codec_name=self._codec_name, frame_bytes=self._frame_bytes, event_fields=evented,
                        provisional=provisional)
                    self.child_cpu_s += committed.cpu_s
                    return committed.stored_keys
                except CommitProcessError as exc:
                    sent = exc.request_sent
                    if self._committer.alive:  # refused unsent (over the limit): it serves the next rounds
                        self._log_refused(str(exc))
                    else:
                        self._lose_committer(str(exc))
        stored = self._store.put_segments(namespace, self._segments(chains), codec_name=self._codec_name, event_fields=evented,
                                          provisional=provisional).stored_keys
        return [key for job, j in chains for key in job.chains[j]] if sent else stored

    def _provisional(self, chains: list[tuple[SaveJob, int]]) -> dict[bytes, bytes] | None:
        """The round's provisional tags by unit key: a unit several saves name
        is the first's (the store keeps a batch's first payload of a key)."""
        tags = [self._tag_of(job) for job, _ in chains] if self._tag_of is not None else []
        if not any(tags):
            return None
        by_key: dict[bytes, bytes | None] = {}
        for (job, j), tag in zip(chains, tags):
            for key in job.chains[j]:
                by_key.setdefault(key, tag)
        return {key: tag for key, tag in by_key.items() if tag is not None}

    def close(self) -> None:
        if self._committer is not None:
            committer, self._committer = self._committer, None
            release_committer(committer)

    def _log_refused(self, reason: str) -> None:
        if not self._logged_refused:
            self._logged_refused = True
            logger.warning("ucm-db: %s; such a round commits in the worker process", reason)

    def _lose_committer(self, reason: str) -> None:
        logger.warning("ucm-db: %s; saves now commit in the worker process", reason)
        committer, self._committer = self._committer, None
        if committer is not None:
            release_committer(committer)

    @staticmethod
    def _shared(committer: CommitProcess, chains: list[tuple[SaveJob, int]]) -> list[SharedChain] | None:
        """The chains as the commit process names them; None if a job's staging is not in its buffers."""
        out = []
        for job, j in chains:
            staging = job.staging
            place = committer.locate(staging.data_ptr(), staging.numel())
            if place is None or not staging.is_contiguous():
                return None
            buffer_id, offset = place
            unit_bytes = int(staging.shape[2])
            keys = job.chains[j]
            out.append(SharedChain(BlockKeys(list(keys), parent=keys.parent()), buffer_id, offset + j * unit_bytes,
                                   int(staging.shape[1]) * unit_bytes, unit_bytes))
        return out

    def _segments(self, chains: list[tuple[SaveJob, int]]) -> list[tuple[BlockKeys, list[ucm_db.Framed]]]:
        """The chains as ``put_segments``' segments, in order, each unit a
        :class:`ucm_db.Framed` view of its staging row (no copy). A chain
        that continues an earlier one of the round (a request's next step,
        same head) is appended to it: one segment each, the same blocks in
        the same transaction, and its parent before it as before (a round's
        jobs are in submission order)."""
        segments: list[tuple[BlockKeys, list[ucm_db.Framed]]] = []
        tails: dict[bytes, int] = {}  # last key of a segment -> its index
        staged: tuple[SaveJob, np.ndarray] | None = None  # the job of the chain before and its rows
        for job, j in chains:
            unit_keys = job.chains[j]
            if not unit_keys:
                continue
            if staged is None or staged[0] is not job:
                staged = (job, job.staging.numpy())
            rows = staged[1]
            keys = BlockKeys(unit_keys, parent=unit_keys.parent())
            frames = [self._frames(rows[i, j]) for i in range(len(keys))]
            at = tails.pop(keys.parent, None) if keys.parent is not None else None
            if at is None:
                at = len(segments)
                segments.append((keys, frames))
            else:
                segments[at][0].extend(keys)
                segments[at][1].extend(frames)
            tails[keys[-1]] = at
        return segments
