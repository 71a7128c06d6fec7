"""Running a read of a possibly damaged store in a child process.

A damaged LMDB file can make the library abort (an assertion on a zeroed
page: SIGABRT) or the kernel kill the reader (a truncated map: SIGBUS). The
tools that diagnose a store must survive that: they run the read in a
forked child and get its result back as JSON over a pipe.

A RocksDB store is read in the calling process instead. RocksDB reads its
files with ``pread`` and reports damage as an error status, so nothing
needs isolating; and a forked child of a process that has a RocksDB store
open can deadlock in its own open (a background thread of the parent held
RocksDB's thread-pool mutex at the fork: the child waits on it for ever in
``ThreadPoolImpl::IncBackgroundThreadsIfNeeded``; seen with a live RocksDB
writer in the caller, about one read in twenty).

Invariants:
    * The caller never dies of what the child read: a child killed by a
      signal becomes a :class:`~ucm_db.errors.TierError` naming the signal and
      the fix; a :class:`~ucm_db.errors.UcmDbError` in the child is raised
      again in the caller, same class, message and hint.
    * Only JSON crosses the pipe (no pickle).
    * An unexpected exception in the child is named in the caller's
      :class:`~ucm_db.errors.TierError` (type, message, last frame), also
      where the child's stderr goes nowhere (a captured CLI run).
    * The child never returns into the caller's code: it leaves with
      ``os._exit`` whatever happens.
    * No child is forked for a RocksDB store (above): ``fn()`` runs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ucm_db import errors
from ucm_db.errors import TierError, UcmDbError
from ucm_db.format.engine_dirs import detect_engine

_CHILD_FAILED = 70  # the child's exit status after an unexpected exception
_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # blocked across the fork (run_isolated)


def run_isolated(fn: Callable[[], dict[str, Any]], path: str | Path) -> dict[str, Any]:
    """``fn()`` run in a forked child; its JSON-ready result, or its error.

    ``path`` names the store in the error of a child killed by a signal.
    Call from a process with no other threads doing work (the CLI): only the
    calling thread exists in the child (a RocksDB store is read here, no child
    forked: module docs). A path that cannot be a store (a name too long
    for the file system, ...) is a ConfigError before any child runs.
    """
    from ucm_db.store.path import store_path

    store_path(path)
    if _is_rocksdb(Path(path)):
        return fn()
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    # Ctrl-C reaches the child too: held back until the child is inside the
    # block that always ends in os._exit, so it never unwinds into the CLI.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid == 0:  # child
        status = _CHILD_FAILED
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(read_fd)
            status = _child(fn, write_fd)
        finally:
            os._exit(status)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
    finally:
        _, wait_status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wait_status):
        name = signal.Signals(os.WTERMSIG(wait_status)).name
        raise TierError(
            f"the store at {path} is damaged: reading it killed the checking process ({name})",
            hint=f"move {path} aside (or delete it: it is a cache) and let ucm-db start an empty store there",
        )
    code = os.WEXITSTATUS(wait_status)
    message = _decoded(data)
    if "crash" in message:
        raise TierError(f"checking the store at {path} failed in the checking process: {message['crash']}",
                        hint="run the command again, and report it with this message if it repeats")
    if code != 0 or not message:
        raise TierError(f"checking the store at {path} failed in the checking process (exit status {code})",
                        hint="see the error printed above; run the command again, and report it if it repeats")
    if "error" in message:
        raise errors.error_from_dict(message["error"])
    result: dict[str, Any] = message["result"]
    return result


def _is_rocksdb(path: Path) -> bool:
    """Whether ``path`` holds a RocksDB store (a directory that cannot be
    read here is not: the child then says what is wrong)."""
    try:
        return detect_engine(path) == "rocksdb"
    except OSError:
        return False


def _child(fn: Callable[[], dict[str, Any]], write_fd: int) -> int:
    """The child's work: ``fn()``'s result, its UcmDbError, or (anything
    else) a crash record written to the pipe; returns the exit status."""
    status = 0
    try:
        try:
            message: dict[str, Any] = {"result": fn()}
        except UcmDbError as exc:
            message = {"error": exc.to_dict()}
        except Exception as exc:  # noqa: BLE001 - named to the caller, never unwound into its code
            message = {"crash": _crash_text(exc)}
            status = _CHILD_FAILED
            with contextlib.suppress(Exception):  # a closed stderr must not lose the record
                traceback.print_exc()
        try:
            data = json.dumps(message, default=str).encode()
        except (TypeError, ValueError) as exc:  # a result JSON cannot carry (a cycle, a bad key)
            data = json.dumps({"crash": _crash_text(exc)}).encode()
            status = _CHILD_FAILED
        _write_all(write_fd, data)
    except BaseException:  # noqa: BLE001 - the pipe itself failed: leave with the status alone
        traceback.print_exc()
        status = _CHILD_FAILED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _crash_text(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` for the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _decoded(data: bytes) -> dict[str, Any]:
    """The child's JSON message; empty when it wrote nothing whole."""
    try:
        message = json.loads(data) if data else {}
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}
