"""One open :class:`ucm_db.Store` per store path per process, and one
commit process (``save_process``) per store path per process.

vLLM may run the scheduler-side and worker-side connectors in one process
(uni-process executor), and an LMDB environment can be open only once per
process: both halves therefore share one handle, reference-counted here.
A hybrid model's KV cache groups each have a worker half over the same
store: they share one commit process the same way, not one each.

Invariants:
    * ``acquire`` and ``release`` pair up; the store closes on the last
      release, after every holder's writes were handed to it. A close that
      fails (its last writes on a full disk: readers' recency, a final
      sync) is logged, never raised into vLLM's shutdown: the store is
      released either way and keeps what it committed. The same
      holds for ``acquire_committer`` and ``release_committer``; a commit
      process found dead is never handed out again (the next acquirer
      gets a new one).
    * Handles are keyed by resolved path and process id, so a forked child
      never reuses its parent's handle.
    * A commit process opens the path the process's store for the same
      settings resolved at its open (``store.path``), never the configured
      path resolved again: a symlink moved to another store between the
      two cannot send the commit process's puts to a store the worker
      does not read (:func:`acquire_committer`).
    * :func:`refuse_older_generations` refuses a store holding the model's
      blocks of an older storage generation, when a role starts.
    * :func:`role_store_options` decides how a role opens the store before
      anything is opened: a ``kv_consumer`` whose store is on a read-only
      volume (or not writable by this user) opens it ``read_only``; a role
      that saves is refused there, with the fix.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

import ucm_db
from ucm_db.connector.identity import KVShape, namespace
from ucm_db.connector.roles import RolePolicy, producer_store_options
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.committer import CommitProcess
from ucm_db.errors import ConfigError, TierError, UcmDbError
from ucm_db.maintenance import pre_unit_namespaces, pre_unit_refusal

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it

_lock = threading.Lock()
_handles: dict[tuple[int, Path], list] = {}  # key -> [store, refcount]
_committers: dict[tuple[int, Path], list] = {}  # key -> [commit process, refcount]
_held_as: dict[tuple[int, Path], ucm_db.Store] = {}  # (pid, configured path) -> the store acquire() gave for it


def _take(table: dict[tuple[int, Path], list], path: Path, make: Callable[[], Any], usable: Callable[[Any], bool]) -> Any:
    """One more holder of ``table``'s object for ``path`` in this process,
    made by ``make()`` on first use or where the one there is not
    ``usable``. Under ``_lock``."""
    key = (os.getpid(), path.expanduser().resolve())
    entry = table.get(key)
    if entry is None or not usable(entry[0]):
        entry = table[key] = [make(), 0]
    entry[1] += 1
    return entry[0]


def _drop(table: dict[tuple[int, Path], list], obj: Any) -> bool | None:
    """One holder fewer of ``obj``: True if that was the last (it left
    ``table``), False if others hold it, None if ``table`` never held it.
    Under ``_lock``."""
    for key, entry in list(table.items()):
        if entry[0] is obj:
            entry[1] -= 1
            if entry[1] > 0:
                return False
            del table[key]
            return True
    return None


def acquire(settings: ConnectorSettings) -> ucm_db.Store:
    """The process's store at ``settings.path`` (opened on first use)."""
    with _lock:
        store = _take(_handles, settings.path, lambda: ucm_db.open(settings.path, **settings.store_options), lambda _: True)
        _held_as[(os.getpid(), settings.path)] = store
        return store


def release(store: ucm_db.Store) -> None:
    """Drops one reference; closes the store with the last one (a failed
    close is logged: module invariants)."""
    with _lock:
        if _drop(_handles, store):
            for key in [key for key, held in _held_as.items() if held is store]:
                del _held_as[key]
            try:
                store.close()
            except UcmDbError as exc:
                logger.warning("ucm-db: closing the store %s failed (it was released; what it committed stays): %s",
                               store.path, exc)


def acquire_committer(settings: ConnectorSettings) -> CommitProcess:
    """The process's commit process for ``settings.path`` (started on first
    use, or when the one before died), on the store this process holds for
    those settings (module invariants; the worker acquires it first).

    Raises:
        CommitProcessError, ConfigError: it cannot start (the caller saves in-process).
    """
    with _lock:
        path = _committer_path(settings)
        return _take(_committers, path, lambda: CommitProcess(path, settings.store_options),
                     lambda committer: committer.alive)


