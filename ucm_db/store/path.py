"""The store path given to :func:`ucm_db.open`: checked before anything is
created, and the permission failures of an open named with their fix.

Invariants:
    * A refused path creates nothing: every check here runs before the
      store directory, its lock file or its engine is touched.
    * The path a store keeps is absolute with its symlinks resolved, taken
      once at open: a later ``chdir`` or a symlink swapped to another store
      never moves an open store's files onto another directory (the
      engines look their files up again by name, e.g. LMDB's meta pages).
    * Refused: a path that is not ``str`` or ``os.PathLike[str]`` (bytes,
      None), the empty string (it would be the current directory), a NUL
      character, a path through a symlink to nothing (a loop, or a
      target not there: a disk not mounted), a ``~`` path with nothing there (not expanded: it would
      create a directory named ``~`` in the working directory), a name that is not UTF-8 (the engines take their paths as
      UTF-8), a name over the file system's length limit, a whole path
      without room for the store's own files below it, a path inside
      another store (an ancestor directory holds a store's lock file and
      engine directory), e.g. ``STORE/lmdb``, which would nest a second
      store in the first one's files, and a new store in a directory whose
      entries include a store (:func:`refuse_enclosing`: that store would
      then lie inside the new one, and be refused).
    * A ``PermissionError`` while opening the store is a
      :class:`~ucm_db.errors.TierError` naming the path and the access it
      needs (:func:`permission_error`), read-only opens included; a
      symlink whose target this user may not reach (EACCES) is that, never
      "a link to nothing" (:func:`_refuse_dangling`).
    * A store directory holding both engine directories is a
      :class:`ConfigError` before anything is created or opened
      (:func:`ucm_db.format.detect_engine`, which every door reads).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError, TierError, UcmDbError
from ucm_db.format import detect_engine
from ucm_db.storelock import LOCK_FILE

#: Used where the file system does not say (``pathconf``); Linux's value.
DEFAULT_NAME_MAX_BYTES = 255
DEFAULT_PATH_MAX_BYTES = 4096
#: Room a store path leaves for the names inside the store (the longest,
#: e.g. ``rocksdb/OPTIONS-000007.dbtmp`` or ``lmdb/synced-snapshot.<id>``,
#: is under 64 bytes; the rest is margin for engine versions).
INNER_NAMES_BYTES = 128


def store_path(path: Any) -> Path:
    """``path`` as a :class:`~pathlib.Path`, or a :class:`ConfigError`
    naming why it cannot be a store (see the module invariants)."""
    raw = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(raw, str):
        raise ConfigError(
            f"a store path is a str or os.PathLike, got {type(path).__name__}",
            hint="pass e.g. '/var/cache/ucm-db' (decode a bytes path with os.fsdecode)",
        )
    if not raw:
        raise ConfigError("the store path is empty", hint="pass the store's directory; '.' for the current directory")
    if "\0" in raw:
        raise ConfigError(f"the store path {raw[:40]!r} holds a NUL character, which no file name can",
                          hint="pass the store directory's path without NUL characters")
    _check_utf8(raw)
    if raw.startswith("~") and not os.path.lexists(raw):
        # Not expanded (as open() does not): it would create a directory named "~" here.
        raise ConfigError(f"the store path {raw[:60]!r} starts with '~', which ucm_db.open does not expand",
                          hint="write the home directory out (os.path.expanduser(path); in a shell, leave ~ unquoted), "
                          "or prefix './' for a directory really named so")
    _refuse_dangling(raw)
    result = Path(os.path.realpath(raw))  # absolute, symlinks resolved: see the module invariants
    _check_name_lengths(result)
    _refuse_nested(result)
    return result


def _refuse_dangling(raw: str) -> None:
    """A ConfigError where the nearest existing name on ``raw`` is a symlink
    to nothing (a loop, or a target not there: e.g. a disk not mounted,
    where creating the target's directories would put the store elsewhere).

    Only what ``stat`` says of the target counts: ENOENT, ELOOP, or ENOTDIR
    (a file where the target's path needs a directory) is nothing there;
    any other failure, e.g. EACCES on a target in a directory this user
    may not enter, is no verdict on the link, and the open reports it
    (a permission TierError naming the fix, :func:`permission_error`)."""
    nearest = os.path.abspath(raw)
    while not os.path.lexists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if not os.path.islink(nearest):
        return
    try:
        os.stat(nearest)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return
    raise ConfigError(
        f"the store path {raw[:200]} goes through the symbolic link {nearest[:200]} -> "
        f"{os.readlink(nearest)[:200]}, which leads nowhere (a loop, or a target that does not exist)",
        hint="create the link's target (or mount its file system) first, or point the link at a directory",
    )


def _check_utf8(raw: str) -> None:
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = next(part for part in Path(raw).parts if _undecodable(part))
        raise ConfigError(
            f"the store path has a name that is not UTF-8: {os.fsencode(name)[:60]!r}",
            hint="rename that directory to a UTF-8 name, or choose another store path",
        ) from exc


def _undecodable(name: str) -> bool:
    try:
        name.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _check_name_lengths(path: Path) -> None:
    absolute = os.fsencode(os.path.abspath(path))
    name_max, path_max = _limits(path)
    long_names = [part for part in path.parts if len(os.fsencode(part)) > name_max]
    if long_names:
        raise ConfigError(
            f"the store path has a name of {len(os.fsencode(long_names[0]))} bytes ({long_names[0][:24]}...); "
            f"this file system allows {name_max}",
            hint=f"use directory names of at most {name_max} bytes",
        )
    if len(absolute) + INNER_NAMES_BYTES > path_max:
        raise ConfigError(
            f"the store path is {len(absolute)} bytes long; this file system allows {path_max} for a whole path, "
            f"and the store's own files need {INNER_NAMES_BYTES} of them",
            hint=f"choose a shorter store path (at most {path_max - INNER_NAMES_BYTES} bytes)",
        )


def _limits(path: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the nearest existing directory of ``path``."""
    for directory in (path, *path.absolute().parents):
        try:
            return os.pathconf(directory, "PC_NAME_MAX"), os.pathconf(directory, "PC_PATH_MAX")
        except (OSError, ValueError):
            continue
    return DEFAULT_NAME_MAX_BYTES, DEFAULT_PATH_MAX_BYTES


def _refuse_nested(path: Path) -> None:
    ancestor = enclosing_store(path)
    if ancestor is not None:
        raise ConfigError(
            f"the store path {path} lies inside the ucm-db store at {ancestor}; a store there would be written "
            "among that store's own files",
            hint=f"open {ancestor} itself, or choose a path outside it",
        )


def refuse_enclosing(path: Path) -> None:
    """A :class:`ConfigError` where a *new* store at ``path`` would enclose a
    store among ``path``'s entries (one level: a listing, no tree walk),
    e.g. opening ``~/.cache`` instead of ``~/.cache/ucm-db``."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return  # absent (the usual case), or unreadable: the open reports what it meets
    inner = next((Path(e.path) for e in entries if e.is_dir(follow_symlinks=False) and _is_store(Path(e.path))), None)
    if inner is not None:
        raise ConfigError(
            f"the store path {path} holds the ucm-db store at {inner}; a new store at {path} would put that one "
            "inside it, where it could no longer be opened",
            hint=f"open {inner} itself, or choose a new directory for the new store",
        )


def enclosing_store(path: Path) -> Path | None:
    """The ucm-db store whose directory holds ``path`` at any depth
    (symlinks resolved; ``path`` itself is not counted), or None."""
    real = Path(os.path.realpath(path))
    return next((ancestor for ancestor in real.parents if _is_store(ancestor)), None)


def _is_store(directory: Path) -> bool:
    """Whether ``directory`` holds a ucm-db store (its lock file and an
    engine directory); an unreadable directory does not count."""
    try:
        return (directory / LOCK_FILE).is_file() and detect_engine(directory) is not None
    except OSError:
        return False


def detect_engine_checked(path: Path) -> str | None:
    """:func:`ucm_db.format.detect_engine`, with a permission failure as a
    :class:`TierError` (see :func:`permission_error`)."""
    try:
        return detect_engine(path)
    except PermissionError as exc:
        raise permission_error(path, exc) from exc


def path_error(path: Path, exc: OSError) -> UcmDbError:
    """The error for ``exc``, met checking the store path ``path`` itself: a
    permission failure as :func:`permission_error`, any other (a name too
    long, a file where a directory should be) a :class:`ConfigError`."""
    if isinstance(exc, PermissionError):
        return permission_error(path, exc)
    return ConfigError(f"cannot use the store path {path}: {exc.strerror or exc}",
                       hint="check the path: each directory on it, the length of its names, and their permissions")


def permission_error(path: Path, exc: OSError) -> TierError:
    """A TierError for ``exc`` (EACCES/EPERM) met while opening the store at ``path``."""
    where = exc.filename or path
    return TierError(
        f"cannot open the store at {path}: permission denied on {where}",
        hint=f"give this user (uid {os.getuid()}) read access to {path} and everything under it (and write access "
        "to open it writable), e.g. run as the store's owner; read_only=True needs read access too",
    )
