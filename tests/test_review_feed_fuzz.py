"""Seeded fuzz of the change feed: a router that replays ``changes_since`` (and ``event_inventory`` when told to
resync) always knows exactly which evented blocks the store holds.

Real LMDB and RocksDB stores in tmp_path, 1 MiB capacity (puts evict), the feed's bound small in some seeds (it
wraps: readers fall off and resync), two namespaces of chains sharing prefixes (a trie of three block patterns).
Operations: put/put_segments with all, some or no event fields, puts above a missing parent, puts keyed at an older
epoch, delete, quarantine, touch, pin/unpin, bump_epoch, close/reopen with ``maintenance.evict_to_bytes`` or
``maintenance.compact`` in between. Routers (one unfiltered, one per namespace lagging with small batches, late ones
started from the inventory) read random-sized batches at random moments; at each close a `ucm-db events` follower
(``maintenance.iter_events``) resumes from the seq and feed_id of the last line it read.

Invariants (each cited where it is checked):
    1. a router caught up holds exactly the evented blocks the store holds, with their fields (checked against
       ``get`` of every key ever put);
    2. seqs strictly increase, an unfiltered batch has no gaps, a reader behind the bound is told ``resync``
       (never records past a hole) and a reader within it never is;
    3. per key, a router sees stored/removed alternate (a removal only of a block it holds, a stored never of one
       it holds);
    4. ``namespace=`` returns exactly that namespace's records of the range;
    5. a clean reopen keeps the feed's id and position; no seq is reused;
    6. ``bump_epoch`` deletes and logs nothing (the raw inventory keeps the old epoch's blocks); ``iter_events``
       tells only the current epoch's blocks, to a new and to a resumed follower.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, ChangeRecord, MissingAncestorError, Namespace, StoreFullError, maintenance
from ucm_db.events import FEED_MAX_RECORDS

NAMESPACES = (Namespace(model="fuzz-a", kv_dtype="bfloat16", block_size=4),
              Namespace(model="fuzz-b", kv_dtype="bfloat16", block_size=4))
PATTERNS = ((1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9))  # each block is one of these: chains share prefixes
PAYLOAD_SIZES = (20_000, 45_000, 90_000, 150_000)
CAPACITY_BYTES = 1 << 20


@dataclass(frozen=True)
class Scenario:
    seed: int
    engine: str
    feed_limit: int  # the feed's bound: records kept


SCENARIOS = [Scenario(1, "lmdb", 6), Scenario(2, "lmdb", FEED_MAX_RECORDS), Scenario(3, "lmdb", 17),
             Scenario(4, "lmdb", 40), Scenario(5, "rocksdb", 8), Scenario(6, "rocksdb", FEED_MAX_RECORDS),
             Scenario(7, "rocksdb", 25)]
STEPS = 160
Seen = tuple[str, bytes, bytes, object]  # (kind, namespace id, key, vLLM hash) of a seq
Cursor = tuple[int, str]  # (seq, feed_id) of the last line a `ucm-db events` follower read

@dataclass
class Router:
    """A KV-aware router's view of the store, from the feed alone."""

    namespace: Namespace | None
    seq: int = 0
    feed_id: str = ""
    known: dict[bytes, BlockEventFields] = field(default_factory=dict)
    resyncs: int = 0

    def replay(self, store: ucm_db.Store) -> None:
        """Clears the view and takes the inventory (events.py: "clear its view and replay the inventory")."""
        inventory = store.event_inventory(namespace=self.namespace)
        depths = [r.depth for r in inventory.records]
        assert depths == sorted(depths), "the inventory lists parents first"  # feed.py event_inventory docstring
        assert all(r.kind == "stored" and r.seq == inventory.next_seq for r in inventory.records)
        self.check_namespace(inventory.records)
        self.known = {r.key: r.fields for r in inventory.records}
        assert len(self.known) == len(inventory.records), "a block announced twice in one inventory"
        self.seq, self.feed_id = inventory.next_seq, inventory.feed_id

    def check_namespace(self, records: tuple[ChangeRecord, ...]) -> None:
        # Invariant 4: feed.py changes_since: "of ``namespace`` only, if given".
        assert self.namespace is None or {r.namespace_id for r in records} <= {self.namespace.id}

    def apply(self, record: ChangeRecord) -> None:
        # Invariant 3: events.py: a `stored` record when it is put, a `removed` one when it leaves the store.
        if record.kind == "stored":
            assert record.key not in self.known, f"seq {record.seq}: stored twice without a removal"
            self.known[record.key] = record.fields
        else:
            assert record.key in self.known, f"seq {record.seq}: removal of a block the router does not hold"
            assert self.known.pop(record.key).block_hash == record.fields.block_hash


