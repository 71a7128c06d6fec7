"""ucm-db beside other connectors under vLLM's ``MultiConnector``.

MultiConnector loads a request from the first child that reports a hit and
lets every child save it. A child that did not load it saves, in the same
step, blocks another child loaded: if that load failed (a block lost or
corrupt in the other store), vLLM recomputes from the failed block, but the
blocks were already copied out of the KV cache holding stale memory. The
loading child voids its own saves over its failed loads; a sibling cannot
know the other's outcome before the step's output comes back.

So the scheduler side treats the blocks another connector loaded into a
request as loads of its own for the saves that follow (their ``after_loads``)
and holds those saves until the step's output names the blocks that failed
(``invalid_block_ids``, the union of every child's load errors): a held save
over a failed block is dropped and the request saves again from its stored
prefix (settlement.py's held-save verdicts).

Invariants:
    * A request's blocks in ``[vLLM's own prefix-cache hit, num_computed_tokens)``
      at its first scheduled step after a lookup (new, or resumed after a
      preemption), when this connector planned no load for
      it (sync or async), were loaded by another connector; without one
      there are none, and nothing changes for a lone ucm-db.
    * The ids are every KV cache group's (one block pool): a failure in any
      group reaches every group's saves of the request.
    * What another ucm-db connector of this process loaded (children
      ``[local store, shared store]``) is keyed as this one keys it, and is
      saved. Both hold per lookup: after a lookup whose allocation was this
      connector's own async load, the request's first step names no sibling
      loads (the blocks are its own), and a later lookup (its async load
      failed, vLLM asks again and another child loads) sees the other's.
      What another kind of connector loaded is not known to be this
      engine's KV (a PD transfer connector that checks the model's path,
      not its files; a cache keyed by model name): a request it loaded saves
      nothing, neither those blocks nor any computed over them, unless
      ``store_foreign_loads`` is set (:func:`refuse_saves_over_foreign_load`;
      ucm-db's loads are noted by :func:`note_ucm_db_load` when vLLM
      allocates them, before any child builds its step).
    * One publication per request (per KV cache group): MultiConnector
      merges its children's ``kv_transfer_params`` and stops the engine on a
      key two of them return (``RuntimeError: Key clash``), and every ucm-db
      child that is a ``kv_producer`` publishes under the same key, whatever
      its namespace. So the first ucm-db child to publish a request returns
      it, and every later one returns None (:func:`publish_once`); one of
      the same namespace first folds its own into it (the blocks every one
      of their stores holds: the fewest; every store named). A later child
      of another namespace (``model_id`` set on one child) is not announced
      (logged once): a consumer of its namespace does an ordinary lookup.
      Two children of one engine are told apart from two engines of one
      process by the request object, which MultiConnector hands every
      child; a hybrid model's groups (one scheduler each, other namespaces)
      by their group index.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handler prints it
#: Requests a ucm-db connector of this process loaded (the newest this many).
MAX_NOTED_LOADS = 65536
_ucm_db_loads: OrderedDict[str, None] = OrderedDict()
_warned_foreign = False
#: Per request object (held weakly), per KV cache group: the first ucm-db scheduler of this process
#: to publish it, and its publication's body.
_publications: weakref.WeakKeyDictionary[Any, dict[int, tuple[object, dict[str, Any]]]] = weakref.WeakKeyDictionary()
#: The same for the last request that cannot be held weakly (not vLLM's Request): (request, its entry).
_unheld: list[tuple[Any, dict[int, tuple[object, dict[str, Any]]]]] = []
_warned_namespaces = False


def _firsts(request: Any) -> dict[int, tuple[object, dict[str, Any]]]:
    """The publications made of ``request`` so far, by group (made empty where none)."""
    try:
        return _publications.setdefault(request, {})
    except TypeError:  # not weakly referable: one such request held, until the next
        if not _unheld or _unheld[0][0] is not request:
            _unheld[:] = [(request, {})]
        return _unheld[0][1]


def publish_once(request: Any, owner: object, params: dict[str, Any], key: str, group: int = 0) -> dict[str, Any] | None:
    """``params`` (a publication under ``key``) where ``owner`` is the first
    ucm-db scheduler of this process to publish ``request`` (of KV cache
    group ``group``); None where another one published it first, after
    folding ``params`` into that one's if both name one namespace (module
    invariants)."""
    global _warned_namespaces
    body = params[key]
    firsts = _firsts(request)
    first = firsts.get(group)
    if first is None or first[0] is owner:  # the first, or this scheduler's own again (a new chunk of a session)
        firsts[group] = (owner, body)
        return params
    theirs = first[1]
    if theirs["namespace"] != body["namespace"]:
        if not _warned_namespaces:
            _warned_namespaces = True
            logger.warning("ucm-db: two ucm-db kv_producer connectors of this MultiConnector store under other "
                           "namespaces (%.12s, %.12s: model_id set on one?); a request is announced once, by the first "
                           "of them: a consumer of the other's namespace looks it up without waiting (logged once)",
                           theirs["namespace"], body["namespace"])
        return None
    if body["blocks"] < theirs["blocks"]:  # every store named holds the fewer blocks
        theirs.update(blocks=body["blocks"], tokens=body["tokens"], last_key=body["last_key"])
    theirs["stores"] = list(dict.fromkeys([*theirs["stores"], *body["stores"]]))
    return None


def note_ucm_db_load(req_id: str) -> None:
    """Notes that a ucm-db connector of this process loads ``req_id``."""
    _ucm_db_loads[req_id] = None
    _ucm_db_loads.move_to_end(req_id)
    if len(_ucm_db_loads) > MAX_NOTED_LOADS:
        _ucm_db_loads.popitem(last=False)


def forget_ucm_db_load(req_id: str) -> None:
    """Forgets an earlier lookup's note of ``req_id``: vLLM asks every child
    of a MultiConnector before it allocates for any, so each lookup of a
    ucm-db child forgets it and the child that loads it this time notes it
    again. A ucm-db load that failed must not let a later load by another
    kind of connector pass for ucm-db's."""
    _ucm_db_loads.pop(req_id, None)


