"""The scheduler's prefix lookups: how many leading blocks of a request are
stored, from the local tier and, as the cost model prices it, the remote.

Invariants:
    * A block counts only if every unit of the deployment's reader spans is
      stored (:func:`ucm_db.keys.units.stored_prefix`); keys are hashed no
      further than needed: a first segment of :data:`FIRST_SEGMENT_BLOCKS`
      is hashed and looked up alone, the rest of the prompt only if all of
      it is stored.
    * The local tier is asked first and alone (:class:`LocalTierStore`);
      the remote only for what it lacks, and only as the cost model decides
      (all of the claim, a probe of :data:`PROBE_BLOCKS` blocks, or nothing).
      An inline remote lookup promotes what it finds into the local tier and
      is timed: its rate is the remote's sample, and its seconds are taken
      out of the step's prefill sample (:attr:`PrefixLookup.remote_lookup_s`).
    * ``remote_lookup: "background"`` (remote_lookups.py): a priced remote
      lookup submits one background job per request instead, for the whole
      claim, through :class:`BackgroundDeadlineStore`, and raises
      :class:`LookupPending` (vLLM asks again next step) until it has
      finished; the remote is then not asked again for that request, whose
      hit is found in the local tier. A probe job is followed by one more
      decision for the rest of the prompt, now measured. A job's time is a
      remote sample but not part of any step's time.
    * The blocks a step plans to load are touched here, in the scheduler's
      process (:meth:`PrefixLookup.touch`), never by the workers that read
      them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ucm_db
from ucm_db.connector.scheduler.cost_model import CostModel, Decision
from ucm_db.connector.metadata import IDLE_WAIT_S
from ucm_db.connector.scheduler.remote_lookups import BACKGROUND_DEADLINE_S, RemoteLookups
from ucm_db.connector.scheduler.request_state import RequestState
from ucm_db.keys import Namespace
from ucm_db.keys.units import KVGrid, UnitSpan, stored_prefix, unit_keys_of

#: Blocks hashed and looked up first; the rest of the prompt follows only if all are stored.
FIRST_SEGMENT_BLOCKS = 16
#: Blocks a probe of a tier the cost model cannot judge asks for: one first
#: lookup segment. A probe's time is mostly the lookup's fixed cost (fetch
#: round trips, promotion commit); 4 blocks measured a 2 GB/s link below a
#: small model's prefill rate on a fast host, so a fast remote was never loaded.
PROBE_BLOCKS = FIRST_SEGMENT_BLOCKS


def first_remote(state: RequestState, block: int) -> int:
    """The request's first block fetched from the remote tier, a fetch from
    ``block`` on just made (block 0 is a block, not none)."""
    return block if state.first_remote_block is None else min(block, state.first_remote_block)


class LookupPending(Exception):
    """A background remote lookup of the request is still running."""


class BackgroundDeadlineStore:
    """A store adapter whose ``lookup`` waits up to
    :data:`~ucm_db.connector.scheduler.remote_lookups.BACKGROUND_DEADLINE_S` on the
    remote: off the serving path, a lookup need not be cut at the store's
    ``remote_deadline_s`` (made short so an inline lookup never holds the
    engine up)."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store

    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        return self._store.lookup(namespace, keys, remote_deadline_s=BACKGROUND_DEADLINE_S)


class LocalTierStore:
    """A store adapter whose ``lookup`` looks at the local tier only."""

    def __init__(self, store: ucm_db.Store) -> None:
        self._store = store

    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        return self._store.lookup(namespace, keys, remote=False)


