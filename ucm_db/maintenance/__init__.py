"""Looking after a store: the public maintenance API (the ``ucm-db`` CLI is a
thin layer over it).

Every operation takes a store path and works below :class:`~ucm_db.Store`
where it must (old formats, damaged records, no reader activity written):

* :func:`inspect` -- totals, namespaces, histograms, hottest chains;
  :func:`iter_blocks` and :func:`namespaces` for scripts.
* :func:`verify` -- decode and checksum every block (or a sample), check the
  index and the store's records; with ``fix`` (or :func:`repair`) quarantine
  corrupt blocks and blocks on parent cycles, and recount damaged or
  disagreeing totals.
* :func:`compact` -- evict to a size, drop dead records, shrink the file;
  :func:`evict_to_bytes` alone.
* :func:`export_archive` / :func:`import_archive` -- portable tar archives.
* :func:`convert_pre_unit_blocks` -- whole and per-rank blocks of the storage
  generations before units converted (``ucm-db migrate``, :mod:`ucm_db.maintenance.pre_units`);
  :func:`pre_unit_namespaces` and :func:`pre_unit_refusal` for the connector's check.
* :func:`convert_engine` -- a verified copy of a store on the other engine
  (``ucm-db migrate --to-engine``, :mod:`ucm_db.maintenance.conversion`).
* :func:`invalidate` -- move namespaces' epochs on (after a weight update):
  their blocks are never served again and age out through LRU eviction.
* :func:`iter_events` / :func:`iter_event_lines` -- KV cache events: the inventory replay of evented
  blocks, then the change feed, optionally followed (``ucm-db events``).
* :func:`gc_remote` -- garbage-collect a remote tier; :func:`remote_namespace`
  finds a namespace recorded on one.
* :func:`pin` / :func:`unpin` -- keep prompts' stored blocks out of eviction
  (:meth:`ucm_db.Store.pin`); :func:`lookup` -- each prompt's stored prefix,
  as a router asks it (:meth:`ucm_db.Store.lookup_many`). Prompts are token
  ids keyed at the namespace's epoch (no LoRA, ``cache_salt`` or
  multimodal extras); in a namespace of units (the vLLM connector's) they
  answer for the whole model's units (every KV head): :func:`whole_model_units`
  gives them (for ``Store.lookup_many``'s ``grid`` and ``spans``).

``isolated=True`` (what the CLI passes) runs the reading part of
:func:`inspect` and :func:`verify` in a child process (:mod:`ucm_db.maintenance.isolation`):
a damaged file that makes LMDB abort or the kernel send SIGBUS is then a
:class:`~ucm_db.errors.TierError` naming the damage, not a dead caller.

Invariants:
    * Nothing here creates a store except :func:`import_archive` (whose
      destination may be new); read-only operations write no record (their
      open recovers a store after an OS crash as any open does, then pins no
      snapshot and refuses writes: a stopped one holds nothing a writer needs);
      :func:`invalidate` writes only epoch records and releases the
      namespaces' pins (through the Store; given a remote, it also claims
      the epochs there, and the store's uploader drains what it had
      queued, as any open with the remote does); :func:`lookup` writes nothing.
    * Bad input is a :class:`~ucm_db.errors.UcmDbError` with a hint, raised
      before anything stored is changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ucm_db.maintenance.archive import export_archive, import_archive
from ucm_db.maintenance.compaction import compact, evict_to
from ucm_db.maintenance.conversion import convert as convert_engine
from ucm_db.arguments import (
    require_count, require_limit, require_namespace_selectors, require_remote_url, require_token_sequences,
)
from ucm_db.errors import ConfigError, DamagedRecordError, FormatVersionError, TierError, UcmDbError
from ucm_db.format import (
    STORE_FORMAT_VERSION, check_format_version, read_format_version, restorable_format_version, write_format_version,
)
from ucm_db.store import epochs
from ucm_db.maintenance.event_replay import iter_event_lines, iter_events
from ucm_db.maintenance.inspection import BlockInfo, inspect_view, iter_blocks as _iter_view_blocks, namespace_rows
from ucm_db.maintenance.isolation import run_isolated
from ucm_db.keys import Namespace
from ucm_db.maintenance.pre_units import ConversionReport, pre_unit_namespaces
from ucm_db.maintenance.pre_units import convert as convert_pre_unit_blocks
from ucm_db.maintenance.pre_units import refusal as pre_unit_refusal
from ucm_db.store.presence import whole_model_units
from ucm_db.store.view import ProgressFn, StoreView, open_view, select_namespaces
from ucm_db.maintenance.verification import VerifyReport, repair, verify_view

__all__ = [
    "BlockInfo", "ConversionReport", "ProgressFn", "StoreView", "VerifyReport", "compact", "convert_engine", "convert_pre_unit_blocks", "evict_to_bytes", "export_archive",
    "gc_remote", "import_archive", "inspect", "invalidate", "iter_blocks", "iter_event_lines", "iter_events", "lookup", "namespaces",
    "open_view", "pin", "pre_unit_namespaces", "pre_unit_refusal", "remote_namespace", "repair", "unpin", "verify",
    "whole_model_units",
]


def inspect(path: str | Path, *, namespaces: tuple[str, ...] = (), top: int = 0, now_ns: int | None = None,
            isolated: bool = False) -> dict[str, Any]:
    """The inspect report of the store at ``path`` (JSON-ready dict); with
    ``top`` also the N hottest chains and any parent cycles found. Each
    namespace row has its ``epoch`` (None: unknown, so not served), and
    ``epoch_problems`` lists the namespaces whose epoch cannot be established
    (:func:`ucm_db.store.epochs.problems`)."""
    namespaces = require_namespace_selectors(namespaces, "inspect")

    def report_of(view: StoreView) -> dict[str, Any]:
        return _add_epochs(view, inspect_view(view, namespaces=namespaces, top=top, now_ns=now_ns))

    def run() -> dict[str, Any]:
        with open_view(path) as view:
            free_bytes = view.engine.free_page_bytes()  # a read of its own: outside the snapshot
            return {**view.one_snapshot(report_of), "file_free_bytes": free_bytes}  # figures of one commit
    return run_isolated(run, path) if isolated else run()


def _add_epochs(view: StoreView, report: dict[str, Any]) -> dict[str, Any]:
    states = epochs.all_states(view.engine)
    for row in report.get("namespaces", []):
        found = states.get(bytes.fromhex(row["id"]))
        row["epoch"] = 0 if found is None else found.epoch
    report["epoch_problems"] = [str(epochs.unknown_error(ns_id, found.problem, str(view.path)))
                                for ns_id, found in states.items() if found.epoch is None]
    return report


def namespaces(path: str | Path) -> list[dict[str, Any]]:
    """Each namespace holding blocks: id, description and counters."""
    import time

    with open_view(path) as view:
        return namespace_rows(view, None, time.time_ns())


def iter_blocks(path: str | Path, namespaces: tuple[str, ...] = ()) -> Iterator[BlockInfo]:
    """Every block (of the namespaces named by id prefix or model), in key order."""
    namespaces = require_namespace_selectors(namespaces, "iter_blocks")
    with open_view(path) as view:
        yield from _iter_view_blocks(view, select_namespaces(view, namespaces))


def verify(path: str | Path, *, sample: int | None = None, seed: int = 0, fix: bool = False,
           progress: ProgressFn | None = None, isolated: bool = False) -> VerifyReport:
    """Checks every block (or ``sample`` at random, chosen by ``seed``) and
    the index; with ``fix`` repairs what was found (see :mod:`ucm_db.maintenance.verification`)."""
    require_count("sample", sample, minimum=1, hint="pass how many blocks to check at random, or None to check every block")
    path = Path(path)

    def check() -> dict[str, Any]:
        with open_view(path) as view:
            if not view.current_format and view.format_version >= 0:  # its blocks would all read as corrupt
                newer = view.format_version > STORE_FORMAT_VERSION
                raise FormatVersionError(
                    f"store at {path} has format {view.format_version}; this ucm-db verifies format {STORE_FORMAT_VERSION}",
                    hint="upgrade ucm-db to verify it" if newer else f"run `ucm-db migrate {path}`, then verify")
            if fix and view.format_version < 0 and view.engine.read(restorable_format_version) is None:
                raise DamagedRecordError(
                    f"the format version record of the store at {path} is damaged and nothing in the store tells which "
                    "format wrote it", hint=f"move {path} aside (it is a cache and starts empty) or restore it from a copy")
            return verify_view(view, sample=sample, seed=seed, progress=progress).to_dict()

    report = VerifyReport.from_dict(run_isolated(check, path) if isolated else check())
    if fix and report.problems:
        _restore_format_version(path)
        repair(path, report)
    return report


def _restore_format_version(path: Path) -> None:
    """Rewrites a damaged ``info/format_version`` record where the store's
    creation record tells its format (:func:`ucm_db.format.restorable_format_version`),
    so the repair's Store can open it."""
    with open_view(path, writable=True) as view:
        if view.format_version >= 0:
            return
        version = view.engine.read(restorable_format_version)
        if version is not None:
            view.engine.write(lambda txn: write_format_version(txn, version))


