"""Which engine a store directory holds: the name of its one engine
directory (``lmdb/`` or ``rocksdb/``).

Invariants:
    * A store directory holding both engine directories (left by an older
      ucm-db whose creators raced, or by hand) is a :class:`ConfigError`
      naming both, what each holds and how to keep one, before anything is
      created or opened: an open picking either would hide the other's
      blocks, and every door (the store, its views, the tools, migrations)
      reads the engine here. An empty one is refused too, with ``rmdir`` as
      its fix, so no door ever creates a second store in it.
    * A directory whose ``lmdb/`` or ``rocksdb/`` is itself a whole store
      (two stores named after the engines under one parent) is not a
      store: a :class:`ConfigError` names the store(s) to open instead,
      never a move that would nest a store a level down.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from ucm_db.errors import ConfigError
from ucm_db.format.names import ON_DISK_ENGINES
from ucm_db.storelock import LOCK_FILE


def detect_engine(path: Path) -> str | None:
    """The engine of the store directory ``path`` (the name of its engine
    directory), or None where it holds none; a :class:`ConfigError` where it
    holds both (module invariants). Reads names and sizes only: nothing is
    created or opened. An OSError on the way (e.g. permission) is raised as
    it is."""
    path = Path(path)
    found = [name for name in ON_DISK_ENGINES if (path / name).is_dir()]
    stores = [path / name for name in found if _is_store(path / name)]
    if stores:
        named = " and ".join(str(store) for store in stores)
        raise ConfigError(
            f"{path} is not a ucm-db store: {named} {'is a store' if len(stores) == 1 else 'are stores'} of "
            f"{'its' if len(stores) == 1 else 'their'} own (named after an engine, each holds {LOCK_FILE} and an "
            "engine directory); nothing was opened",
            hint="open " + " or ".join(str(store) for store in stores) + " itself")
    if len(found) < 2:
        return found[0] if found else None
    held = {name: _engine_files(Path(path) / name) for name in found}
    described = " and ".join(f"{path / name}/ ({_described(held[name])})" for name in found)
    empty = [name for name, files in held.items() if files is not None and files[0] == 0]
    if empty:
        hint = ("remove the empty engine directory (it holds no store file), then open the store again: "
                + " && ".join(f"rmdir {shlex.quote(str(path / name))}" for name in empty))
    else:
        sizes = {name: held[name] or (0, -1, -1.0) for name in found}  # an unreadable one: neither larger nor newer
        larger = max(found, key=lambda name: sizes[name][1])
        newer = max(found, key=lambda name: sizes[name][2])
        other = next(name for name in found if name != larger)
        aside, inner, store = (shlex.quote(str(p)) for p in (path.with_name(f"{path.name}.{other}"), path / other, path))
        hint = (f"keep one engine directory in {path}: move the other out into a new directory of its own, e.g. "
                f"`mkdir {aside} && mv {inner} {aside}/`, which then opens as a store of its own "
                f"(`ucm-db inspect {aside}` lists its blocks; `ucm-db export {aside} ARCHIVE` and `ucm-db import "
                f"ARCHIVE {store}` keep them too). Of the two, {larger}/ holds more bytes and {newer}/ was written last")
    raise ConfigError(
        f"the store directory {path} holds two engine directories, {described}: it is not one store, and opening "
        "it as either engine would hide the other's blocks (an older ucm-db whose creators raced, or a copy by "
        "hand, leaves both); nothing was opened",
        hint=hint,
    )


def _engine_files(directory: Path) -> tuple[int, int, float] | None:
    """(files, bytes, newest mtime) under the engine directory ``directory``;
    None where a directory in it cannot be listed (never called empty)."""
    files, size_bytes, newest = 0, 0, 0.0
    try:
        for root, _dirs, names in os.walk(directory, onerror=_raise):
            for name in names:
                try:
                    st = os.lstat(os.path.join(root, name))
                except FileNotFoundError:
                    continue
                files, size_bytes, newest = files + 1, size_bytes + st.st_size, max(newest, st.st_mtime)
    except OSError:
        return None
    return files, size_bytes, newest


def _raise(exc: OSError) -> None:
    raise exc


def _described(held: tuple[int, int, float] | None) -> str:
    if held is None:
        return "its files cannot be listed"
    files, size_bytes, newest = held
    if not files:
        return "empty"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    return f"{files} files, {size_bytes} bytes, last written {when}"


def _is_store(directory: Path) -> bool:
    """Whether ``directory`` is a whole store (its lock file and an engine
    directory), not an engine's directory."""
    return (directory / LOCK_FILE).is_file() and any((directory / name).is_dir() for name in ON_DISK_ENGINES)
