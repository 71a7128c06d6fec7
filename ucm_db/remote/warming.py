"""Cache warming: pull what the remote tier has into the local tier.

:func:`warm` takes chains (token sequences, or block keys) of one namespace
and, for each, promotes the remote blocks that extend the local prefix, so
the first real request of a node finds them locally.

Invariants:
    * Warming only adds blocks that verify (envelope and codec checksum,
      owning key, parent chain); a corrupt or missing remote block ends that
      chain's warming (``missing`` counts the rest of the chain).
    * The local prefix invariant holds throughout: each chain is promoted
      from its first missing block, in order, with its parent.
    * Warming never uploads (promoted blocks are not queued).
    * Chains stream in: the remote read pool keeps requests in flight while
      runs of :data:`BATCH_BLOCKS` are promoted; a request slower than
      :data:`BATCH_DEADLINE_S` ends the chain's warming.
    * A remote failure is never reported as absence: the blocks a chain did
      not fetch because a request failed or timed out (its first block's
      probe included) or the read breaker was open count as ``failed``, not
      ``missing``. A failure does not stop the run: the next chain waits out
      the breaker's backoff (an audit saw one transient error skip every
      chain warmed in it, all "missing"), and only after
      :data:`FAILED_CHAINS_LIMIT` chains in a row failed are the rest
      counted ``failed`` without a request (a remote that is down ends the
      run in a few requests, never one timeout per chain).
    * Nothing is fetched before the remote's epoch of the namespace is
      known (:meth:`ucm_db.Store.warm` raises :class:`RemoteEpochUnknownError`
      first): prompts keyed at the local epoch would pull, and promote, the
      blocks another node's invalidation left behind.
    * Finding a namespace on a remote (:func:`remote_namespaces`) never
      fails because of another entry: a stray entry under the root or one
      namespace's missing or broken manifest is reported (a warning and a
      line in ``problems``), and every other namespace is still found.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ucm_db.arguments import key_list, namespaces_selected, require_namespace_selectors
from ucm_db.errors import ConfigError, TierError, UcmDbError
from ucm_db.keys import Namespace
from ucm_db.remote.gc_listing import require_bucket
from ucm_db.remote.link import UNFINISHED, RemoteLink
from ucm_db.remote.promotion import PromotionTarget, promote
from ucm_db.index.local import LocalTier
from ucm_db.remote.search import MAX_BACKOFF_S
from ucm_db.remote.tier import RemoteRoot, remote_failure


_log = logging.getLogger("ucm_db")

BATCH_BLOCKS = 64
BATCH_DEADLINE_S = 30.0
#: Chains in a row whose fetch failed after which a run asks the remote nothing more.
FAILED_CHAINS_LIMIT = 3

#: ``progress(blocks_done, blocks_total)``, called after each batch.
WarmProgress = Callable[[int, int], None]


class RemoteEpochUnknownError(TierError):
    """Warming refused: the remote's epoch of the namespace is not known
    (module invariants); nothing was fetched."""

    @classmethod
    def of(cls, namespace: Namespace, url: str | None, problem: str) -> RemoteEpochUnknownError:
        return cls(f"cannot warm namespace {namespace.id.hex()} ({namespace.model}) from remote {url}: {problem}; keyed at "
                   "this store's epoch, warming could pull blocks another node invalidated, so nothing was fetched",
                   hint="retry once the remote answers (check remote/remote_options, or raise remote_deadline_s for a slow "
                        "first request); with an auth key, a manifest whose epoch no configured key signed is rewritten "
                        "by a keyed store's `ucm-db invalidate PATH --namespace X --remote URL`")


@dataclass(frozen=True, slots=True)
class WarmReport:
    """What a warming run did.

    Attributes:
        already_local: blocks stored locally under the namespace before warming.
        fetched: blocks fetched from the remote and promoted.
        missing: blocks neither local nor fetchable (absent, corrupt, or
            after such a block in their chain).
        bytes: stored (encoded) bytes fetched.
        seconds: wall time of the run.
        failed: blocks not fetched because the remote failed (an error or a
            timeout, or its read breaker open after one): the remote may
            hold them; warm again once it answers.
        evicted: blocks counted ``already_local`` or ``fetched`` that were
            no longer stored under the namespace when the run ended: the
            warm's later blocks evicted them (it asked for more than the
            store's capacity holds) or other writers did.

    Each distinct block the run was given counts once (prompts sharing a
    prefix name it once each) in exactly one of ``already_local``,
    ``fetched``, ``missing`` and ``failed``: fetched where this run promoted
    it, else as its first chain found it. ``evicted`` counts again some of
    the first two.
    """

    already_local: int
    fetched: int
    missing: int
    bytes: int
    seconds: float
    failed: int = 0
    evicted: int = 0

    @property
    def blocks(self) -> int:
        return self.already_local + self.fetched + self.missing + self.failed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blocks": self.blocks}


@dataclass(frozen=True, slots=True)
class RemoteNamespaces:
    """The namespaces a remote describes.

    Attributes:
        url: the remote.
        namespaces: by short id, each from its readable manifest.
        problems: one line per entry skipped (a stray entry, a missing or
            broken manifest, a manifest that describes another namespace).
    """

    url: str
    namespaces: dict[str, Namespace]
    problems: list[str]

    def find(self, wanted: str) -> Namespace:
        """The one namespace whose model is ``wanted``, or else whose id
        (its 32 hex digits, of which the short id is the first 16) starts
        with ``wanted``: a model's name wins over id prefixes, as for the
        store's other commands (:func:`ucm_db.arguments.namespaces_selected`).

        Raises:
            ConfigError: none or several match (the problems are named, since
                the one wanted may be among the skipped entries).
        """
        require_namespace_selectors((wanted,), "warm")
        by_id = {ns.id: ns for ns in self.namespaces.values()}
        found = [by_id[ns_id] for ns_id in sorted(namespaces_selected(wanted, {i: ns.model for i, ns in by_id.items()}))]
        if len(found) == 1:
            return found[0]
        skipped = f"; skipped: {'; '.join(self.problems)}" if self.problems else ""
        raise ConfigError(
            f"{len(found)} namespaces on {self.url} match {wanted!r}{skipped}",
            hint="pass a longer id prefix or the exact model name" if found else
            "check --namespace against `ucm-db inspect` of a store writing there; a broken manifest is rewritten by the next upload",
        )


def remote_namespaces(url: str, options: dict[str, Any] | None = None) -> RemoteNamespaces:
    """Reads every namespace manifest under the remote ``url``.

    A stray entry or a bad manifest is skipped, logged and listed in
    ``problems``; it never hides the other namespaces.

    Raises:
        ConfigError: the URL cannot be opened (unknown protocol, missing
            backend), or names a bucket that does not exist.
        TierError: the remote root cannot be listed.
    """
    root = RemoteRoot.from_url(url, options)
    try:
        manifests, problems = root.manifests()
        if not manifests and not problems:
            require_bucket(root, url)  # a mistyped bucket lists as an empty remote: "0 namespaces match"
    except UcmDbError:
        raise
    except Exception as exc:  # noqa: BLE001 - any listing failure is reported the same way
        failure = remote_failure(exc, url)  # its hint speaks of queued uploads: warm queues nothing
        raise TierError(failure.message, hint="check the URL and the remote options (--option endpoint_url, key, secret) "
                        "and the network; nothing was fetched") from exc
    namespaces: dict[str, Namespace] = {}
    for short_id, manifest in manifests.items():
        where = f"{root.namespace_dir(bytes.fromhex(short_id))}/manifest.json"
        try:
            namespace = Namespace.from_dict(manifest.get("namespace") or {})
        except (UcmDbError, TypeError, ValueError) as exc:
            problem = f"{where}: not a namespace description ({exc}); skipped"
        else:
            if namespace.short_id == short_id:
                namespaces[short_id] = namespace
                continue
            problem = f"{where} describes namespace {namespace.short_id}, not {short_id}; skipped"
        _log.warning("remote %s: %s", url, problem)
        problems.append(problem)
    return RemoteNamespaces(url, namespaces, problems)


def chains_of(
    namespace: Namespace,
    token_sequences: Sequence[Sequence[int]] | None,
    keys: Iterable[bytes] | Iterable[Iterable[bytes]] | None,
    epoch: int = 0,
) -> list[list[bytes]]:
    """Key chains to warm: one per token sequence, rooted at the namespace's
    ``epoch``, plus ``keys`` (one chain given as a flat list of keys, or a
    list of chains; keyed by the caller)."""
    rooted, given = _chains(namespace, token_sequences, keys, epoch)
    return rooted + given


def _chains(
    namespace: Namespace, token_sequences: Sequence[Sequence[int]] | None, keys: Any, epoch: int,
) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """:func:`chains_of`, as (the token sequences' chains, which start at a
    chain root; the caller's key chains, which may start mid-chain)."""
    if token_sequences is None and keys is None:
        raise ConfigError("warm needs token_sequences= or keys=", hint="pass the prompts' token ids, or block keys")
    rooted = [namespace.block_keys(tokens, epoch=epoch) for tokens in token_sequences or []]
    given = _key_chains(keys) if keys is not None else []
    return [chain for chain in rooted if chain], [chain for chain in given if chain]


def _key_chains(keys: Any) -> list[list[bytes]]:
    """``warm``'s ``keys=`` as chains: one chain of keys, or chains of keys.
    Iterators (of keys or of chains) are read, never silently consumed; a
    malformed key or chain is a ConfigError (:func:`ucm_db.arguments.key_list`)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Iterable):
        raise ConfigError(f"warm takes keys= as a list of block keys or a list of chains, got {type(keys).__name__}",
                          hint="pass Namespace.block_keys(tokens), or a list of such chains")
    items = keys if isinstance(keys, Sequence) else list(keys)
    if not items:
        return []
    if isinstance(items[0], (bytes, bytearray, memoryview)):
        return [list(map(bytes, key_list(items, "warm")))]
    return [list(map(bytes, key_list(chain, "warm"))) for chain in items]


def warm(
    tier: LocalTier,
    link: RemoteLink | None,
    namespace: Namespace,
    *,
    token_sequences: Sequence[Sequence[int]] | None = None,
    keys: Iterable[bytes] | Iterable[Iterable[bytes]] | None = None,
    progress: WarmProgress | None = None,
    epoch: int = 0,
    register: Callable[[Namespace], None],
) -> WarmReport:
    """Promotes remote blocks of the given chains into the local ``tier``,
    recording the namespace's description with the first of them (as a put
    does: :class:`~ucm_db.remote.promotion.PromotionTarget`).

    Args:
        tier: the store's local tier (blocks enter it through
            :func:`ucm_db.remote.promotion.promote` only).
        link: the store's remote link; None (no ``remote``) counts only
            ``already_local`` and ``missing``.
        namespace: the chains' namespace.
        token_sequences: prompts' token ids (full blocks only count).
        keys: block keys: one chain, or a list of chains (an iterator of
            either is read). A chain that does not start at a chain root
            warms only if its first block's parent is local.
        progress: called as ``progress(done, total)`` in blocks.
        epoch: the namespace's epoch (:meth:`ucm_db.Store.epoch`), at which
            ``token_sequences`` are keyed: :meth:`ucm_db.Store.warm` passes
            it; 0 keys them as a store never invalidated would.
        register: registers the namespace's epoch before its first
            promoted block (:meth:`ucm_db.Store.warm` passes its epoch
            gate's ``before_put``).

    Returns:
        A :class:`WarmReport`.
    """
    started = time.monotonic()
    target = PromotionTarget(namespace, register)
    rooted, given = _chains(namespace, token_sequences, keys, epoch)
    chains = rooted + given
    total = sum(len(chain) for chain in chains)
    found: dict[bytes, str] = {}  # each distinct key -> its count (WarmReport): "fetched" wins over a first finding
    nbytes_total = done = failed_in_a_row = 0
    for i, chain in enumerate(chains):
        local_n = tier.count_prefix(chain, namespace_id=namespace.id)  # another namespace's blocks are not this one's
        for key in chain[:local_n]:
            found.setdefault(key, "already_local")  # fetched earlier in this run: counted fetched already
        done += local_n
        if link is not None and local_n < len(chain) and failed_in_a_row >= FAILED_CHAINS_LIMIT:
            fetched, nbytes, failed = 0, 0, True  # the remote keeps failing: asked nothing more
        else:
            fetched, nbytes, failed = _warm_chain(tier, link, target, chain, local_n, i < len(rooted),
                                                  lambda n: _tick(progress, done + n, total), found)
        if local_n < len(chain):  # a chain that asked the remote nothing says nothing of it
            failed_in_a_row = failed_in_a_row + 1 if failed else 0
        found.update(dict.fromkeys(chain[local_n:local_n + fetched], "fetched"))
        for key in chain[local_n + fetched:]:
            found.setdefault(key, "failed" if failed else "missing")
        nbytes_total += nbytes
        done += len(chain) - local_n
        _tick(progress, done, total)
    counts = Counter(found.values())
    if counts["failed"]:
        _log.warning("ucm-db: warm from remote %s: %d block(s) not fetched: the remote failed or timed out (see "
                     "stats().remote); warm again once it answers", link.url if link else None, counts["failed"])
    evicted = _gone(tier, namespace.id, [key for key, count in found.items() if count in ("already_local", "fetched")])
    if evicted:
        _log.warning("ucm-db: warm: %d of the block(s) it found or fetched were evicted before it ended: it asked for "
                     "more than the store's capacity holds (or other writers filled it); warm fewer prompts or raise "
                     "capacity_bytes", evicted)
    return WarmReport(already_local=counts["already_local"], fetched=counts["fetched"], missing=counts["missing"],
                      bytes=nbytes_total, seconds=time.monotonic() - started, failed=counts["failed"], evicted=evicted)


def _gone(tier: LocalTier, namespace_id: bytes, keys: list[bytes]) -> int:
    """How many of ``keys`` are not stored under ``namespace_id`` now (one
    read transaction)."""
    return sum(meta is None or meta.namespace_id != namespace_id for meta in tier.metas(keys))


def _warm_chain(
    tier: LocalTier, link: RemoteLink | None, target: PromotionTarget, chain: list[bytes], local_n: int, rooted: bool,
    on_batch: Callable[[int], None], found: Mapping[bytes, str],
) -> tuple[int, int, bool]:
    """Fetches ``chain[local_n:]`` batch by batch; stops at the first gap.
    ``rooted``: the chain starts at a chain root (a prompt's), so its first
    block's parent is None and needs no probe (one sequential round trip
    per prompt saved). Returns ``(fetched, bytes, failed)``: ``failed``
    when the fetch stopped short because the remote failed (module
    invariants), not at a block it lacks; so does a chain given from its
    middle whose parent an earlier chain of the run (``found``) failed to
    fetch."""
    if link is None or local_n == len(chain):
        return 0, 0, False

    namespace_id = target.namespace_id
    fetched = nbytes = 0
    at = local_n
    parent = chain[at - 1] if at else None
    breaker = link.breaker
    if not breaker.allow():
        time.sleep(min(breaker.open_for_s(), MAX_BACKOFF_S))  # another chain's (or a lookup's) failure: wait it out
    trips = breaker.trips
    if at == 0 and not rooted:
        ok, parent = _first_parent(tier, link, namespace_id, chain[0])
        if ok is None:
            return 0, 0, True
        if not ok:
            return 0, 0, parent is not None and found.get(parent) == "failed"
    for run in link.stream_chain(namespace_id, chain[at:], parent, chunk_blocks=BATCH_BLOCKS, timeout_s=BATCH_DEADLINE_S):
        promoted = promote(tier, run, target)
        fetched += promoted
        nbytes += sum(len(o.blob) for o in run[:promoted])
        on_batch(fetched)
        if promoted < len(run):
            return fetched, nbytes, False  # fetched, not kept (store full, retracted): missing, as before
    short = at + fetched < len(chain)
    return fetched, nbytes, short and (breaker.trips != trips or not breaker.allow())


def _first_parent(tier: LocalTier, link: RemoteLink, namespace_id: bytes, first_key: bytes) -> tuple[bool | None, bytes | None]:
    """A chain given by keys may start mid-chain: its first block can be
    promoted only if it is a chain root or its parent is local. Returns
    ``(promotable, parent)``; ``promotable`` is None when the probe failed
    or took longer than :data:`BATCH_DEADLINE_S` (the breaker opens, as
    for any read's failure; the probe used to wait on a hung remote unbounded)."""
    remote_tier = link.tier(namespace_id)
    answers = link.run_all([lambda: remote_tier.probe(first_key)], time.monotonic() + BATCH_DEADLINE_S)  # bounded, as fetches
    if answers is None or answers[0] is UNFINISHED:  # an error or no answer in time: the breaker opened
        return None, None
    probe = answers[0]
    if probe is None:
        return False, None
    return probe.parent is None or tier.exists([probe.parent])[0], probe.parent


def _tick(progress: WarmProgress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)
