"""Named crash points for the reliability suite.

Code calls ``crashpoint("local.before_commit")`` at steps where a crash is
interesting (after the payload write, before the commit, during an upload,
during a compaction switch, during a migration). When the environment
variable ``UCM_DB_CRASH_AT`` is set to ``"name:nth"`` (several separated by
commas), the process kills itself with SIGKILL the ``nth`` time (1-based) it
reaches the named step. A SIGKILL runs no cleanup, no ``finally`` and no
``atexit``: it is the same as the process dying from the outside at that
instant, but at an exactly chosen point.

Invariants:
    * Unset (the normal case), :func:`crashpoint` is one truth test of an
      empty dict: no parsing, no counting, no lock.
    * The variable is read when this module is imported, and again by
      :func:`reload` (for tests that set it in an already running process).
    * A malformed value is an error at import, never a silently ignored one.
"""

from __future__ import annotations

import os
import signal
import threading

from ucm_db.errors import ConfigError

ENV_VAR = "UCM_DB_CRASH_AT"

#: Steps the code base marks; the suite checks each is reachable.
KNOWN_POINTS = (
    "local.after_payload_write",
    "local.before_commit",
    "remote.during_upload",
    "remote.before_mark_uploaded",
    "compact.during_switch",
    "migrate.during_migration",
)

_targets: dict[str, int] = {}
_counts: dict[str, int] = {}
_lock = threading.Lock()


def crashpoint(name: str) -> None:
    """Marks the step ``name``; kills the process if it is armed for it."""
    if _targets:  # empty when disabled: one truth test, nothing else
        _hit(name)


def _hit(name: str) -> None:
    """Counts ``name`` and kills the process at its target count."""
    target = _targets.get(name)
    if target is None:
        return
    with _lock:
        count = _counts.get(name, 0) + 1
        _counts[name] = count
    if count == target:
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str) -> dict[str, int]:
    """Parses ``"name:nth[,name:nth...]"`` into ``{name: nth}``."""
    targets: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, nth = part.rpartition(":")
        if not sep or not name or not nth.isdigit() or int(nth) < 1:
            raise ConfigError(
                f"{ENV_VAR}={spec!r}: {part!r} is not NAME:N with N >= 1",
                hint=f"write e.g. {ENV_VAR}=local.before_commit:3",
            )
        targets[name] = int(nth)
    return targets


def reload() -> None:
    """Re-reads :data:`ENV_VAR` and resets the counters."""
    spec = os.environ.get(ENV_VAR, "")
    with _lock:
        _targets.clear()
        _counts.clear()
        _targets.update(parse(spec) if spec else {})


reload()
