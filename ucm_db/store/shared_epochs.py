"""Epochs a namespace shares with a remote: which epoch a bump claims there,
recording the claimed one, and which namespaces are shared.

:mod:`ucm_db.store.epochs` numbers a namespace's epochs by counting (a
first bump gives 1). Nodes sharing a remote count together: a bump through
the remote claims its epoch there (:mod:`ucm_db.remote.epoch_claims`,
above every epoch the fleet took), then records it here. A bump that
cannot reach the remote, or is made without it (``ucm-db invalidate``
without ``--remote``) on a namespace shared with one, cannot know what the
fleet took: it takes a :func:`~ucm_db.store.epochs.fresh_epoch` (``2**40``
plus the clock in ms), which no count reaches, and the store tells the
remote at its next contact.

Invariants:
    * A namespace is *shared* once this store recorded its epoch with a
      remote configured (its first contact finding the namespace there, its
      epoch told to the remote, a put or promotion there, a bump through it:
      the checked info record ``epochs:shared:<id>``), or its blocks came
      from an archive (``ucm-db import``: the source's epochs may be a
      fleet's), or where the store uploaded to a remote at all (the
      uploader's ``remote_codec`` record: stores shared before the mark
      existed).
      Marks are never removed.
    * Above ``2**40`` a claimed epoch is at least the clock's fresh epoch
      (:func:`claimable`): a count there (``F + 1``) could land on a fresh
      epoch another node took meanwhile without the remote and has not told
      yet; one taken from the clock is above every fresh epoch taken before
      it (clocks within a millisecond of each other).
    * :func:`record_claimed` records a claimed epoch only above the store's
      own (and above its high-water epoch where the record is lost), in one
      write transaction with the release of the namespace's pins and the
      mark, made durable; otherwise it records nothing and the caller claims
      above (another process of this store moved the epoch on meanwhile).
"""

from __future__ import annotations

from ucm_db.engines.base import Engine, Txn
from ucm_db.index import pins, records
from ucm_db.store import epochs
from ucm_db.store.epochs import _high, _put  # this package's own records: the writes every epoch takes

#: Info record name prefix marking a namespace shared with a remote; the 16-byte namespace id follows.
SHARED_PREFIX = b"epochs:shared:"
#: The uploader's record of its remote codec (:data:`ucm_db.remote.uploader.REMOTE_CODEC_RECORD`): it uploaded.
UPLOADED_KEY = b"remote_codec"
_INFO = "info"


def _shared(txn: Txn, namespace_id: bytes) -> bool:
    return txn.get(_INFO, SHARED_PREFIX + namespace_id) is not None or txn.get(_INFO, UPLOADED_KEY) is not None


def is_shared(engine: Engine, namespace_id: bytes) -> bool:
    """Whether the namespace's epoch is shared with a remote (module invariants)."""
    return bool(engine.read(lambda txn: _shared(txn, namespace_id)))


def mark(engine: Engine, namespace_id: bytes) -> None:
    """Marks the namespace shared (one read; a write the first time)."""
    if engine.read(lambda txn: txn.get(_INFO, SHARED_PREFIX + namespace_id)) is None:
        engine.write(lambda txn: records.put_checked(txn, SHARED_PREFIX + namespace_id, b"1"))


def basis(engine: Engine, namespace_id: bytes) -> tuple[int | None, int | None]:
    """``(epoch, high)`` a bump counts from: the namespace's epoch (None:
    unknown) and, where it is unknown, the store's high-water epoch."""
    def run(txn: Txn) -> tuple[int | None, int | None]:
        found = epochs.state(txn, namespace_id)
        return found.epoch, (_high(txn) if found.epoch is None else 0)
    return engine.read(run)  # type: ignore[no-any-return]


def claimable(current: int | None, high: int | None, floor: int, remote_high: int) -> int:
    """The first epoch a bump through the remote tries to claim: the next
    count above ``current``, ``floor`` and ``remote_high`` (the highest
    epoch found on the remote), a fresh one where ``current`` is unknown,
    and at least the clock's fresh epoch above ``2**40`` (module
    invariants). Raises as :func:`~ucm_db.store.epochs.next_epoch` does."""
    epoch = epochs.next_epoch(current, max(floor, remote_high), high)
    return max(epoch, epochs.fresh_epoch()) if epoch >= epochs.FRESH_EPOCH_BASE else epoch


def record_claimed(engine: Engine, namespace_id: bytes, epoch: int) -> bool:
    """Records ``epoch``, claimed on the remote, as the namespace's, where
    it is above the store's (module invariants); whether it did."""
    if not (epochs.is_epoch(epoch) and epoch < epochs.SIGNED_EPOCH_LIMIT):
        raise ValueError(f"a claimed epoch is an integer in [0, 2**63), got {str(epoch)[:40]!r}")

    def run(txn: Txn) -> bool:
        epochs.seal(txn)
        current = epochs.state(txn, namespace_id).epoch
        below = _high(txn) if current is None else current
        if below is None or epoch <= below:
            return False
        _put(txn, namespace_id, epoch)
        pins.release_namespace(txn, namespace_id)  # stale is stale (ucm_db.store.epochs invariants)
        if txn.get(_INFO, SHARED_PREFIX + namespace_id) is None:
            records.put_checked(txn, SHARED_PREFIX + namespace_id, b"1")
        return True

    recorded = bool(engine.write(run))
    if recorded:
        engine.sync()
    return recorded
