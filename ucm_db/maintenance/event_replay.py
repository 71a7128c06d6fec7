"""KV cache events of a store for tools: the inventory replay and the change
feed followed from a path, as JSON-ready dicts or JSON lines with vLLM's
field names (what ``ucm-db events`` prints; re-exported by
:mod:`ucm_db.maintenance`).

Invariants:
    * Read-only: each read opens the store for maintenance
      (:func:`ucm_db.store.view.open_view`), reads one snapshot and lets it
      go, so a follower never holds the store's lock between polls
      (``compact`` and ``migrate`` can run beside it).
    * The inventory and the seq the feed is followed from come from the same
      snapshot: nothing is missed or told twice between them.
    * A follower that falls behind the feed's bound gets an
      ``AllBlocksCleared`` event, then the inventory again: at most once
      between two polls (a feed that says resync again right after the
      inventory, a damaged head, is read again at the next poll; without
      ``follow`` the replay ends there).
    * A seq means something only in the feed it came from: each read checks
      the feed's id (:mod:`ucm_db.index.changefeed`) against the caller's
      ``feed_id`` (the first read's, without one) and the one read before,
      in the same snapshot; another id is a resync (the store was created
      again, or an OS crash undid commits), never records read under it.
      With ``with_feed_id`` each event carries the ``feed_id`` to save.
    * A block's ``extra_keys`` (vLLM's, of a salted, LoRA, multimodal or
      prompt-embeds request) are told as the live stream publishes them
      (one entry, bytes as hex), left out where there are none; such a
      record is decoded, not dropped (the fast line formatter reads records
      without them only).
    * Only blocks of each namespace's current epoch are told (older ones are
      never served, :mod:`ucm_db.store.epochs`); when an epoch moves on (``ucm-db
      invalidate``, an engine's ``reset_cache``) a follower gets
      ``AllBlocksCleared`` and the inventory again; so does one resumed
      from ``since_seq`` where an epoch moved on at or after that seq
      (:mod:`ucm_db.index.epoch_moves`: it may hold the older epoch's
      blocks, and no feed record tells of a move).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ucm_db.arguments import require_count
from ucm_db.index import epoch_moves
from ucm_db.store import epochs
from ucm_db.errors import ConfigError, CorruptBlockError, DamagedRecordError, TierError
from ucm_db.events import MEDIUM_STORAGE, json_line, packed_epoch
from ucm_db.store.view import open_view, select_namespaces
from ucm_db.index import changefeed

T = TypeVar("T")
logger = logging.getLogger("ucm_db")
#: Feed records read per snapshot while following.
FOLLOW_BATCH_RECORDS = 4096
#: The first byte (record version) of packed event fields without ``extra_keys``, which ``json_line`` formats.
_PLAIN_RECORD = b"\x01"
CLEARED: dict[str, Any] = {"type": "AllBlocksCleared", "medium": MEDIUM_STORAGE}
SINCE_HINT = "pass an event's seq (an int, e.g. the inventory's) to read the feed from, or None for the inventory first"


def iter_events(
    path: str | Path, namespaces: tuple[str, ...] = (), *, since_seq: int | None = None, follow: bool = False,
    poll_interval_s: float = 0.5, max_polls: int | None = None, feed_id: str | None = None, with_feed_id: bool = False,
) -> Iterator[dict[str, Any]]:
    """The store's events as dicts (:meth:`ucm_db.ChangeRecord.to_json`).

    Without ``since_seq``: the inventory first (parents before children);
    then the feed from the inventory's snapshot (``since_seq``: from there,
    no inventory). Without ``follow`` it ends when the feed is read; with
    it, it polls every ``poll_interval_s`` (at most ``max_polls`` times).
    Blocks put without event fields are left out. ``feed_id``: the feed
    ``since_seq`` came from (an event's ``feed_id``); another feed is told
    as a resync (``AllBlocksCleared``, then the inventory), never read
    under that seq. ``with_feed_id`` (implied by ``feed_id``): every event,
    ``AllBlocksCleared`` too, carries the feed's ``feed_id`` (module invariants).

    Raises:
        ConfigError: a namespace matches nothing in the store,
            ``since_seq`` is not an int >= 0, or ``feed_id`` is given
            without ``since_seq`` or is not a str.
    """
    _check_cursor(since_seq, feed_id)

    def render(raw: changefeed.RawRecord, feed: str | None) -> dict[str, Any] | None:
        return _decoded_event(raw, feed)

    def cleared(feed: str | None) -> dict[str, Any]:
        return dict(CLEARED) if feed is None else {**CLEARED, "feed_id": feed}
    return _iterate(path, namespaces, since_seq, follow, poll_interval_s, max_polls, render, cleared, feed_id,
                    with_feed_id or feed_id is not None)


def iter_event_lines(
    path: str | Path, namespaces: tuple[str, ...] = (), *, since_seq: int | None = None, follow: bool = False,
    poll_interval_s: float = 0.5, max_polls: int | None = None, feed_id: str | None = None, with_feed_id: bool = False,
) -> Iterator[str]:
    """:func:`iter_events` as compact JSON lines, formatted straight from
    the stored fields (a 100k-block replay in about a second)."""
    _check_cursor(since_seq, feed_id)

    def render(raw: changefeed.RawRecord, feed: str | None) -> str | None:
        seq, kind, ns, key, _, packed = raw
        if packed[:1] != _PLAIN_RECORD:  # extra_keys: json_line formats plain records only (module invariants)
            event = _decoded_event(raw, feed)
            return None if event is None else json.dumps(event, separators=(",", ":"))
        try:
            return json_line(seq, kind, ns, key, packed, feed)
        except CorruptBlockError as exc:
            logger.warning("ucm-db: change feed record of block %s skipped: %s", key.hex()[:16], exc)
            return None

    def cleared(feed: str | None) -> str:
        return json.dumps(CLEARED if feed is None else {**CLEARED, "feed_id": feed}, separators=(",", ":"))
    return _iterate(path, namespaces, since_seq, follow, poll_interval_s, max_polls, render, cleared, feed_id,
                    with_feed_id or feed_id is not None)


def _decoded_event(raw: changefeed.RawRecord, feed: str | None) -> dict[str, Any] | None:
    """The record as a dict with its ``extra_keys`` (module invariants), or
    None where its fields are malformed (logged by ``changefeed.decoded``)."""
    record = next(changefeed.decoded([raw]), None)
    if record is None:
        return None
    event = record.to_json()
    if record.kind == "stored" and record.fields.extra_keys is not None:
        event["extra_keys"] = [_json_ready(record.fields.extra_keys)]
    if feed is not None:
        event["feed_id"] = feed
    return event


def _json_ready(value: Any) -> Any:
    """``extra_keys`` as JSON: tuples as lists, bytes (prompt-embeds digests) as hex."""
    if isinstance(value, (tuple, list)):
        return [_json_ready(v) for v in value]
    return value.hex() if isinstance(value, bytes) else value


def _check_cursor(since_seq: int | None, feed_id: str | None) -> None:
    require_count("since_seq", since_seq, minimum=0, hint=SINCE_HINT)
    if feed_id is not None and not isinstance(feed_id, str):
        raise ConfigError(f"feed_id must be a str or None, got {type(feed_id).__name__}",
                          hint="pass the feed_id of the event whose seq is since_seq")
    if feed_id is not None and since_seq is None:
        raise ConfigError("feed_id names the feed since_seq came from; without since_seq it does nothing",
                          hint="pass since_seq too, or leave feed_id out")


def _iterate(
    path: str | Path, namespaces: tuple[str, ...], since_seq: int | None, follow: bool, poll_interval_s: float,
    max_polls: int | None, render: Callable[[changefeed.RawRecord, str | None], T | None],
    cleared: Callable[[str | None], T], feed_id: str | None, with_feed_id: bool,
) -> Iterator[T]:
    def told(records: list[changefeed.RawRecord]) -> Iterator[T]:
        shown = feed if with_feed_id else None
        for record in current.keep(records):
            event = render(record, shown)
            if event is not None:  # a malformed record is skipped (logged)
                yield event

    def inventory(txn: Any, wanted: set[bytes] | None) -> tuple[list[changefeed.RawRecord], int, str]:
        return (*changefeed.inventory_raw(txn, wanted), changefeed.identity(txn))

    current = _Epochs(path)
    feed = feed_id  # the feed `seq` belongs to (None: the first read's)
    if since_seq is None:
        records, seq, feed = _read(path, namespaces, inventory, check_pages=True)
        yield from told(records)
    else:
        seq = since_seq
    polls = 0
    unchecked = since_seq is not None  # the reader's first read checks the pages, once
    resumed_at = since_seq  # the first read asks whether an epoch moved since (epoch_moves.py)
    resynced = False  # a resync since the last poll or record read
    while True:
        records, next_seq, resync, feed, moved = _read(
            path, namespaces, lambda txn, wanted: _since(txn, seq, wanted, feed, resumed_at), check_pages=unchecked)
        unchecked, resumed_at = False, None
        if resync or moved or current.moved():
            if not resynced:
                resynced = True
                current = _Epochs(path)
                records, seq, feed = _read(path, namespaces, inventory)
                yield cleared(feed if with_feed_id else None)
                yield from told(records)
                continue
            # else the feed refused the inventory's own seq (issue 46: a damaged head
            # made this loop for ever): counted as a poll, resynced after it.
        else:
            yield from told(records)
            if next_seq != seq:
                seq, resynced = next_seq, False
                continue
        polls += 1
        resynced = False
        if not follow or (max_polls is not None and polls >= max_polls):
            return
        time.sleep(poll_interval_s)


def _since(txn: Any, seq: int, wanted: set[bytes] | None, feed: str | None,
           resumed_at: int | None) -> tuple[list[changefeed.RawRecord], int, bool, str, bool]:
    """A batch from ``seq`` (``changefeed.since_raw``) and, for a follower
    resuming from ``resumed_at``, whether an epoch it may hold blocks of
    moved on since, in the same snapshot."""
    batch = changefeed.since_raw(txn, seq, FOLLOW_BATCH_RECORDS, wanted, feed)
    return (*batch, resumed_at is not None and epoch_moves.moved_since(txn, resumed_at, wanted))


class _Epochs:
    """Each namespace's current epoch, read once per namespace met (a
    damaged epoch record: nothing of that namespace is told)."""

    def __init__(self, path: str | Path) -> None:
        self._path = path
        self._known: dict[bytes, int | None] = {}

    def _of(self, namespace_id: bytes) -> int | None:
        if namespace_id not in self._known:
            self._known[namespace_id] = self._read(namespace_id)
        return self._known[namespace_id]

    def _read(self, namespace_id: bytes) -> int | None:
        with open_view(self._path, check_pages=False) as view:  # checked by the reader's first read
            try:
                return epochs.read(view.engine, namespace_id)
            except TierError:
                return None

    def keep(self, records: list[changefeed.RawRecord]) -> list[changefeed.RawRecord]:
        """The records at their namespace's current epoch."""
        return [r for r in records if packed_epoch(r[5]) == self._of(r[2])]

    def moved(self) -> bool:
        """Whether a namespace met so far has another epoch now."""
        return any(self._read(ns) != epoch for ns, epoch in self._known.items())


def _read(path: str | Path, namespaces: tuple[str, ...], fn: Callable[[Any, set[bytes] | None], T], *,
          check_pages: bool = False) -> T:
    """``fn(txn, wanted namespace ids)`` in one read snapshot of the store.
    The store is opened anew each time (no lock held between polls), with
    LMDB's page check only where ``check_pages`` (the first read: a check
    per poll would walk the whole store every poll)."""
    with open_view(path, check_pages=check_pages) as view:
        if view.format_version < 0:  # a damaged format record: what the feed means cannot be told
            raise DamagedRecordError(f"the format version record of the store at {path} is damaged: no events are read",
                                     hint=f"run `ucm-db verify --fix {path}`; if it cannot repair it, move the store aside")
        wanted = select_namespaces(view, namespaces)
        return view.engine.read(lambda txn: fn(txn, wanted))