class PrefixLookup:
    """Priced prefix lookups of one namespace (module invariants)."""

    def __init__(
        self, store: ucm_db.Store, namespace: Namespace, grid: KVGrid, spans: Sequence[UnitSpan], block_size: int,
        cost: CostModel, keys: Callable[[RequestState, int], Sequence[bytes]], background: bool,
    ) -> None:
        self._store = store
        self._namespace = namespace
        self._ns_id = namespace.id.hex()
        self._grid = grid
        self._spans = list(spans)
        self._block_size = block_size
        self._cost = cost
        self._keys = keys  # the request's block keys, grown on demand (request_keys.chain_keys)
        self._local = LocalTierStore(store)
        #: remote_lookup="background": remote fetches off the scheduler's thread (remote_lookups.py)
        self.lookups = RemoteLookups() if background and store.config.remote is not None else None
        #: Total seconds of timed (inline) remote lookups.
        self.remote_lookup_s = 0.0
        #: The last step scheduled no tokens: a pending background lookup may be waited for a little.
        self.last_step_idle = False

    def longest_stored_prefix(self, state: RequestState, max_blocks: int) -> int:
        """Leading blocks with every unit stored, hashing no further than
        needed: the first segment is hashed and looked up alone, the rest of
        the prompt only if all of it is stored. A miss costs one small
        segment, not the prompt; a hit costs two lookups (each a binary
        search plus a probe per further unit: the prefix invariant makes a
        segment's count exact). Raises :class:`LookupPending`."""
        return self._segments(state, max_blocks, lambda keys, start, stop: self._priced_prefix(state, keys, start, stop, max_blocks))

    def locally_stored_prefix(self, state: RequestState, max_blocks: int) -> int:
        """Leading blocks with every unit in the local tier, asked of the
        local tier alone (no remote, no pricing, nothing timed): for a
        request vLLM's own cache serves whole, whose stored blocks need no
        second save."""
        return self._segments(state, max_blocks, lambda keys, start, stop: stored_prefix(
            self._local, self._namespace, self._grid, self._spans, keys, start, stop))

    def _segments(self, state: RequestState, max_blocks: int, segment: Callable[[Sequence[bytes], int, int], int]) -> int:
        """``segment(keys, start, stop)`` (blocks stored from ``start``) over
        the first segment, then the rest of the prompt if all of it is stored."""
        found, want = 0, min(max_blocks, FIRST_SEGMENT_BLOCKS)
        while True:
            keys = self._keys(state, want)
            found += segment(keys, found, want)
            if found < want or want == max_blocks:
                return found
            want = max_blocks

    def _priced_prefix(self, state: RequestState, keys: Sequence[bytes], start: int, stop: int, max_blocks: int) -> int:
        """:func:`stored_prefix` from the local tier, continued from the
        remote as far as the cost model decides (all, a probe of
        :data:`PROBE_BLOCKS` blocks, or nothing); the remote lookup (which
        promotes what it finds) is timed to measure the remote's rate. The
        claim priced is what the remote could supply of the prompt's
        ``max_blocks``: the rest of the prompt past what vLLM's own prefix
        cache and the local tier hold, in this lookup and, for a first
        segment, the next one. With background lookups the remote is
        asked once per request, for the whole claim, and
        :class:`LookupPending` is raised until it has finished."""
        if self.lookups is not None:
            self._harvest(state)
        spans = self._spans
        local = stored_prefix(self._local, self._namespace, self._grid, spans, keys, start, stop)
        if self._store.config.remote is None or start + local >= stop or state.remote_asked:
            return local
        first_token = max((start + local) * self._block_size, state.vllm_computed_tokens)
        claim_tokens = max(0, max_blocks * self._block_size - first_token)
        # One lookup brings the claim in the background (it covers the rest of
        # the prompt) or for a last segment; a first segment's claim takes two.
        lookups = 1 if self.lookups is not None or stop >= max_blocks else 2
        decision = self._cost.decide(self._ns_id, "remote", tokens=claim_tokens, lookups=lookups, first_position=first_token)
        if decision is Decision.SKIP:
            return local
        if decision is Decision.PROBE:
            stop = min(stop, start + local + PROBE_BLOCKS)
        if self.lookups is not None:
            self._submit(state, decision, start + local, stop, max_blocks)
            return local  # not reached where a job was submitted (LookupPending)
        started = time.perf_counter()
        found = stored_prefix(self._store, self._namespace, self._grid, spans, keys, start + local, stop)
        elapsed_s = time.perf_counter() - started
        if found:
            state.first_remote_block = first_remote(state, start + local)
        self.remote_lookup_s += elapsed_s
        self._cost.observe_load(self._ns_id, "remote", found * self._block_size, elapsed_s)
        return local + found

    def _submit(self, state: RequestState, decision: Decision, first: int, stop: int, max_blocks: int) -> None:
        """Submits the request's background remote lookup and raises
        :class:`LookupPending`; returns where a probe was already made."""
        assert self.lookups is not None
        if decision is Decision.PROBE:
            if state.remote_probed:  # one probe per request: then decided, or left alone
                state.remote_asked = True
                return
            state.remote_probing = True
        job_stop = stop if decision is Decision.PROBE else max_blocks
        chain = self._keys(state, job_stop)[:job_stop]  # a snapshot: the scheduler grows state.keys meanwhile
        store, namespace, grid, spans = BackgroundDeadlineStore(self._store), self._namespace, self._grid, self._spans
        state.remote_job_first = first
        self.lookups.submit(state.request.request_id, lambda: stored_prefix(store, namespace, grid, spans, chain, first, job_stop))
        raise LookupPending

    def _harvest(self, state: RequestState) -> None:
        """Takes a finished background lookup's result into the cost model
        (its time is the request's wait, not a step's); raises
        :class:`LookupPending` while it runs, after waiting up to
        :data:`~ucm_db.connector.metadata.IDLE_WAIT_S` for it when the last
        step had nothing to run (the engine would only spin meanwhile)."""
        assert self.lookups is not None
        job_key = state.request.request_id
        if self.lookups.pending(job_key):
            if self.last_step_idle:
                self.last_step_idle = False  # one wait per idle step, not one per waiting request
                self.lookups.wait(job_key, IDLE_WAIT_S)
            if self.lookups.pending(job_key):
                raise LookupPending
        result = self.lookups.take(job_key)
        if result is not None:
            self._cost.observe_load(self._ns_id, "remote", result.found_blocks * self._block_size, result.elapsed_s)
            if result.found_blocks:  # promoted into the local tier by now: remembered as the remote's
                state.first_remote_block = first_remote(state, state.remote_job_first)
            if state.remote_probing:  # a probe measured the link: the rest is decided again
                state.remote_probing = False
                state.remote_probed = True
            else:
                state.remote_asked = True

    def touch(self, block_keys: Sequence[bytes]) -> None:
        """Marks every unit of ``block_keys`` the deployment's readers load
        as just read (``Store.touch``), in this process: the scheduler's
        maintenance thread writes their recency, not the workers', whose
        Python would take the GIL from the model's thread (each torch op
        gives it up and must win it back). The touch is written within
        ``sync_interval_s``, or, for a block whose recency was written
        within ``RECENCY_REFRESH_S`` (30 s), once that has passed; a put
        in a worker that evicts before then does not see it, and may take
        a block just loaded (a later request recomputes it: never wrong
        data)."""
        if block_keys:
            self._store.touch(self._namespace, unit_keys_of(block_keys, self._spans, self._grid))

    def forget(self, request_id: str) -> None:
        """Drops the request's background lookup, if any."""
        if self.lookups is not None:
            self.lookups.forget(request_id)

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