def _committer_path(settings: ConnectorSettings) -> Path:
    """The store path a commit process for ``settings`` opens: the resolved
    ``path`` of the store this process holds for them, else (none held)
    ``settings.path`` resolved now. Under ``_lock``."""
    held = _held_as.get((os.getpid(), settings.path))
    return held.path if held is not None else settings.path.expanduser().resolve()


def release_committer(committer: CommitProcess) -> None:
    """Drops one reference; closes the commit process with the last one (at
    once if it was never acquired here)."""
    with _lock:
        last = _drop(_committers, committer) is not False
    if last:
        committer.close()  # outside the lock: it waits for the child to exit


def store_is_read_only(path: Path) -> bool:
    """True if the existing store directory ``path`` cannot be written by
    this process (a read-only volume, or no write permission).

    Raises:
        ConfigError: a name in ``path`` is too long for the file system
            (the path is the user's input, as ``ucm_db.open`` says).
        TierError: ``path`` cannot be looked at (a parent directory this
            user may not enter): Python 3.11's ``is_dir`` raises that, and
            a raw OSError would stop the start without the connector's one
            "cannot start" line.
    """
    path = path.expanduser()
    try:
        return path.is_dir() and not os.access(path, os.W_OK)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in path.parts)
            raise ConfigError(f"the store path {str(path)[:80]!r} has a name of {longest} bytes, too long for the file system",
                              hint="choose a path whose every name is at most 255 bytes") from exc
        raise TierError(f"cannot look at the store path {path}: {exc.strerror or exc}",
                        hint="give the service user search (x) permission on every directory above it, or choose another path") from exc


def role_store_options(settings: ConnectorSettings, saves: bool) -> ConnectorSettings:
    """``settings`` as a role opens its store (module invariants): an
    explicit ``read_only`` is kept; a consumer (``saves`` False) on a
    read-only store gets ``read_only=True``; a saving role there is a
    :class:`~ucm_db.errors.TierError` naming the fix."""
    explicit = settings.store_options.get("read_only")
    if explicit is not None:
        if explicit and saves:
            raise TierError(
                f"read_only is set for the store {settings.path}, but this kv_role saves blocks",
                hint='use "kv_role": "kv_consumer" to serve a store without writing to it, or drop read_only',
            )
        return settings
    if not store_is_read_only(settings.path):
        return settings
    if saves:
        raise TierError(
            f"the store {settings.path} is not writable (a read-only volume or no write permission), and this kv_role saves blocks",
            hint='use "kv_role": "kv_consumer" to serve it without writing, or put the store on a writable volume',
        )
    return dataclasses.replace(settings, store_options={**settings.store_options, "read_only": True})


def check_openable(settings: ConnectorSettings) -> None:
    """Opens the store and closes it again (unless this process holds it
    already): raises its TierError/ConfigError now, not at first use."""
    store = acquire(settings)
    release(store)


def refuse_older_generations(store: ucm_db.Store, settings: ConnectorSettings, shape: KVShape) -> None:
    """Raises :class:`~ucm_db.errors.FormatVersionError` (hint: the exact
    ``ucm-db migrate`` command) where the store holds the model's blocks of
    a storage generation before units, which the connector does not read
    (:mod:`ucm_db.maintenance.pre_units`): per-rank blocks of any TP/PP size, or whole
    blocks in the deployment's namespace (the one pre-unit TP=1 engines
    wrote), told by the exact unit size of vLLM's KV cache spec. At start,
    never as a silent miss later."""
    unit_bytes = {namespace(shape).id.hex(): shape.unit_bytes} if shape.unit_bytes else {}
    older = pre_unit_namespaces(store.stats().namespaces, model=shape.model, unit_bytes=unit_bytes)
    if older:
        raise pre_unit_refusal(settings.path, older)


def role_settings(extra: Mapping[str, Any] | None, kv_role: str | None) -> tuple[ConnectorSettings, RolePolicy]:
    """The settings a connector of ``kv_role`` opens its store with, from
    ``kv_connector_extra_config``: parsed and checked (ConfigError), the
    producer's publication options applied, read-only decided
    (:func:`role_store_options`). Opens nothing."""
    settings = ConnectorSettings.from_extra_config(extra)
    role = RolePolicy.from_kv_role(kv_role)
    if role.publishes:
        settings = dataclasses.replace(settings, store_options=producer_store_options(settings.store_options, settings.publish))
    return role_store_options(settings, role.saves), role
