"""What the scheduler side remembers about each request.

One :class:`RequestState` per request the scheduler has looked up, shared by
the facade (:mod:`ucm_db.connector.scheduler.hooks`), the lookups
(:mod:`ucm_db.connector.scheduler.lookups`), the step planner
(:mod:`ucm_db.connector.scheduler.planner`) and, through rewinds, the settlement of
held saves (:mod:`ucm_db.connector.scheduler.settlement`).

Invariants:
    * ``keys`` is the request's block key chain rooted at ``epoch``, grown
      on demand and never rehashed (:func:`~ucm_db.connector.request_keys.chain_keys`).
    * ``stored_blocks <= saved_blocks``: the blocks known stored come
      first, then the ones planned for saving; both move back only through
      a rewind (a failed load, a voided save, a preemption).
      ``committed_blocks``: the leading blocks whose saves were ever planned
      (a ``kv_producer`` commits them within their step, so they are its
      publication); a failed load or a voided save moves it back, a
      preemption does not (it drops only saves not yet copied, and a
      producer's are copied and committed within their step).
    * Under vLLM's async scheduling every claim is async
      (:meth:`RequestState.claims_async`), and after a failed async load a
      request claims no further than the block that failed
      (``claim_limit``): its claims cannot fail the same way forever.
    * ``lookup`` is read (and cleared) only by the
      ``update_state_after_alloc`` that follows the lookup that set it,
      which keeps it as ``claimed``: vLLM asks the claim's hit sources
      (:func:`hit_sources`) after that allocation.
    * ``controls`` are parsed once, when the state is made
      (:mod:`ucm_db.connector.request_controls`; a streaming-session
      update makes it anew with the chunk's controls, an earlier chunk's
      ``save: false`` holding); ``sighted_blocks``,
      ``admitted_blocks`` and ``admission_checked_blocks`` (admission,
      ``admit_after``) only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ucm_db.connector.composition import forget_ucm_db_load
from ucm_db.connector.fingerprints import lora_int_id
from ucm_db.connector.request_controls import RequestControls
from ucm_db.keys import BlockKeys

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class LookupRecord:
    """The result of the last lookup of a request, for the
    ``update_state_after_alloc`` that follows it."""

    local_tokens: int   # vLLM's own prefix-cache hit the lookup was given
    hit_blocks: int     # leading blocks claimed (0 where the cost model judged loading slower)
    unit_blocks: int    # leading blocks stored (>= hit_blocks)
    seconds: float
    looked_up: bool = True  # False: the request's controls left nothing to load (load off, max_load_tokens below a block)


@dataclass
class RequestState:
    """What the scheduler side remembers about one request."""

    request: Request
    extras: dict[str, Any]        # root extras of the key chain
    block_extras: dict[int, bytes]  # per-block extras, by block index
    epoch: int | None = 0         # the namespace epoch the key chain is rooted at (epochs.py)
    keys: BlockKeys = field(default_factory=BlockKeys)  # the request's block keys, grown on demand
    stored_blocks: int = 0  # leading blocks whose units are known stored
    saved_blocks: int = 0   # leading blocks stored or planned for saving
    committed_blocks: int = 0  # leading blocks ever planned for saving (module invariants; a producer's publication)
    claim_limit: int | None = None  # blocks: its async load failed at this one, no claim goes further
    pending_load_tokens: int = 0
    lookup: LookupRecord | None = None
    claimed: LookupRecord | None = None  # the record the last allocation took (hit_sources)
    async_tried: bool = False  # an async load was planned: later lookups claim synchronously (claims_async)
    async_block_ids: tuple[int, ...] = ()  # the blocks of its async load, until vLLM schedules it
    vllm_computed_tokens: int = 0  # what vLLM's own prefix cache held at the last lookup: no claim prices it
    lookup_computed_tokens: int | None = None  # the same, until the step after the lookup (composition.py)
    async_claimed: bool = False  # the last lookup's allocation was our async load: its blocks are no sibling's
    remote_asked: bool = False    # its background remote lookup finished
    remote_probing: bool = False  # its background job is a probe
    remote_probed: bool = False   # its background probe finished
    remote_job_first: int = 0     # first block its background remote lookup asked for
    first_remote_block: int | None = None  # blocks from here on were fetched from the remote tier (hit sources)
    prompt_tokens: int = -1       # the request's prompt length and multimodal items when this state was made:
    mm_items: int = -1            # a streaming-session update changes them (and the tokens after the computed ones)

    def start_lookup(self, num_computed_tokens: int) -> None:
        """A new lookup, vLLM holding ``num_computed_tokens``: what another
        connector loads from there is told apart from this one's loads anew
        (composition.py), whatever an earlier lookup claimed (``async_tried``
        stays: it decides how this lookup claims)."""
        self.lookup_computed_tokens = num_computed_tokens
        self.async_claimed = False
        self.first_remote_block = None  # blocks an earlier lookup fetched are local now (a preempted request's)
        forget_ucm_db_load(self.request.request_id)

    def claims_async(self, first_async: bool, every_async: bool) -> bool:
        """Whether a claim of this request loads asynchronously: every one
        under vLLM's async scheduling (``every_async``: a sync load that
        fails while the next step is in flight leaves vLLM's tokens and the
        KV apart); with ``load_mode: "async"`` (``first_async``) its first
        only: a failed async load sends the request back with nothing
        computed and vLLM asks again, and an async claim of the same blocks
        could fail the same way forever, where a sync one is recomputed."""
        return every_async or (first_async and not self.async_tried)

    def claimable_blocks(self, block_size: int, max_blocks: int, num_computed_tokens: int) -> int:
        """Leading blocks a claim may reach: what its controls allow
        (:meth:`RequestControls.claimable_blocks`), never past ``claim_limit``."""
        claimable = self.controls.claimable_blocks(block_size, max_blocks, num_computed_tokens)
        return claimable if self.claim_limit is None else min(claimable, self.claim_limit)

    def rewind(self, block_size: int, save_start: int | None) -> None:
        """Moves the stored, saved and committed marks back to the blocks
        vLLM still counts as computed (and before a voided save at ``save_start``)."""
        computed = self.request.num_computed_tokens // block_size
        kept = computed if save_start is None else min(computed, save_start)
        self.stored_blocks = min(self.stored_blocks, computed)
        self.saved_blocks, self.committed_blocks = min(self.saved_blocks, kept), min(self.committed_blocks, kept)

    def stale_for(self, request: Request) -> bool:
        """True when a streaming-session update changed the request since
        this state was made (vLLM 0.32 resumable requests: new prompt tokens,
        new multimodal items, the last sampled token dropped): its key chain
        and block extras must be made anew, or a block would be saved under
        the key of tokens or items it no longer holds. Made anew without a
        lookup, the state keeps this one's epoch (``UcmDbScheduler._state``):
        its KV was computed then, and a reset since saves none of it."""
        return self.prompt_tokens != request.num_prompt_tokens or self.mm_items != len(request.mm_features or ())
    controls: RequestControls = field(default_factory=RequestControls)  # the request's own (kv_transfer_params)
    sighted_blocks: int = 0   # leading blocks whose sighting the admission sketch counted
    admitted_blocks: int = 0  # leading blocks admitted for storing (admit_after)
    admission_checked_blocks: int = 0  # the end at which admission last read the sketch's counts


def hit_sources(state: RequestState | None, num_external_tokens: int, block_size: int) -> dict[str, int]:
    """``num_external_tokens`` of the request's last claim split by the tier
    that supplied them: ``"disk"`` (the local tier: LMDB's file, read
    through the page cache) and ``"remote"`` (fetched from the remote tier
    by the request's lookups); only non-zero counts. Asked before or after
    the claim's ``update_state_after_alloc`` (vLLM 0.32 asks after)."""
    if num_external_tokens <= 0:
        return {}
    record = None if state is None else state.lookup if state.lookup is not None else state.claimed
    if state is None or record is None:
        return {"disk": num_external_tokens}
    first = record.local_tokens
    remote_from = (first + num_external_tokens if state.first_remote_block is None
                   else max(first, state.first_remote_block * block_size))
    disk = max(0, min(first + num_external_tokens, remote_from) - first)
    return {name: count for name, count in (("disk", disk), ("remote", num_external_tokens - disk)) if count}


def adapter_claim(state: RequestState) -> tuple[int, str] | tuple[()]:
    """A LoRA request's ``(lora_int_id, adapter key)`` as its chain names the
    adapter: what a worker checks its saves against (lora_loads.py); () without one."""
    lora_request, key = state.request.lora_request, state.extras.get("lora")
    if lora_request is None or not isinstance(key, str):
        return ()
    return lora_int_id(lora_request), key