@dataclass
class Fuzz:
    """One scenario: the store, what was put, the routers and the seqs seen."""

    scenario: Scenario
    path: Path
    rng: random.Random
    store: ucm_db.Store
    routers: list[Router] = field(default_factory=list)
    put_fields: dict[bytes, BlockEventFields | None] = field(default_factory=dict)  # of the put that stored a key
    namespace_of: dict[bytes, Namespace] = field(default_factory=dict)
    depth_of: dict[bytes, int] = field(default_factory=dict)  # ChangeRecord.depth: "0 for a first block"
    old_epochs: dict[bytes, list[int]] = field(default_factory=dict)
    pinned: list[tuple[Namespace, list[bytes]]] = field(default_factory=list)
    seen: dict[int, Seen] = field(default_factory=dict)
    trimmed_at_bound: bool = True  # the last append trimmed to the bound (not a maintenance view's default)
    cli_cursor: Cursor | None = None  # a `ucm-db events --since SEQ --feed-id ID` follower, resumed at closes
    cli_known: set[bytes] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)

    # -- the store ---------------------------------------------------------------------------------
    def open(self, **options: object) -> None:
        self.store = ucm_db.open(self.path, **options)
        self.store._tier.feed_max_records = self.scenario.feed_limit  # no public option: test_changefeed.py's knob

    def expected(self, namespace: Namespace | None = None) -> dict[bytes, BlockEventFields]:
        """Evented blocks stored now, asked of the store key by key (``get``), with the fields they were put with."""
        return {key: fields for key, fields in self.put_fields.items() if fields is not None
                and namespace in (None, ns := self.namespace_of[key]) and self.store.get(ns, [key])[0] is not None}

    def chain(self, ns: Namespace, epoch: int) -> tuple[list[int], ucm_db.BlockKeys]:
        tokens = [t for _ in range(self.rng.randint(1, 5)) for t in self.rng.choice(PATTERNS)]
        return tokens, ns.block_keys(tokens, epoch=epoch)

    # -- operations ----------------------------------------------------------------------------------
    def put(self) -> None:
        ns = self.rng.choice(NAMESPACES)
        epoch = self.store.epoch(ns)
        stale = self.old_epochs.get(ns.id)
        if stale and self.rng.random() < 0.15:
            epoch = self.rng.choice(stale)  # a writer that has not seen the bump: stored like any other (epoch_gate)
        tokens, keys = self.chain(ns, epoch)
        held = self.store.lookup(ns, keys)
        missing_parent = held + 1 < len(keys) and self.rng.random() < 0.08
        start = held + 1 if missing_parent else min(len(keys) - 1, max(0, held - self.rng.randint(0, 1)))
        stop, mode = self.rng.randint(start + 1, len(keys)), self.rng.choice(("all", "all", "all", "none", "some"))
        fields: dict[bytes, BlockEventFields] = {}
        for i in range(start, stop):  # vLLM-like fields: a made-up hash per block, its parent's hash, its tokens
            if mode == "all" or (mode == "some" and self.rng.random() < 0.6):
                fields[keys[i]] = BlockEventFields(b"v" + keys[i][:15], None if i == 0 else b"v" + keys[i - 1][:15],
                                                   tuple(tokens[4 * i:4 * i + 4]), 4, group_idx=i % 2, epoch=epoch)
        size, before = self.rng.choice(PAYLOAD_SIZES), self.store.feed_position()
        mid = self.rng.randint(start, stop)  # put_segments: two segments of the chain in one transaction
        segments = [(keys[a:b], [bytes([a]) * size] * (b - a)) for a, b in ((start, mid), (mid, stop)) if b > a]
        try:
            if len(segments) > 1:
                result = self.store.put_segments(ns, segments, codec_name="none", event_fields=fields or None)
            else:
                result = self.store.put(ns, *segments[0], codec_name="none", event_fields=fields or None)
        except (MissingAncestorError, StoreFullError) as exc:
            # api.md: "A put stores every block it reports, or nothing": nothing logged either.
            assert missing_parent or isinstance(exc, StoreFullError)
            assert self.store.feed_position() == before
            self.counts[type(exc).__name__] += 1
            return
        assert not missing_parent, "a put above a parent that is not stored was taken"
        self.counts[f"put-{mode}{'-stale' if epoch != self.store.epoch(ns) else ''}"] += 1
        for key in result.stored_keys:
            self.put_fields[key] = fields.get(key)  # api.md put: "A block already stored keeps what it was put with"
            self.namespace_of[key], self.depth_of[key] = ns, keys.index(key)

    def delete(self) -> None:
        """A delete, or (one in five) a quarantine: events.md lists both among the removals logged."""
        if self.put_fields:
            key = self.rng.choice(list(self.put_fields))
            if self.rng.random() < 0.2:
                self.store.quarantine(key, "fuzz", recheck=False)
                self.counts["quarantine"] += 1
            else:
                self.store.delete(self.namespace_of[key], [key])  # api.md: removes blocks and their descendants
            assert self.store.get(self.namespace_of[key], [key]) == [None]

    def touch_or_pin(self) -> None:
        ns = self.rng.choice(NAMESPACES)
        _, keys = self.chain(ns, self.store.epoch(ns))
        held, before, choice = self.store.lookup(ns, keys), self.store.feed_position(), self.rng.random()
        if choice < 0.5:
            self.store.touch(ns, keys[:held])
        elif choice < 0.8 and held:
            try:
                self.store.pin(ns, keys[:held])
                self.pinned.append((ns, list(keys[:held])))
                self.counts["pinned"] += 1
            except StoreFullError:
                pass  # over max_pinned_bytes: nothing pinned
        elif self.pinned:
            ns, chain = self.pinned.pop(self.rng.randrange(len(self.pinned)))
            self.store.unpin(ns, chain)
            self.counts["unpinned"] += 1
        assert self.store.feed_position() == before, "a touch, pin or unpin logged a feed record"

    def bump(self) -> None:
        # Invariant 6: api.md "Invalidation without deletion"; feed.py bump_epoch: "Nothing is deleted".
        ns = self.rng.choice(NAMESPACES)
        before, inventory = self.store.feed_position(), self.store.event_inventory().records
        self.old_epochs.setdefault(ns.id, []).append(self.store.epoch(ns))
        self.store.bump_epoch(ns)
        self.pinned = [p for p in self.pinned if p[0] != ns]  # configuration.md: an epoch move releases pins
        assert self.store.feed_position() == before and self.store.event_inventory().records == inventory

    def reopen(self) -> None:
        """Invariant 5: a clean close and open keep the feed (events.md: the id is drawn again only where
        seqs may be handed out a second time: rollback, reboot, damage)."""
        position, feed_id = self.store.feed_position(), self.store.changes_since(0).feed_id
        self.check_cli_after_close()
        maintained = self.rng.random() < 0.5
        if maintained:
            target = self.rng.randrange(0, CAPACITY_BYTES)
            if self.rng.random() < 0.5:
                maintenance.evict_to_bytes(self.path, target)
            else:
                maintenance.compact(self.path, target_bytes=target)
            self.counts["maintenance"] += 1
        self.open()
        after = self.store.feed_position()
        assert self.store.changes_since(after).feed_id == feed_id, "a clean reopen drew a new feed id"
        assert after == position or (maintained and after > position)
        if after != position:
            self.trimmed_at_bound = False  # maintenance appended under the default bound

    def check_cli_after_close(self) -> None:
        """Invariant 6 (cli.md events: "Only blocks of each namespace's current epoch are printed"), for the
        inventory and for a follower resumed with the seq and feed_id of the last line it read (cli.md)."""
        epochs = {ns.id: self.store.epoch(ns) for ns in NAMESPACES}
        current = {k for k, f in self.expected().items() if f.epoch == epochs[self.namespace_of[k].id]}
        self.store.close()
        told = list(maintenance.iter_events(self.path, with_feed_id=True))
        assert all(e["type"] == "BlockStored" for e in told)
        assert {bytes.fromhex(e["key"]) for e in told} == current
        if self.cli_cursor is None:
            self.cli_known = current
            self.cli_cursor = (told[-1]["seq"], told[-1]["feed_id"]) if told else None
            return
        events = list(maintenance.iter_events(self.path, since_seq=self.cli_cursor[0], feed_id=self.cli_cursor[1]))
        self.counts["cli-cleared"] += sum(e["type"] == "AllBlocksCleared" for e in events)
        self.cli_cursor = follow_lines(self.cli_known, events) or self.cli_cursor
        assert self.cli_known == current, "a resumed `ucm-db events` follower does not know the store"

    # -- routers -------------------------------------------------------------------------------------
    def read(self, router: Router, limit: int) -> bool:
        """One ``changes_since`` batch; returns whether the router is at the end."""
        position = self.store.feed_position()
        batch = self.store.changes_since(router.seq, limit, namespace=router.namespace, feed_id=router.feed_id)
        assert batch.feed_id == router.feed_id  # invariant 5: one feed throughout
        bound = self.scenario.feed_limit
        # Invariant 2: events.py "A reader at seq < first_seq ... gets resync=True and no records"; records
        # [first_seq, next_seq) are kept, so a reader within the last `bound` seqs is never told to resync.
        if router.seq >= position - bound:
            assert not batch.resync, f"resync at {router.seq} within the bound (position {position})"
        elif self.trimmed_at_bound:
            assert batch.resync, f"no resync at {router.seq}: the feed keeps [{position - bound}, {position})"
        if batch.resync:
            assert not batch.records
            router.resyncs += 1
            self.counts["resync"] += 1
            router.replay(self.store)
            return False
        seqs = [r.seq for r in batch.records]
        assert seqs == sorted(set(seqs)) and all(router.seq <= s < batch.next_seq for s in seqs)
        assert batch.next_seq <= router.seq + limit  # feed.py: "at most ``limit`` seqs"
        assert batch.next_seq > router.seq or router.seq == position, "a reader behind the end made no progress"
        if router.namespace is None:  # events.py: "Sequence numbers grow by one per record": no gap
            assert seqs == list(range(router.seq, batch.next_seq))
        self.check_against_seen(router, batch.records, batch.next_seq)
        for record in batch.records:
            router.apply(record)
        at_end, router.seq = batch.next_seq == router.seq, batch.next_seq
        return at_end

    def check_against_seen(self, router: Router, records: tuple[ChangeRecord, ...], next_seq: int) -> None:
        """Invariants 4 and 5: a seq names one record for every reader, across reopens; a namespace's batch
        holds exactly that namespace's records of its range (where an unfiltered reader saw the range)."""
        router.check_namespace(records)
        for record in records:
            now = (record.kind, record.namespace_id, record.key, record.fields.block_hash)
            assert self.seen.setdefault(record.seq, now) == now, f"seq {record.seq} names two records"
            assert record.depth == self.depth_of[record.key]
        if router.namespace is not None and all(s in self.seen for s in range(router.seq, next_seq)):
            wanted = [s for s in range(router.seq, next_seq) if self.seen[s][1] == router.namespace.id]
            assert [r.seq for r in records] == wanted

    def catch_up_and_check(self) -> None:
        """Invariants 1 and 3 at a moment every router has read to the end."""
        for router in self.routers:
            while not self.read(router, self.rng.randint(1, 64)):
                pass
            wanted, known = self.expected(router.namespace), router.known
            assert known.keys() == wanted.keys(), f"lacks {wanted.keys() - known.keys()}, has {known.keys() - wanted}"
            assert known == wanted, "a router holds other fields than the block was put with"
        held = {k: (f, self.depth_of[k]) for k, f in self.expected().items()}
        assert {r.key: (r.fields, r.depth) for r in self.store.event_inventory().records} == held

    def add_late_router(self) -> None:
        late = Router(self.rng.choice((None, *NAMESPACES)))
        late.replay(self.store)
        self.routers.append(late)

    def step(self) -> None:
        roll, position = self.rng.random(), self.store.feed_position()
        for bound, operation in ((0.5, self.put), (0.6, self.delete), (0.72, self.touch_or_pin), (0.75, self.bump),
                                 (0.8, self.reopen), (0.83, self.add_late_router)):
            if roll < bound:
                operation()
                self.counts[operation.__name__] += 1
                if operation != self.reopen and self.store.feed_position() != position:
                    self.trimmed_at_bound = True  # this append trimmed the feed to the bound
                break
        if self.rng.random() < 0.5:  # routers read at random moments, the per-namespace ones rarely
            router = self.rng.choice(self.routers)
            if router.namespace is None or self.rng.random() < 0.3:
                self.read(router, self.rng.choice((1, 2, 5, 16, 64)))


