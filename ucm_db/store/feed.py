"""The store's per-namespace bookkeeping: the KV cache events' change
feed (:mod:`ucm_db.events`) and the namespaces' epochs
(:mod:`ucm_db.store.epochs`, served through :mod:`ucm_db.store.epoch_gate`):
:class:`StoreFeed`, a part of :class:`~ucm_db.store.Store` built on its
:class:`~ucm_db.store.state.StoreState` (the engine and the epoch gate).

Invariants:
    * Every change feed read here is one read transaction; a batch's or an
      inventory's ``feed_id`` is read in the same one.
    * ``epoch`` is one read transaction, plus at first contact with a
      remote one manifest read and, where the remote's epoch is higher, one
      durable write recording it (never a lower epoch); an unknown epoch
      raises, never reads as 0.
    * ``bump_epoch`` is one durable write (and, with a remote, a manifest
      write) and is refused by a read-only store.
"""

from __future__ import annotations

import operator

from ucm_db.arguments import require_namespace
from ucm_db.errors import ConfigError
from ucm_db.events import ChangeBatch, EventInventory
from ucm_db.keys import Namespace
from ucm_db.store.state import StoreState
from ucm_db.index import changefeed


class StoreFeed:
    """The change feed and epochs of :class:`~ucm_db.store.Store` (module invariants)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._engine = state.engine
        self._epochs = state.epochs

    def changes_since(self, seq: int, limit: int = 1024, *, namespace: Namespace | None = None,
                      feed_id: str | None = None) -> ChangeBatch:
        """Change feed records from ``seq`` on (at most ``limit`` seqs;
        of ``namespace`` only, if given), written by any process. One read
        transaction; with nothing new, the feed id and one record read;
        ``limit`` 0 reads no record (``next_seq`` is ``seq``: the feed id
        and ``resync`` only).
        ``resync`` set: the reader fell behind the feed's bound, or
        ``feed_id`` (a batch's or inventory's ``feed_id``) is given and is
        not this feed's (the store was created again at this path, or an OS
        crash undid commits: seqs name other records now; no records then):
        clear, then :meth:`event_inventory`. Without ``feed_id`` only the
        seq is checked: a reader that keeps its seq across opens or
        processes must keep the batch's ``feed_id`` and pass it. A ``seq``
        that is not an int >= 0, a ``limit`` that is not an int >= 0, or a
        ``feed_id`` that is not a str is a :class:`~ucm_db.errors.ConfigError`."""
        self._state.check_open()
        seq, limit = _integer("seq", seq), _integer("limit", limit)
        if feed_id is not None and not isinstance(feed_id, str):
            raise ConfigError(f"changes_since: feed_id must be a str or None, got {type(feed_id).__name__}",
                              hint="pass the feed_id of the batch or inventory the seq came from (a hex string)")
        ns_id = None
        if namespace is not None:
            require_namespace(namespace, "changes_since")
            ns_id = namespace.id
        return self._engine.read(lambda txn: changefeed.since(txn, seq, limit, None if ns_id is None else {ns_id}, feed_id))

    def event_inventory(self, *, namespace: Namespace | None = None, namespace_id: bytes | None = None) -> EventInventory:
        """Every evented block stored now (of a namespace, if given) as
        ``stored`` records, parents first, with the feed's ``next_seq`` and
        ``feed_id`` of the same snapshot (follow :meth:`changes_since` from
        there, passing both)."""
        self._state.check_open()
        if namespace is not None:
            require_namespace(namespace, "event_inventory")
            namespace_id = namespace.id
        wanted = None if namespace_id is None else {namespace_id}
        found, next_seq, feed_id = self._engine.read(lambda txn: (*changefeed.inventory(txn, wanted), changefeed.identity(txn)))
        return EventInventory(tuple(found), next_seq, feed_id)

    def feed_position(self) -> int:
        """The seq the next change feed record gets (start following here;
        the feed's id comes with any batch: ``changes_since(seq).feed_id``)."""
        self._state.check_open()
        return self._engine.read(changefeed.position)[0]

    def epoch(self, namespace: Namespace) -> int:
        """``namespace``'s epoch (0 until it is first bumped, here or on the
        remote): root key chains at it (``namespace.block_keys(...,
        epoch=store.epoch(ns))``) to find only blocks stored since the last
        invalidation (:mod:`ucm_db.store.epochs`).

        Raises:
            EpochUnknownError: (a TierError) the epoch cannot be established
                (a damaged record, or one lost while the store holds the
                namespace's blocks): the namespace is not served until
                ``ucm-db invalidate`` records a new epoch; logged once.
        """
        self._state.check_open()
        require_namespace(namespace, "epoch")
        return self._epochs.epoch(namespace)

    def bump_epoch(self, namespace: Namespace) -> int:
        """Invalidates ``namespace``'s blocks: moves its epoch on, durably
        and for every process on the store, and returns the new epoch.
        Nothing is deleted: blocks keyed at older epochs are never found
        again and leave through LRU eviction (:mod:`ucm_db.store.epochs`).
        With a remote, the new epoch is claimed there above every epoch the
        nodes sharing it took (read afresh), and the manifest is told it; a
        bump that cannot claim, or one without the remote on a namespace
        shared with one, takes a fresh epoch no node counted to
        (:mod:`ucm_db.store.epoch_gate`). An unknown epoch becomes a fresh
        one, never a reused one."""
        self._state.check_open()
        require_namespace(namespace, "bump_epoch")
        self._state.refuse_read_only("bump_epoch")
        return self._epochs.bump(namespace)


def _integer(name: str, value: object) -> int:
    """``changes_since``' ``seq`` or ``limit`` as an int >= 0 (a numpy integer
    too), or a ConfigError: a str seq ("0", read from a file) failed deep
    in the feed as a TypeError."""
    try:
        if isinstance(value, bool):
            raise TypeError(name)
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or number < 0:
        raise ConfigError(f"changes_since: {name} must be an integer >= 0, got {value!r}",
                          hint="pass seq=store.feed_position() (or a batch's next_seq) and limit as an int")
    return number
