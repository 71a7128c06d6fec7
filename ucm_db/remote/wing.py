"""The remote wing: what a store with a ``remote`` holds and calls.

A :class:`RemoteWing` owns the link (:mod:`ucm_db.remote.link`), the
background promotions (:mod:`ucm_db.remote.promotion`) and the uploader
(:mod:`ucm_db.remote.uploader`, with its codec choice,
:mod:`ucm_db.remote.codec_choice`). The :class:`~ucm_db.store.Store` calls
it for every remote step and never reaches into its parts.

Invariants:
    * Fetched blocks enter the local tier only through
      :func:`ucm_db.remote.promotion.promote`.
    * Threads are this process's: :meth:`start_process` makes the uploader
      (again after a fork, when the parent's threads are gone).
    * :meth:`close_steps` lists the shutdown steps in order (uploader,
      background promotions, link); the store runs each even when an
      earlier one fails.
    * A block whose retraction is recorded (deleted here, its remote object
      to be deleted: :mod:`ucm_db.index.retractions`) is neither fetched
      for a lookup nor read through for a ``get``, and never promoted
      (:func:`~ucm_db.remote.promotion.promote` checks it in its
      transaction); :meth:`retract` deletes the remote objects right after
      the local delete, the uploader again until confirmed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ucm_db.auth import AuthKeys
from ucm_db.config import StoreConfig
from ucm_db.remote.codec_choice import RemoteCodec
from ucm_db.remote.link import UNFINISHED, RemoteLink
from ucm_db.remote.first_contact import ManifestReads
from ucm_db.remote import epoch_claims
from ucm_db.remote.sealing import SealingKeys
from ucm_db.remote.promotion import Continuations, DecodeQueue, PromotionTarget, extend_prefix, read_through
from ucm_db.remote.uploader import Uploader, describe
from ucm_db.engines.base import Buffer
from ucm_db.errors import TierError, UcmDbError
from ucm_db.index.local import BlockEntry, LocalTier

_log = logging.getLogger("ucm_db")
#: A bulk remote fetch (get of local misses) waits this many lookup deadlines.
FETCH_DEADLINE_FACTOR = 10


class RemoteWing:
    """A store's remote side (see module invariants)."""

    def __init__(self, config: StoreConfig, auth: AuthKeys | None, local: LocalTier, store_dir: Path,
                 sealing: SealingKeys | None = None) -> None:
        assert config.remote is not None
        self._config = config
        self._local = local
        self._store_dir = store_dir
        self.link = RemoteLink(
            config.remote, dict(config.remote_options), config.remote_read_concurrency,
            max_object_bytes=config.remote_max_object_bytes, lookup_max_bytes=config.remote_lookup_max_bytes, auth=auth,
            sealing=sealing,
        )
        self.continuations = Continuations(self.link)
        self._manifests = ManifestReads(self.link, config.remote)
        self.uploader: Uploader | None = None

    def start_process(self, *, forked: bool) -> None:
        """Starts this process's uploader; in a forked child, first makes
        the link's and the promotions' threads again."""
        if forked:
            self.link.after_fork()
            self.continuations.after_fork()
            self._manifests.after_fork()
            if self.uploader is not None:
                self.uploader.forget_lock_after_fork()
        remote_codec = RemoteCodec(
            self._config.remote_codec, local_codec=self._config.codec, level=self._config.zstd_level,
            threads=self._config.upload_concurrency,
        )
        self.uploader = Uploader(
            self._local, self.link.root, self._store_dir, concurrency=self._config.upload_concurrency,
            remote_codec=remote_codec,
        )
        self.uploader.start()

    def extend_prefix(self, target: PromotionTarget, keys: Sequence[bytes], local_n: int, deadline_s: float) -> int:
        """Blocks of ``keys`` local after promoting what continues the local
        prefix ``keys[:local_n]`` of ``target``'s namespace
        (:func:`ucm_db.remote.promotion.extend_prefix`)."""
        cut = self._local.uploads.first_retracted(keys[local_n:])
        if cut is not None:
            keys = keys[: local_n + cut]  # nothing at or after a retracted block can be promoted
            if cut == 0:
                return local_n
        count, _ = extend_prefix(self.link, self.continuations, self._local, target, keys, local_n, deadline_s)
        return count

    @property
    def bulk_deadline_s(self) -> float:
        """How long a bulk step waits on the remote: :data:`FETCH_DEADLINE_FACTOR` lookup deadlines."""
        return FETCH_DEADLINE_FACTOR * self._config.remote_deadline_s

    def read_through(
        self, target: PromotionTarget, keys: Sequence[bytes], missing: list[int], use: Callable[[int, Buffer], None],
        decodes: DecodeQueue,
    ) -> None:
        """Fetches and promotes local misses (:func:`ucm_db.remote.promotion.read_through`)
        within :data:`FETCH_DEADLINE_FACTOR` lookup deadlines."""
        deadline = time.monotonic() + self.bulk_deadline_s
        retracted = self._local.uploads.retracted([keys[i] for i in missing])
        missing = [i for i in missing if keys[i] not in retracted]  # their remote objects are wrong, or going
        read_through(self.link, self._local, target, keys, missing, deadline, use, decodes)

    def namespace_epoch(self, namespace_id: bytes, wait_s: float | None = None) -> int | None:
        """The epoch the remote's manifest of the namespace carries; None if
        unknown (:func:`ucm_db.remote.manifests.manifest_epoch`), waited for
        at most ``wait_s`` (default: the lookup deadline): first contact,
        :mod:`ucm_db.remote.first_contact`.

        Raises:
            RemotePendingError: the read is still running (it goes on).
            ManifestError: the manifest's epoch cannot be established.
            TierError: the remote failed.
        """
        return self._manifests.epoch(namespace_id, self._config.remote_deadline_s if wait_s is None else wait_s)

    def publish_epoch(self, namespace_id: bytes, epoch: int, description: dict[str, Any],
                      taken_unix_s: float | None = None) -> None:
        """Makes the remote's manifest of the namespace carry ``epoch``
        unless it carries a higher one, claiming it where no claim of it is
        (:func:`ucm_db.remote.epoch_claims.publish`), within a bulk fetch's
        deadline; TierError otherwise (an abandoned write may still land: it
        is whole-object and never lowers); EpochSuperseded where a claim made
        after ``taken_unix_s`` is there (nothing written)."""
        answer = self._within(lambda: epoch_claims.publish(self.link.root, namespace_id, epoch, description,
                                                           taken_unix_s=taken_unix_s),
                              self.bulk_deadline_s, "write the namespace manifest")
        if isinstance(answer, epoch_claims.EpochSuperseded):
            raise answer

    def claim_epoch(self, namespace_id: bytes, choose: Callable[[int], int], description: dict[str, Any]) -> int:
        """A new epoch of the namespace, claimed on the remote above every
        epoch found there and recorded in its manifest
        (:func:`ucm_db.remote.epoch_claims.claim`), within a bulk fetch's
        deadline; TierError otherwise."""
        deadline = time.monotonic() + self.bulk_deadline_s
        claimed = self._within(lambda: epoch_claims.claim(self.link.root, namespace_id, choose, description, deadline),
                               self.bulk_deadline_s, "claim a new epoch of the namespace")
        if isinstance(claimed, UcmDbError):
            raise claimed  # no epoch left above the fleet's: the caller's answer, not the remote's failure
        return int(claimed)

    def _within(self, call: Callable[[], Any], seconds: float, what: str) -> Any:
        results = self.link.run_all([call], time.monotonic() + seconds)
        if results is None or results[0] is UNFINISHED:
            raise TierError(f"could not {what} on remote {self._config.remote} within {seconds:g} s (failed, slow, or its breaker is open)",
                            hint="check remote/remote_options; it is retried")
        return results[0]

    def upload(self, entries: Sequence[BlockEntry]) -> None:
        """After a put committed and queued ``entries``: write-through
        uploads them before returning, write-back wakes the uploader.

        Raises:
            TierError: a write-through upload failed (the blocks stay
                stored locally and queued; the uploader retries them).
        """
        assert self.uploader is not None  # started with the process
        if self._config.remote_mode != "write_through":
            self.uploader.notify()
            return
        errors = self.uploader.upload_now([(e.key, e.parent, e.namespace_id, b"".join([e.head, e.body])) for e in entries])
        if errors:
            self.uploader.notify()
            raise TierError(
                f"write-through upload of {len(errors)} of {len(entries)} block(s) failed: {errors[0]}",
                hint="the blocks are stored locally and queued; the background uploader retries them",
            )

    def wake_uploader(self) -> None:
        """Rows were queued outside a put (a provisional tag's settle): the
        uploader takes them now, in either mode."""
        if self.uploader is not None:
            self.uploader.notify()

    def retract(self) -> None:
        """After a delete recorded retractions: deletes their remote objects
        now, within a bulk fetch's deadline (:meth:`Uploader.retract_now`);
        what fails or is left stays pending, retried by the uploader (and
        never promoted meanwhile), and is logged."""
        assert self.uploader is not None  # started with the process
        left = self.uploader.retract_now(self.bulk_deadline_s)
        if left:
            _log.warning("ucm-db: %d deleted block(s) still on remote %s (%s); the uploader retries, and they are not "
                         "read from it here meanwhile", left, self._config.remote, self.uploader.retractions.last_error or "pending")

    def wait_drained(self, timeout_s: float | None) -> None:
        """Blocks until the upload queue is empty (see :meth:`Uploader.wait_drained`)."""
        if self.uploader is not None:
            self.uploader.wait_drained(timeout_s)

    def close_steps(self) -> list[Callable[[], object]]:
        """This process's shutdown steps, in order."""
        steps: list[Callable[[], object]] = []
        if self.uploader is not None:
            steps.append(self.uploader.stop)
        return [*steps, self.continuations.close, self.link.close]

    def stats(self) -> dict[str, Any]:
        """The remote's counters for :meth:`ucm_db.Store.stats`."""
        return {"url": self._config.remote, **asdict(self.link.root.stats), **describe(self.uploader),
                "breaker_trips": self.link.breaker.trips}