def follow_lines(known: set[bytes], events: list[dict[str, object]]) -> Cursor | None:
    """Applies `ucm-db events` lines to a follower's set; returns the (seq, feed_id) of the last line with a seq."""
    cursor = None
    for event in events:
        if event["type"] == "AllBlocksCleared":  # cli.md: a follower behind the bound (or another feed) is told so
            known.clear()
        elif event["type"] == "BlockStored":
            known.add(bytes.fromhex(str(event["key"])))
        else:
            known.discard(bytes.fromhex(str(event["key"])))
        if "seq" in event:
            cursor = (int(event["seq"]), str(event["feed_id"]))  # type: ignore[call-overload]
    return cursor


def start(tmp_path: Path, scenario: Scenario) -> Fuzz:
    if scenario.engine == "rocksdb":
        pytest.importorskip("rocksdict")
    fuzz = Fuzz(scenario, tmp_path / "store", random.Random(scenario.seed), None)  # type: ignore[arg-type]
    fuzz.open(engine=scenario.engine, capacity_bytes=CAPACITY_BYTES, codec="none")
    fuzz.routers = [Router(None), *(Router(ns) for ns in NAMESPACES)]
    for router in fuzz.routers:
        router.replay(fuzz.store)
    return fuzz


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s.engine}-seed{s.seed}-bound{s.feed_limit}")
def test_a_router_replaying_the_feed_knows_the_store(tmp_path: Path, scenario: Scenario) -> None:
    fuzz = start(tmp_path, scenario)
    try:
        for step in range(STEPS):
            fuzz.step()
            if step % 40 == 39:
                fuzz.catch_up_and_check()
        fuzz.catch_up_and_check()
        assert fuzz.store.stats().evictions > 0, "the scenario never evicted: capacity too large for its puts"
        if scenario.feed_limit < 20:
            assert sum(r.resyncs for r in fuzz.routers) > 0, "the feed never wrapped past a reader"
    finally:
        fuzz.store.close()


