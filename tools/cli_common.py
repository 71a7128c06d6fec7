"""Shared pieces of the ``ucm-db`` commands: output, progress, store views.

Invariants:
    * Human output goes to stdout; with ``--json`` stdout holds exactly one
      JSON document and nothing else (progress bars and warnings go to
      stderr, and progress is off under ``--json``).
    * :func:`store_view` never creates or changes a store: it opens the
      engine alone (read-only where the engine allows) and writes no reader
      activity, so looking at a live store does not disturb it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from ucm_db.migrations.access import open_engine, read_format_version, require_store
from ucm_db.storelock import hold_shared
from ucm_db.store import CREATED_KEY, SETTINGS_KEY, STORE_FORMAT_VERSION
from ucm_db.tiers.base import Engine
from ucm_db.tiers.local import LocalTier

F = TypeVar("F", bound=Callable[..., Any])
#: Seconds a read-only view waits for a running compact/migrate.
VIEW_LOCK_WAIT_S = 30.0

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def json_option(fn: F) -> F:
    """``--json``: print one JSON document instead of the human report."""
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document for scripts.")(fn)


def emit(as_json: bool, data: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    """Prints ``data`` as JSON or as the human report ``human(data)``."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        click.echo(human(data))


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def progress(enabled: bool, length: int, label: str) -> Any:
    """A click progress bar on stderr, or a do-nothing stand-in."""
    if not enabled or length <= 0 or not sys.stderr.isatty():
        return nullcontext(_NoBar())
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)


class _NoBar:
    def update(self, n: int) -> None:
        pass


def human_bytes(n: float) -> str:
    """``1536 -> "1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table with left-aligned columns."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


@dataclass
class StoreView:
    """A store opened below the Store API (see module invariants)."""

    path: Path
    engine_name: str
    engine: Engine
    tier: LocalTier
    format_version: int
    settings: dict[str, Any]
    created: dict[str, Any] | None

    @property
    def current_format(self) -> bool:
        return self.format_version == STORE_FORMAT_VERSION


@contextmanager
def store_view(path: str | Path, *, writable: bool = False) -> Iterator[StoreView]:
    """Opens the store at ``path`` for tools (read-only unless ``writable``)."""
    path = Path(path)
    name = require_store(path)
    lock = hold_shared(path, VIEW_LOCK_WAIT_S)
    try:
        engine = open_engine(path, read_only=not writable, sync=True)
        try:
            settings_raw, created_raw = engine.read(lambda txn: (_copy(txn.get("info", SETTINGS_KEY)), _copy(txn.get("info", CREATED_KEY))))
            settings = json.loads(settings_raw) if settings_raw else {}
            view = StoreView(
                path, name, engine, LocalTier(engine, capacity_bytes=int(settings.get("capacity_bytes", 1 << 62))),
                read_format_version(engine), settings, json.loads(created_raw) if created_raw else None,
            )
            yield view
        finally:
            engine.close()
    finally:
        lock.release()


def _copy(value: Any) -> bytes | None:
    return None if value is None else bytes(value)
