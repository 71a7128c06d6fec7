"""Running a read of a possibly damaged store in a child process.

A damaged LMDB file can make the library abort (an assertion on a zeroed
page: SIGABRT) or the kernel kill the reader (a truncated map: SIGBUS). The
tools that diagnose a store must survive that: they run the read in a
forked child and get its result back as JSON over a pipe.

Invariants:
    * The caller never dies of what the child read: a child killed by a
      signal becomes a :class:`~ucm_db.errors.TierError` naming the signal and
      the fix; a :class:`~ucm_db.errors.UcmDbError` in the child is raised
      again in the caller, same class, message and hint.
    * Only JSON crosses the pipe (no pickle).
    * The child never returns into the caller's code: it leaves with
      ``os._exit`` whatever happens.
"""

from __future__ import annotations

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

_CHILD_FAILED = 70  # the child's exit status after an unexpected exception


def run_isolated(fn: Callable[[], dict[str, Any]], path: str | Path) -> dict[str, Any]:
    """``fn()`` run in a forked child; its JSON-ready result, or its error.

    ``path`` names the store in the error of a child killed by a signal.
    Call from a process with no other threads doing work (the CLI): only the
    calling thread exists in the child.
    """
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        status = 0
        try:
            try:
                message: dict[str, Any] = {"result": fn()}
            except UcmDbError as exc:
                message = {"error": {"type": type(exc).__name__, "message": _message_of(exc), "hint": exc.hint}}
            data = json.dumps(message, default=str).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
        except BaseException:  # noqa: BLE001 - report and leave; never unwind into the caller's code
            traceback.print_exc()
            status = _CHILD_FAILED
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
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
    if code != 0 or not data:
        raise TierError(f"checking the store at {path} failed in the checking process (exit status {code})",
                        hint="see the error printed above; run the command again, and report it if it repeats")
    message = json.loads(data)
    if "error" in message:
        raise _rebuilt(message["error"])
    result: dict[str, Any] = message["result"]
    return result


def _message_of(exc: UcmDbError) -> str:
    text = str(exc)
    suffix = f" (hint: {exc.hint})"
    return text[: -len(suffix)] if exc.hint and text.endswith(suffix) else text


def _rebuilt(error: dict[str, Any]) -> UcmDbError:
    cls = getattr(errors, str(error.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, UcmDbError)):
        cls = UcmDbError
    return cls(str(error.get("message")), hint=error.get("hint"))
