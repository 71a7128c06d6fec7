"""A scheduler's part in prefill/decode publications (:mod:`ucm_db.connector.roles`):
what a ``kv_producer`` announces when a request finishes, and a consumer's
waits for what a producer announced.

Invariants:
    * A producer announces only blocks its store holds when the request
      finishes: the leading blocks of the request's chain with every unit
      of the deployment's readers in the local tier (one lookup), no
      further than its saves committed within their steps, than the
      prompt's whole blocks, or than a block whose void may not have run
      (settlement.py's fences; vLLM finishes a request in the handling of
      a step's output before the connector sees that output, so a fence
      whose void ran in that very step does not cut a request finished by
      it: :data:`FINISHED_BY_OUTPUT`). A save that never landed (dropped over
      ``max_pending_save_bytes``, refused, failed: counted in the worker's
      metrics) is not announced, so no consumer waits ``load_deadline_s``
      for it nor counts it as a publication miss (a read-after-write miss
      is the producer's promise broken, not a lost save).
    * A consumer waits only for blocks its lookup asked for: where the cost
      model left a tier out (judged slower than recomputing), the rest is
      recomputed at once (counted in ``cost_skips``, not as misses).
    * The announcement names the stores holding it
      (:func:`~ucm_db.connector.roles.store_fingerprints`); a consumer
      waits only for one naming a store it reads (roles.py invariants). One
      naming no store any ucm-db connector of this process reads is logged
      once per process (its stores spelled otherwise: docs/pd.md).
    * Under vLLM's MultiConnector a request has one publication: the first
      ucm-db producer child's, with the fewest blocks of every such child
      of its namespace (composition.publish_once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.logger import init_logger

from ucm_db.connector.composition import publish_once
from ucm_db.connector.metrics import Counters
from ucm_db.connector.request_controls import request_params
from ucm_db.connector.roles import PARAMS_KEY, Publication, PublicationWaits
from ucm_db.connector.scheduler.lookups import PrefixLookup
from ucm_db.connector.scheduler.request_state import RequestState
from ucm_db.connector.scheduler.settlement import SaveSettlement

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

#: Statuses vLLM sets only while it handles a step's output (``update_from_output``), finishing the
#: request in it before ``update_connector_output`` (an abort, ``finish_requests``, comes between steps).
FINISHED_BY_OUTPUT = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})
#: The store fingerprints every ucm-db scheduler of this process reads (publications naming none are logged).
_read_stores: set[str] = set()
_told_unread = False


class Publications:
    """One scheduler's publications and publication waits (module invariants)."""

    def __init__(self, ns_id: str, block_size: int, hit_margin: int, keys: Callable[[RequestState, int], Sequence[bytes]],
                 lookup: PrefixLookup, settlement: SaveSettlement, counters: Counters, waits: PublicationWaits,
                 target: str, stores: tuple[str, ...]) -> None:
        """``target``: the producer's ``publish`` setting; ``stores``: the
        fingerprints of the stores this engine reads and writes."""
        self._ns_id = ns_id
        self._block_size = block_size
        self._hit_margin = hit_margin  # blocks a hit gives back (drafts.py)
        self._keys = keys
        self._lookup = lookup
        self._settlement = settlement
        self._counters = counters
        self.waits = waits
        self._target = target
        self._stores = stores
        _read_stores.update(stores)

    def publish(self, owner: object, state: RequestState, group: int = 0) -> dict[str, Any] | None:
        """A producer's ``kv_transfer_params`` for its finished request, or
        None where a sibling ucm-db child of this engine published it first
        (composition.publish_once; ``group``: this scheduler's KV cache group)."""
        request = state.request
        planned = min(max(state.saved_blocks, state.committed_blocks), request.num_prompt_tokens // self._block_size)
        stored = self._lookup.locally_stored_prefix(state, planned) if planned else 0
        in_output = getattr(getattr(request, "status", None), "name", None) in FINISHED_BY_OUTPUT
        blocks = self._settlement.unfenced(self._keys(state, stored), stored, output_back=in_output)
        if blocks < planned:
            logger.info("ucm-db: request %.80s: %d of its %d committed blocks are not in the store (a save dropped, "
                        "refused or voided); %d published", request.request_id, planned - blocks, planned, blocks)
        last_key = self._keys(state, blocks)[blocks - 1].hex() if blocks else ""
        self._counters.add(published_blocks=blocks)
        publication = Publication(self._ns_id, blocks, self._block_size, last_key, self._target, self._stores)
        return publish_once(request, owner, publication.to_params(), PARAMS_KEY, group)

    def await_publication(self, state: RequestState, max_blocks: int, hit: int, claimable: int, skipped: bool = False) -> bool:
        """True: defer the request, a producer announced blocks that are not
        visible yet (of the ``claimable`` first ones) in a store this engine
        reads, and its deadline is ahead (:mod:`ucm_db.connector.roles`).
        ``skipped``: the lookup left a tier out, the cost model judging it
        slower than recomputing (a remote the blocks may be on): what it did
        not ask for is recomputed at once, not waited for, and no miss."""
        request = state.request
        publication = Publication.from_params(request_params(request))  # a session's current chunk's
        if publication is None or not publication.reaches(self._stores):
            if publication is not None:
                _tell_unread(publication)
            return False  # none, or published where this engine does not read: an ordinary lookup
        expected = self.waits.expected(publication, self._ns_id, self._block_size, lambda n: self._keys(state, n), max_blocks)
        expected = min(expected, max_blocks, claimable + self._hit_margin)  # a drafter's hit: one past a cap
        if not skipped and self.waits.decide(request.request_id, expected, hit):
            return True
        waited_s = self.waits.waited_s(request.request_id)
        self.waits.forget(request.request_id)
        if skipped:
            expected = hit  # not a read-after-write miss: this engine chose to recompute them (cost_skips)
        self._counters.add(publication_wait_s=waited_s, publication_misses=max(0, expected - hit))
        if expected > hit:
            logger.warning(
                "ucm-db: request %s: %d of %d announced blocks not visible after %.2f s; the rest is recomputed",
                request.request_id, expected - hit, expected, waited_s,
            )
        return False


def _tell_unread(publication: Publication) -> None:
    """Logs, once per process, a publication naming no store any ucm-db
    connector of this process reads (another child of a MultiConnector may
    read it: not logged then)."""
    global _told_unread
    if _told_unread or publication.reaches(tuple(_read_stores)):
        return
    _told_unread = True
    logger.warning("ucm-db: a producer announced blocks in stores this engine does not read (by their fingerprints), so "
                   "it does not wait for them; where the two share a store, spell its remote alike on both (s3a:// and "
                   "s3:// are taken alike, a file:// directory by its resolved path on each node: mount an NFS export at "
                   "the same path; docs/pd.md) (logged once)")
