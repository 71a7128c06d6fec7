"""The namespace epoch as one engine's scheduler knows it (reset and invalidation).

The store records each namespace's epoch (:meth:`ucm_db.Store.epoch`); key
chains are rooted at it, so blocks stored before a bump are never found
(:mod:`ucm_db.store.epochs`). vLLM's ``reset_prefix_cache(reset_connector=True)``
(``/reset_prefix_cache?reset_external=true`` on a dev-mode server) reaches
``reset_cache``, which bumps it; ``ucm-db invalidate`` bumps it from outside.

Invariants:
    * The epoch is read from the store once per scheduler step, before the
      step's first lookup or, in a step without one, before its saves are
      planned (``Store.epoch``: about 3 us while nothing was committed
      to the store since the last step, a read transaction otherwise), so
      a lookup never uses an epoch older than the last bump committed
      before its step began, whichever process made it, and an engine
      that only decodes drops an invalidated epoch (its saves, its announced blocks: docs/events.md) at its next step.
    * A request's key chain is rooted at the epoch known when its state was
      made; the scheduler makes a new state for a waiting request whose
      chain is older, and never saves for a running one (its KV predates
      the reset).
    * An epoch that cannot be read (a damaged record) is ``None``: nothing
      is claimed and nothing saved until a bump records a new one.
    * After this engine's own reset its chains are rooted at a private
      epoch (:func:`private_epoch`: the store's epoch and a token drawn at
      each reset, at or above ``2**63``, where no count of the store's
      reaches), never at the store's: vLLM resets the connector after a
      weight update, and the updated weights are this engine's alone, while
      other engines and a restart compute with the model's files. So no
      other engine is served this engine's KV, nor this engine theirs,
      until it restarts; the store's epoch still moves on for everyone.
"""

from __future__ import annotations

import hashlib
import os

from vllm.logger import init_logger

import ucm_db
from ucm_db.errors import UcmDbError
from ucm_db.keys import Namespace

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class EpochWatch:
    """One namespace's epoch, read at most once per step (module invariants)."""

    def __init__(self, store: ucm_db.Store, namespace: Namespace) -> None:
        self._store = store
        self._namespace = namespace
        self._own: bytes | None = None  # drawn at each reset of this engine (module invariants)
        self.store_epoch: int | None = None
        self.epoch: int | None = None  # what this engine's chains are rooted at
        self._fresh = False
        self.current()

    def current(self) -> int | None:
        """The epoch for this step's lookups (read once per step)."""
        if not self._fresh:
            self._fresh = True
            self._set(self._read())
        return self.epoch

    def step_done(self) -> None:
        """The step's metadata is built: the next step reads the epoch again."""
        self._fresh = False

    def bump(self) -> bool:
        """Moves the namespace's epoch on in the store (``reset_cache``);
        False where the store refuses (read-only, I/O error), logged."""
        self._own = os.urandom(16)  # before the bump: a refused bump (read-only store) still keys this engine apart
        self._set(self.store_epoch)
        try:
            epoch = self._store.bump_epoch(self._namespace)
        except UcmDbError as exc:
            logger.error("ucm-db: reset_cache could not invalidate namespace %s: %s; this engine's blocks are keyed "
                         "apart until it restarts", self._namespace.short_id, exc)
            return False
        logger.warning("ucm-db: reset_cache: namespace %s moved to epoch %d; this engine's blocks are keyed apart from "
                       "every other engine's until it restarts (its weights may have been updated in place): PD "
                       "consumers and DP ranks no longer share its KV, nor it theirs",
                       self._namespace.short_id, epoch)
        self._fresh = True
        self._set(epoch)
        return True

    def _read(self) -> int | None:
        try:
            return self._store.epoch(self._namespace)
        except UcmDbError as exc:
            if self.epoch is not None:
                logger.error("ucm-db: %s; nothing is loaded or saved until it is fixed", exc)
            return None

    def _set(self, epoch: int | None) -> None:
        if epoch is not None and epoch != self.store_epoch and (epoch or self.store_epoch is not None):
            logger.info("ucm-db: namespace %s is at epoch %d: blocks stored before it are never served",
                        self._namespace.short_id, epoch)
        self.store_epoch = epoch
        self.epoch = epoch if epoch is None or self._own is None else private_epoch(epoch, self._own)


def private_epoch(store_epoch: int, token: bytes) -> int:
    """The epoch an engine reset with ``token`` roots its chains at: in
    ``[2**63, 2**64)``, a function of the store's epoch (an invalidation
    from outside moves it too) and the token."""
    digest = hashlib.blake2b(store_epoch.to_bytes(8, "little") + token, digest_size=8, person=b"ucm-db/own-epoch").digest()
    return (1 << 63) | (int.from_bytes(digest, "little") & ((1 << 63) - 1))
