"""Running a check as a user without root's rights (the tests run as root,
who reads and enters everything): :func:`run_as_nobody` forks a child that
becomes ``nobody`` and reports a JSON-able outcome; :func:`unreadable`
takes a path's permissions away for a block."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ucm_db.errors import TierError, UcmDbError

NOBODY = 65534


def run_as_nobody(outcome: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``outcome()`` run as ``nobody`` in a forked child where this process is
    root (here otherwise); its dict, or type "skip" where the child could
    not drop to that user. The child exits without cleanup."""
    if os.geteuid() != 0:
        return outcome()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = outcome()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            result = {"type": "skip", "text": f"cannot become uid {NOBODY} here: {exc!r}"}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        data = reader.read()
    os.waitpid(pid, 0)
    return json.loads(data)  # type: ignore[no-any-return]


def error_outcome(fn: Callable[[], object]) -> dict[str, Any]:
    """What ``fn()`` raised, as data: its class, text, hint, and whether it
    is a UcmDbError and a TierError (type "none" if it returned)."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "text": str(exc), "hint": getattr(exc, "hint", ""),
                "ucm_db": str(isinstance(exc, UcmDbError)), "tier": str(isinstance(exc, TierError))}
    return {"type": "none"}


@contextmanager
def unreadable(path: Path) -> Iterator[Path]:
    """``path`` with every permission taken away for the block, then given back."""
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        yield path
    finally:
        path.chmod(mode)