def evict_to_bytes(path: str | Path, target_bytes: int, progress: ProgressFn | None = None) -> int:
    """Evicts least recently used blocks of the store at ``path`` until at
    most ``target_bytes`` are stored; returns blocks evicted.

    Raises:
        DamagedRecordError: the format version record is damaged (as every
            other door raises it: ``migrate`` cannot help there).
        FormatVersionError: the store has another format.
    """
    require_limit("target_bytes", target_bytes, integer=True)  # True was 1 byte: every block evicted
    with open_view(path, writable=True) as view:
        if not view.current_format:
            # The view reads a damaged record as format -1; reading it again raises what open and compact raise.
            check_format_version(read_format_version(view.engine), Path(path))
        return evict_to(view.tier, target_bytes, progress)


def gc_remote(url: str, options: dict[str, Any] | None = None, *, older_than_s: float | None = None,
              max_bytes: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Garbage-collects the remote tier at ``url`` (see :mod:`ucm_db.remote.gc`).

    Raises:
        ConfigError: a bad limit or URL, or a ``file://`` root that is not a directory.
        TierError: the remote failed (unreachable endpoint, no or wrong
            credentials, a removal refused), naming the remote and the failure
            as ``warm`` does; its cause is the backend's error.
    """
    from ucm_db.remote.gc import gc
    from ucm_db.remote.tier import RemoteRoot, remote_failure

    require_remote_url(url, "remote gc")
    require_limit("older_than_s", older_than_s, integer=False)  # a negative limit deleted every object
    require_limit("max_bytes", max_bytes, integer=True)
    if older_than_s is None and max_bytes is None:
        raise ConfigError("remote gc needs an age and/or a size limit", hint="pass older_than_s and/or max_bytes (--older-than / --max-bytes)")
    root = RemoteRoot.from_url(url, dict(options or {}))
    _require_local_root(root, url)
    try:
        report = gc(root, older_than_s=older_than_s, max_bytes=max_bytes, dry_run=dry_run)
    except UcmDbError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure (botocore's are not OSErrors) is reported the same way
        failure = remote_failure(exc, url)
        raise TierError(failure.message, hint="check the URL and remote options (--option endpoint_url, key, secret) and the "
                        "network; gc removes whole objects, children first, so a rerun once the remote answers finishes it") from exc
    report["remote"] = url
    return report


def _require_local_root(root: Any, url: str) -> None:
    """A local (``file://``) remote root must be an existing directory: a
    mistyped path is a usage error, not an empty remote. Object stores
    (s3://, memory://) have no directories to check and are left as they are."""
    if root.is_local and not os.path.isdir(root.root):
        what = "is not a directory" if os.path.exists(root.root) else "does not exist"
        raise ConfigError(f"remote {url}: {root.root} {what}",
                          hint="check the URL (file:// then an absolute path, e.g. file:///mnt/kv-remote)")


def remote_namespace(url: str, options: dict[str, Any] | None, wanted: str) -> Namespace:
    """The one namespace recorded on the remote at ``url`` whose short id
    starts with ``wanted`` or whose model is ``wanted``; a stray entry or
    another namespace's broken manifest is skipped with a warning (see
    :func:`ucm_db.remote.warming.remote_namespaces`). An empty ``wanted``
    is a ConfigError (it would match every namespace)."""
    from ucm_db.remote.tier import RemoteRoot
    from ucm_db.remote.warming import remote_namespaces

    require_remote_url(url, "warm")
    require_namespace_selectors((wanted,), "warm")
    _require_local_root(RemoteRoot.from_url(url, dict(options or {})), url)  # a missing directory is not "no match"
    return remote_namespaces(url, dict(options or {})).find(wanted)


def invalidate(path: str | Path, namespaces: tuple[str, ...], *, remote: str | None = None,
               **remote_settings: Any) -> list[dict[str, Any]]:
    """Invalidates the namespaces of the store at ``path`` matching
    ``namespaces`` (id hex prefixes or model names; at least one): each
    one's epoch moves on (:meth:`ucm_db.Store.bump_epoch`), so no engine
    finds its old blocks again. Returns ``{"namespace", "model", "epoch"}``
    per namespace, the new epoch in each (and ``"remote"``, below, for one
    shared with a remote). A namespace whose epoch was
    unknown (damaged or lost record) gets a fresh epoch, never a reused one
    (:func:`ucm_db.store.epochs.bump`). An empty or whitespace selector is a
    ConfigError, raised before the store is opened: as an id prefix it
    would match, and invalidate, every namespace. A model's name selects
    that model's namespaces only, and an id prefix matching several is a
    ConfigError (:func:`~ucm_db.store.view.select_namespaces`).

    With ``remote`` (and ``remote_options``, key settings: options of
    :func:`ucm_db.open`) the store opens with it and each new epoch is
    claimed there above every epoch the nodes sharing it took (the plain
    count where none went further): ``"remote": "claimed"``. Without it, or
    where the remote is not reached, a namespace shared with a remote
    (:mod:`ucm_db.store.shared_epochs`) gets a fresh epoch, which no node can
    have counted to, told to the remote at the store's next contact:
    ``"pending"``; one never shared counts on (no ``"remote"``)."""
    from ucm_db.store import Store, shared_epochs

    if remote is not None:
        require_remote_url(remote, "invalidate")
    elif remote_settings:
        raise ConfigError(f"invalidate got remote settings ({', '.join(sorted(remote_settings))}) without a remote",
                          hint="pass remote= (ucm-db: --remote URL) with them, or leave them out")
    targets = _described_namespaces(path, namespaces, "invalidate")
    with Store(path, **({} if remote is None else {"remote": remote, **remote_settings})) as store:
        rows = []
        for ns in targets:
            shared = remote is not None or shared_epochs.is_shared(store._engine, ns.id)
            epoch = store.bump_epoch(ns)
            row: dict[str, Any] = {"namespace": ns.id.hex(), "model": ns.model, "epoch": epoch}
            if shared:
                row["remote"] = "claimed" if store._epochs.on_remote(ns, epoch) else "pending"
            rows.append(row)
        return rows


def _described_namespaces(path: str | Path, selectors: tuple[str, ...], operation: str) -> list[Namespace]:
    """The namespaces of the store at ``path`` that ``selectors`` match, from
    their recorded descriptions (read below the Store, creating nothing)."""
    selectors = require_namespace_selectors(selectors, operation)
    if not selectors:
        raise ConfigError(f"{operation} needs a namespace", hint="pass an id prefix or a model name (--namespace)")
    with open_view(path) as view:
        chosen = select_namespaces(view, selectors, unique_prefixes=True) or set()
        descriptions = view.tier.namespace_descriptions()
    targets: list[Namespace] = []
    for ns_id in sorted(chosen):
        try:
            namespace = Namespace.from_dict(descriptions[ns_id])
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"namespace {ns_id.hex()} has a damaged description: {exc}",
                              hint=f"run `ucm-db verify PATH --fix`, then {operation} again") from exc
        if namespace.id != ns_id:
            raise ConfigError(f"namespace {ns_id.hex()}'s description names another namespace",
                              hint=f"run `ucm-db verify PATH --fix`, then {operation} again")
        targets.append(namespace)
    return targets


def _one_namespace(path: str | Path, selector: str, operation: str) -> Namespace:
    found = _described_namespaces(path, (selector,), operation)
    if len(found) != 1:
        raise ConfigError(f"{selector!r} matches {len(found)} namespaces: " + ", ".join(f"{ns.id.hex()} ({ns.model})" for ns in found),
                          hint="pass a longer namespace id prefix (`ucm-db inspect` lists them)")
    return found[0]


def _prompt_rows(namespace: Namespace, token_sequences: list[list[int]], stored: list[int]) -> list[dict[str, Any]]:
    size = namespace.block_size
    return [{"tokens": len(tokens), "blocks": len(tokens) // size, "stored_blocks": n, "stored_tokens": n * size}
            for tokens, n in zip(token_sequences, stored)]


def _units_row(units: Any) -> dict[str, Any] | None:
    if units is None:
        return None
    grid, spans = units
    return {"kv_heads": grid.heads, "layers": grid.layers, "units_per_block": len(spans),
            "stages": sorted({(s.layer_start, s.layer_stop) for s in spans})}


def lookup(path: str | Path, namespace: str, token_sequences: list[list[int]], *,
           layer_partition: list[int] | None = None) -> dict[str, Any]:
    """Each prompt's stored prefix in the store at ``path`` (local tier; one
    read transaction; nothing written), keyed at the namespace's epoch. In a
    namespace of units a block counts when the unit of every KV head (of
    every stage of ``layer_partition``) is stored: the prefix a vLLM engine
    on that store, at any TP size, would load.

    Raises:
        EpochUnknownError: the namespace's epoch cannot be established.
    """
    import time

    from ucm_db.store import Store

    token_sequences = require_token_sequences(token_sequences, "lookup")
    ns = _one_namespace(path, namespace, "lookup")
    units = whole_model_units(ns, layer_partition)
    with Store(path, read_only=True) as store:
        epoch = store.epoch(ns)
        chains = [ns.block_keys(tokens, epoch=epoch) for tokens in token_sequences]
        started = time.perf_counter()
        stored = store.lookup_many(ns, chains, grid=None if units is None else units[0], spans=None if units is None else units[1])
        seconds = time.perf_counter() - started
    return {"namespace": ns.id.hex(), "model": ns.model, "epoch": epoch, "block_size": ns.block_size,
            "units": _units_row(units), "lookup_s": round(seconds, 6), "prompts": _prompt_rows(ns, token_sequences, stored)}


def pin(path: str | Path, namespace: str, token_sequences: list[list[int]], *, max_pinned_bytes: int | None = None,
        release: bool = False) -> dict[str, Any]:
    """Pins (``release``: unpins) the stored blocks of each prompt in the
    store at ``path`` (:meth:`ucm_db.Store.pin`), keyed at the namespace's
    epoch; in a namespace of units, every KV head's unit chain. Returns
    the :class:`~ucm_db.stats.PinReport` fields, plus per prompt its blocks
    (whole-model blocks) pinned after the call.

    Raises:
        StoreFullError: the pins would pass ``max_pinned_bytes`` (None: the
            store's default, half its capacity); nothing is pinned.
    """
    from ucm_db.store import Store

    token_sequences = require_token_sequences(token_sequences, "unpin" if release else "pin")
    ns = _one_namespace(path, namespace, "unpin" if release else "pin")
    units = whole_model_units(ns)
    options = {} if max_pinned_bytes is None else {"max_pinned_bytes": max_pinned_bytes}
    with Store(path, **options) as store:
        epoch = store.epoch(ns)
        chains = [ns.block_keys(tokens, epoch=epoch) for tokens in token_sequences]
        report = (store.unpin if release else store.pin)(
            ns, chains, grid=None if units is None else units[0], spans=None if units is None else units[1])
    out = report.to_dict()
    out.update(namespace=ns.id.hex(), model=ns.model, epoch=epoch, block_size=ns.block_size, units=_units_row(units),
               prompts=[{**row, "pinned_blocks": row.pop("stored_blocks"), "pinned_tokens": row.pop("stored_tokens")}
                        for row in _prompt_rows(ns, token_sequences, list(report.chains))])
    return out


def unpin(path: str | Path, namespace: str, token_sequences: list[list[int]]) -> dict[str, Any]:
    """Takes back the pins of each prompt's stored blocks (:func:`pin` with
    ``release``): the report's ``pinned_blocks`` per prompt is what pins on
    other prompts still hold."""
    return pin(path, namespace, token_sequences, release=True)
