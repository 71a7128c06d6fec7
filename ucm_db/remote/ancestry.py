"""What an upload batch sends, and in what order, so that the remote keeps
whole ancestor chains (its prefix invariant: an object's parent is there
too) beside other nodes' ``ucm-db gc``.

``gc`` sees only the remote: a continuation still in a node's upload queue
is invisible to it, so the old chain it continues looks old and childless
and goes. The continuation used to land under a removed parent later: every
other node missed all of it, and after an hour gc removed it as orphaned.
The uploader (:mod:`ucm_db.remote.uploader`: its write-back batches and
a write-through put's) now plans and sends each batch so that it lands
whole:

* A batch holds the queued ancestors of its blocks
  (:mod:`ucm_db.remote.upload_plan`): a block never goes before a queued
  ancestor of its.
* :class:`AncestorRepair` checks, before a batch goes, that the parent of
  each *batch root* (a block whose parent is not in the batch; a chain's
  first block has none to check) is on the remote and whole: a ranged read of
  its first bytes and one of its stated end per distinct parent, none for a key this process uploaded in the last
  :data:`UPLOADED_TTL_S` (one found present is checked again next time:
  gc removes old ones). A parent found absent (gc removed it, or its object
  is broken) that the local tier holds is uploaded again from it, with its
  absent ancestors, parents first, before the batch. One the local tier
  no longer holds (or holds under another namespace, or whose delete is
  being retracted here) is counted in :attr:`AncestorRepair.missing`, and
  the children go anyway.
* A parent found absent whose object a retraction took (its tombstone is
  there: :mod:`ucm_db.remote.tombstones`; one more read per absent parent)
  is never uploaded again, whatever the local tier holds: gc'd (old) and
  retracted (wrong KV) look the same, and a node that had promoted the
  block before another node's void re-published the wrong block to the
  fleet. Nor is anything under it: the batch's blocks whose parent chain
  meets it leave the queue without an upload
  (:attr:`AncestorRepair.dropped`): computed over the retracted block, they
  are wrong too. Counted in :attr:`AncestorRepair.retracted`.
* An ancestor found absent whose upload a provisional put holds (its tag
  not settled: :mod:`ucm_db.index.provisional`) is not uploaded, and what
  hangs under it stays queued for a later batch, without an error: the
  settle queues it, or a sweep deletes it with what hangs under it.
* An ancestor found absent is uploaded again only where still no object
  is (an exclusive write; a broken one is replaced). One there by then is
  another writer's (another node's re-upload, or the voiding node's
  recomputed block: tests/remote/test_review_uploads_tombstone_reread.py):
  it stays, and what hangs under the key here is dropped, as under a
  retracted block (counted in :attr:`AncestorRepair.taken`).
* An ancestor uploaded again has its tombstone read once more after its
  upload landed: a void on another node may have written the tombstone
  between the check and the landing (and found nothing to delete). Seen, the
  upload is deleted again, if the object is still the one this process
  wrote (its first bytes read back: a recomputed block that replaced it
  stays), and taken as retracted; a tombstone written after that read comes
  before its own node's delete, which takes the upload (the audit:
  tests/remote/test_audit_uploads_tombstone_race.py). The read and the
  delete are owed until they succeed: retried before each later batch,
  holding back what hangs under the key (as a failed check) meanwhile (a
  failed read used to be a failed upload only: the next batch found the
  voided block present and sent its children under it).

Cost per batch: two requests per distinct batch-root parent not uploaded here within :data:`UPLOADED_TTL_S`
(ranged GETs of its first bytes and its stated end, on the upload pool; one for an object smaller than the
first read), plus four per ancestor found absent (its check, its
tombstone's, its upload, its tombstone's again; and a head read and a delete
where that tombstone is there). A batch continuing this process's recent
uploads (a conversation's next turn) checks nothing.

Round trips: absent ancestors are found a round of checks at a time, each
round checking every chain further up at once: 1 level, then 2, 4, ... up
to ``upload_concurrency`` levels a round (shared among the chains). A long
absent chain costs about ``2 / upload_concurrency`` round trips of checks
per level (at most one round's checks are wasted above a present
ancestor). Uploads then go a level per round trip, parents first, so a
failed upload never leaves a hole the next batch's check would not see.

Invariants:
    * Nothing of a batch goes before the ancestors it needs: a batch root
      whose parent chain met a failed check or upload stays queued (with its
      descendants in the batch) for a later batch.
    * Only blocks of the local tier are sent, each read in its own upload
      call (memory: ``upload_concurrency`` blocks at a time).
    * A block whose delete is being retracted is never sent again
      (:mod:`ucm_db.remote.retraction`).
    * Within a batch, uploads run at once (shallower first): ``gc`` reads a
      parent landing after its listing (:func:`ucm_db.remote.gc_listing.landed_parents`).

Not covered: a gc that listed before a batch landed and removes the
parent its check found after the check (the batch lands under nothing; the
window is one batch's upload). A process killed or closed between an
ancestor's upload and its second tombstone read (or with it or its delete
owed) leaves the upload on the remote; a recomputed upload landing between
the undo's read and its delete is deleted (a miss, never a wrong block).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from ucm_db.errors import CorruptBlockError
from ucm_db.index.entries import BlockMeta
from ucm_db.index.local import LocalTier
from ucm_db.remote.object_reads import object_is_whole
from ucm_db.remote.tier import PROBE_BYTES, DirSyncs, RemoteRoot, RemoteTier, parse_envelope
from ucm_db.remote.tombstones import has_tombstone
from ucm_db.remote.upload_plan import Item, Repair, read_items, under

#: A key this process uploaded is taken for present without a check this
#: long: a gc rule takes no object this young but a ``--older-than`` under
#: it (or a ``--max-bytes`` that has removed every older tail).
UPLOADED_TTL_S = 60.0
#: Keys remembered as uploaded (the oldest are forgotten first).
MAX_REMEMBERED = 1 << 16

#: Runs calls on the upload pool; their errors (None: success), or None when stopping.
Runner = Callable[[list[Callable[[], str | None]]], list[str | None] | None]


#: A check's answers (a failed one's error is in ``_Walk.failed`` once settled, ``_Walk.errors`` before).
_PRESENT, _ABSENT, _TOMBSTONED, _FAILED = "present", "absent", "tombstoned", "failed"


@dataclass(slots=True)
class _Walk:
    """What :meth:`AncestorRepair.before_batch` learnt so far about the
    ancestors it walks."""

    outcome: dict[bytes, str] = field(default_factory=dict)  # checked key -> its answer (_PRESENT ...)
    errors: dict[bytes, str] = field(default_factory=dict)  # the errors of the failed checks
    metas: dict[bytes, BlockMeta | None] = field(default_factory=dict)  # local metas read
    settled: set[bytes] = field(default_factory=set)  # keys whose answer was applied
    retracted_here: set[bytes] = field(default_factory=set)  # absent keys this node's delete retracted
    absent: dict[bytes, BlockMeta] = field(default_factory=dict)  # absent from the remote, held here: to upload
    failed: dict[bytes, str] = field(default_factory=dict)  # failed check or upload -> its error
    retracted: set[bytes] = field(default_factory=set)  # tombstoned (and absent ones under them): never to upload
    broken: set[bytes] = field(default_factory=set)  # checked keys holding a broken object: replaced when uploaded
    held: set[bytes] = field(default_factory=set)  # absent keys whose upload a provisional put holds
    waiting: set[bytes] = field(default_factory=set)  # held ones met (and absent ones under them): wait for a settle


class AncestorRepair:
    """Uploads again the absent ancestors of a batch (see the module
    docstring); counters for :func:`ucm_db.remote.uploader.describe`.

    Args:
        local: the local tier the ancestors are read from.
        remote: where they go.
        upload: uploads one item through a tier (the uploader's; None or an error).
        run: runs calls on the upload pool (the uploader's).
        concurrency: the upload concurrency (how far ahead a round checks).
    """

    def __init__(self, local: LocalTier, remote: RemoteRoot, *, upload: Callable[[Item, RemoteTier], str | None], run: Runner,
                 concurrency: int = 1) -> None:
        self.local, self.remote = local, remote
        self._upload, self._run = upload, run
        #: Checks one round makes at most (beyond one per frontier key): the upload concurrency.
        self.concurrency = concurrency
        self._lock = threading.Lock()
        self._uploaded: dict[bytes, float] = {}  # key -> monotonic time this process uploaded it
        #: This process's ancestor uploads whose tombstone read (or undo) is owed: key -> (namespace id, head written).
        self._owed: dict[bytes, tuple[bytes, bytes]] = {}
        #: Parents checked on the remote (two requests each, one where the first read is the whole object).
        self.checks = 0
        #: Ancestors found absent from the remote and uploaded again from the local tier.
        self.reuploaded = 0
        #: Absent ancestors the local tier could not give: their children went without them.
        self.missing = 0
        #: Absent ancestors a retraction took (a tombstone): never uploaded again, nor what hangs under them.
        self.retracted = 0
        #: Queued blocks left out of their batches, never uploaded: their parent chain meets a retracted block.
        self.dropped = 0
        #: Absent ancestors another writer put back before this process's upload of them: left as they are.
        self.taken = 0

    def remember(self, keys: Iterable[bytes]) -> None:
        """Records keys this process has just uploaded (present without a check for a while)."""
        now_s = time.monotonic()
        with self._lock:
            for key in keys:
                self._uploaded.pop(key, None)  # re-inserted last: the dict stays oldest first
                self._uploaded[key] = now_s
            while len(self._uploaded) > MAX_REMEMBERED:
                del self._uploaded[next(iter(self._uploaded))]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Checks ``keys`` again next time (their upload is not durable)."""
        with self._lock:
            for key in keys:
                self._uploaded.pop(key, None)

    def _known(self, key: bytes) -> bool:
        with self._lock:
            uploaded_s = self._uploaded.get(key)
        return uploaded_s is not None and time.monotonic() - uploaded_s < UPLOADED_TTL_S

    def before_batch(self, work: Sequence[Item], run: Runner | None = None, syncs: DirSyncs | None = None,
                     ) -> Repair | None:
        """Checks the parents of ``work``'s batch roots and uploads the
        absent ones the local tier holds, parents first; None when asked to
        stop (nothing of the batch may go then). ``run``: the runner of its
        remote calls (default: the uploader's); ``syncs``: the batch's
        directory fsyncs (:class:`~ucm_db.remote.files.DirSyncs`)."""
        run = run or self._run
        with self._lock:
            owed = list(self._owed.items())
        if owed and run([partial(self._settle_upload, key, ns, head, set()) for key, (ns, head) in owed]) is None:
            return None
        in_batch = {item[0] for item in work}
        frontier = {item[1]: item[2] for item in work if item[1] is not None and item[1] not in in_batch
                    and not self._known(item[1])}
        walk = _Walk(waiting=self.local.uploads.held(list(frontier)))  # held parents: no remote check, they wait
        frontier, depth = {key: ns for key, ns in frontier.items() if key not in walk.waiting}, 1
        while frontier:
            wanted = self._ahead(frontier, max(1, min(depth, self.concurrency // len(frontier))), walk)
            if self._absent(wanted, walk, run) is None:
                return None
            frontier = self._settle(frontier, walk)
            depth *= 2  # a chain absent this deep is likely absent deeper: check further ahead next round
        absent, failed, retracted = walk.absent, walk.failed, walk.retracted
        if absent and self._send(walk, run, syncs) is None:
            return None
        dropped = under(work, absent, retracted)
        self.dropped += len(dropped)
        waiting = under(work, absent, walk.waiting) - dropped
        return Repair((under(work, absent, failed) - dropped) | waiting, list(dict.fromkeys(failed.values())), dropped,
                      frozenset(absent.keys() - failed.keys() - retracted), waiting)

    def _ahead(self, frontier: dict[bytes, bytes], depth: int, walk: _Walk) -> dict[bytes, bytes]:
        """The keys to check this round: each frontier key and up to
        ``depth - 1`` of its ancestors above it (read from the local tier),
        short of one known uploaded, already checked, or not held here
        under the namespace: key -> namespace id. Those above an ancestor
        found present are checked for nothing (their answers are never
        used: :meth:`_settle`), a request each, in exchange for one round
        trip per ``depth`` levels of a long absent chain."""
        wanted = {key: ns for key, ns in frontier.items() if key not in walk.outcome}
        tips = dict(wanted)
        for _ in range(depth - 1):
            metas = self.local.metas(list(tips))
            walk.metas.update(zip(tips, metas))
            tips = {meta.parent: ns for (key, ns), meta in zip(tips.items(), metas)
                    if meta is not None and meta.namespace_id == ns and meta.parent is not None
                    and meta.parent not in wanted and meta.parent not in walk.outcome and not self._known(meta.parent)}
            wanted.update(tips)
        return wanted

    def _settle(self, frontier: dict[bytes, bytes], walk: _Walk) -> dict[bytes, bytes]:
        """Walks up from each frontier key through the checked keys, as the
        checks found them: an absent block held here is to upload and its
        parent is walked next; a present, failed, tombstoned or unheld one
        ends its chain. Returns the next frontier (parents not yet checked)."""
        found = [key for key, outcome in walk.outcome.items() if outcome != _PRESENT and key not in walk.settled]
        unread = [key for key in found if key not in walk.metas]
        walk.metas.update(zip(unread, self.local.metas(unread)))
        walk.retracted_here |= self.local.uploads.retracted(found)
        walk.held |= self.local.uploads.held(found)
        following: dict[bytes, bytes] = {}
        for start, namespace_id in frontier.items():
            key: bytes | None = start
            while key is not None and key not in walk.settled:
                if key not in walk.outcome:  # beyond this round's checks
                    following[key] = namespace_id
                    break
                walk.settled.add(key)
                key = self._settle_one(key, namespace_id, walk)
        return following

    def _settle_one(self, key: bytes, namespace_id: bytes, walk: _Walk) -> bytes | None:
        """Applies the check of ``key``; the parent to walk next, if any."""
        outcome, meta = walk.outcome[key], walk.metas.get(key)
        if outcome == _PRESENT:
            return None
        if outcome == _FAILED:  # what hangs under it waits for a later batch
            walk.failed[key] = walk.errors[key]
        elif key in walk.held:  # provisional (index/provisional.py), recomputed after a retraction too: waits
            walk.waiting.add(key)
        elif key in walk.retracted_here:  # this node's delete took its tree: what it queued since is computed anew
            self.missing += 1
        elif outcome == _TOMBSTONED:
            self.retracted += 1
            walk.retracted.add(key)
        elif meta is None or meta.namespace_id != namespace_id:
            self.missing += 1
        else:
            walk.absent[key] = meta
            if meta.parent is not None and not self._known(meta.parent):
                return meta.parent
        return None

    def _absent(self, wanted: dict[bytes, bytes], walk: _Walk, run: Runner) -> bool | None:
        """Checks ``wanted`` (key -> namespace id) at once, recording each
        answer in ``walk.outcome``; None when stopping."""
        present: dict[bytes, bool] = {}
        tombstoned: set[bytes] = set()
        calls: list[Callable[[], str | None]] = [partial(self._check, key, namespace_id, present, tombstoned, walk.broken)
                                                 for key, namespace_id in wanted.items()]
        results = run(calls)
        if results is None:
            return None
        self.checks += len(calls)
        for key, error in zip(wanted, results):
            if error is not None:
                walk.outcome[key], walk.errors[key] = _FAILED, error
            elif key in self._owed:  # this process put it back and has not read its tombstone (or deleted it) yet
                walk.outcome[key], walk.errors[key] = _FAILED, f"block {key.hex()[:16]}: reading its tombstone again after " \
                                                               "its re-upload (or deleting it) failed"
            elif present.get(key):
                walk.outcome[key] = _PRESENT
            else:
                walk.outcome[key] = _TOMBSTONED if key in tombstoned else _ABSENT
        return True

    def _check(self, key: bytes, namespace_id: bytes, present: dict[bytes, bool], tombstoned: set[bytes],
               broken: set[bytes]) -> str | None:
        """Reads ``key``'s object's first bytes and stated end: present if it is whole and of this namespace (a
        broken one, in ``broken``, is replaced, as gc would remove it); if not, whether a tombstone is there."""
        path = self.remote.object_path(namespace_id, key)
        head = self.remote.read_range(path, 0, PROBE_BYTES)
        try:
            found = head is not None and parse_envelope(head, key)[1] == namespace_id and \
                object_is_whole(self.remote, path, key, head, PROBE_BYTES)
        except CorruptBlockError:
            found = False
        if head is not None and not found:
            broken.add(key)
        if not found and has_tombstone(self.remote, namespace_id, key):
            tombstoned.add(key)
        present[key] = found  # last: a check that raised is a failure, not an absence
        return None

    def _send(self, walk: _Walk, run: Runner, syncs: DirSyncs | None) -> bool | None:
        """Uploads ``walk.absent`` level by level, shallowest first, each
        where still no object is (a broken one is replaced); a block over a
        failed one does not go, nor one over a retracted one or another
        writer's (it joins ``walk.retracted``), nor one over a held one
        (it joins ``walk.waiting``). None when stopping."""
        absent, failed, retracted = walk.absent, walk.failed, walk.retracted
        for depth in sorted({meta.depth for meta in absent.values()}):
            level = [key for key, meta in absent.items() if meta.depth == depth]
            for key in level:
                parent = absent[key].parent
                if parent is not None and parent in failed:
                    failed[key] = failed[parent]
                elif parent is not None and parent in retracted:
                    retracted.add(key)
                elif parent is not None and parent in walk.waiting:
                    walk.waiting.add(key)
            level = [key for key in level if key not in failed and key not in retracted and key not in walk.waiting]
            tiers = {key: self.remote.tier(absent[key].namespace_id, exclusive=key not in walk.broken, syncs=syncs)
                     for key in level}
            gone: set[bytes] = set()
            results = run([partial(self._send_one, key, tiers[key], gone) for key in level])
            if results is None:
                return None
            failed.update((key, error) for key, error in zip(level, results) if error is not None)
            landed = [key for key in level if key not in failed and key not in gone]
            taken = {key for key in landed if tiers[key].stored_head is None}  # another writer's object was there
            heads = {key: head for key in landed if (head := tiers[key].stored_head) is not None}
            undone: set[bytes] = set()
            results = run([partial(self._settle_upload, key, absent[key].namespace_id, head, undone)
                           for key, head in heads.items()])
            if results is None:
                return None
            failed.update((key, error) for key, error in zip(heads, results) if error is not None)
            retracted |= undone | taken
            self.retracted += len(undone)
            self.taken += len(taken)
            sent = [key for key in heads if key not in undone and key not in failed]
            self.reuploaded += len(sent)
            self.missing += len(gone)  # gone since the walk: its children go without it
            self.remember(sent)
        return True

    def _settle_upload(self, key: bytes, namespace_id: bytes, head: bytes, undone: set[bytes]) -> str | None:
        """After this process's upload of ancestor ``key`` landed (``head``:
        the first bytes it wrote): reads its tombstone again and, where one
        is there now, deletes the upload if the object still starts with
        ``head`` (another writer's stays), adding ``key`` to ``undone``.
        Owed, and retried before each batch, until the read and the delete
        succeed (module docstring); a failure raises."""
        with self._lock:
            self._owed[key] = (namespace_id, head)
        if has_tombstone(self.remote, namespace_id, key):
            tier = self.remote.tier(namespace_id)
            if self.remote.read_range(tier.path(key), 0, len(head)) == head:
                tier.delete([key])
            undone.add(key)
        with self._lock:
            self._owed.pop(key, None)
        return None

    def _send_one(self, key: bytes, tier: RemoteTier, gone: set[bytes]) -> str | None:
        item = read_items(self.local, [key])[0]
        if item is None:
            gone.add(key)
            return None
        return self._upload(item, tier)