def refuse_saves_over_foreign_load(req_id: str, state: Any) -> None:
    """Turns off the saves of ``req_id`` (its ``state``'s controls), which
    another connector loaded, unless a ucm-db connector of this process
    loaded it (module invariants); warned once per process."""
    global _warned_foreign
    if state is None or req_id in _ucm_db_loads or not state.controls.save:
        return
    state.controls = dataclasses.replace(state.controls, save=False)
    if not _warned_foreign:
        _warned_foreign = True
        logger.warning("ucm-db: request %.80s was loaded by another connector (MultiConnector): ucm-db saves none of "
                       "it, since its KV may have been computed with other weights; set store_foreign_loads=true in "
                       "kv_connector_extra_config where that connector checks the model's files (logged once)", req_id)


def _admitted(scheduler_output: Any) -> Iterator[tuple[str, Sequence[Sequence[int]]]]:
    """(request id, block ids per group) of the step's requests that may have
    had a lookup: new ones and ones resumed after a preemption."""
    for new_req in scheduler_output.scheduled_new_reqs:
        yield new_req.req_id, new_req.block_ids
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
            yield req_id, cached.new_block_ids[i]


def sibling_loads(
    scheduler_output: Any, requests: Mapping[str, Any], block_size: int, own_loads: Collection[str],
) -> list[tuple[str, tuple[int, ...]]]:
    """(request id, block ids of every group) that another connector loaded
    this step, for the step's new and resumed requests (vLLM's
    ``SchedulerOutput``); ``requests``: the scheduler's request states (with
    ``request``, ``lookup_computed_tokens``: vLLM's computed tokens at the
    lookup, and ``async_claimed``: that lookup's allocation was this
    connector's own async load); ``own_loads``: requests this connector
    loads this step. ``lookup_computed_tokens`` is consumed (None): only the
    first step after a lookup can name sibling loads."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for req_id, block_ids in _admitted(scheduler_output):
        state = requests.get(req_id)
        if state is None or state.lookup_computed_tokens is None:
            continue  # no lookup since its last scheduled step: nothing was loaded for it
        start = state.lookup_computed_tokens // block_size
        end = state.request.num_computed_tokens // block_size
        state.lookup_computed_tokens = None
        if req_id in own_loads or state.async_claimed:
            continue  # our own load (an async one, of this lookup, put its blocks in place before this step)
        if end > start:
            ids = tuple(b for group in block_ids for b in group[start:end])
            out.append((req_id, ids))
    return out


def sibling_block_ids(step_loads: Iterable[Any], req_id: str) -> set[int]:
    """The block ids (every group's) another connector loaded into ``req_id``
    in the steps whose outcome is not back yet (settlement.py's ``StepLoads``
    records, with ``loads`` and ``sibling``): what its saves must wait for."""
    return {b for record in step_loads if req_id in record.sibling for r, ids in record.loads if r == req_id for b in ids}