# -- defects this review found, fixed: their reproductions ---------------------------------------------------
def _put_evented(store: ucm_db.Store, tokens: list[int], epoch: int) -> list[bytes]:
    ns = NAMESPACES[0]
    keys = ns.block_keys(tokens, epoch=epoch)
    fields = {k: BlockEventFields(b"v" + k[:15], None, tuple(tokens[4 * i:4 * i + 4]), 4, epoch=epoch)
              for i, k in enumerate(keys)}
    store.put(ns, keys, [b"x" * 64] * len(keys), event_fields=fields)
    return list(keys)


def test_a_resumed_events_follower_learns_an_epoch_move(tmp_path: Path) -> None:
    """cli.md: a follower resumes with `--since SEQ --feed-id ID`; "when an epoch moves on ... a follower gets
    `AllBlocksCleared` and the inventory again"; old-epoch blocks are never printed. A follower resumed after
    the move holds the old block: its removal is filtered out as an old epoch's record, and nothing clears."""
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=CAPACITY_BYTES, codec="none") as store:
        old = _put_evented(store, [1, 2, 3, 4], 0)
    told = list(maintenance.iter_events(path, with_feed_id=True))
    known = {bytes.fromhex(e["key"]) for e in told}
    assert known == set(old)
    with ucm_db.open(path) as store:
        new = _put_evented(store, [5, 6, 7, 8], store.bump_epoch(NAMESPACES[0]))
        store.delete(NAMESPACES[0], old)  # the old block leaves the store too
    follow_lines(known, list(maintenance.iter_events(path, since_seq=told[-1]["seq"], feed_id=told[-1]["feed_id"])))
    assert known == set(new)


def test_changes_since_limit_zero_reads_no_seq(tmp_path: Path) -> None:
    """feed.py changes_since: "at most ``limit`` seqs". A caller asking `limit=0` for the feed_id ("the feed's id
    comes with any batch") and going on from `next_seq` loses a record silently."""
    with ucm_db.open(tmp_path / "s", capacity_bytes=CAPACITY_BYTES, codec="none") as store:
        seq = store.feed_position()
        _put_evented(store, [1, 2, 3, 4], 0)
        batch = store.changes_since(seq, 0)
        assert (batch.records, batch.next_seq) == ((), seq)
