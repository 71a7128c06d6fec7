"""Shared pieces of the ``ucm-db`` commands: output, progress, errors.

Invariants:
    * Human output goes to stdout; with ``--json`` stdout holds exactly one
      JSON document and nothing else (progress bars and warnings go to
      stderr, and progress is off under ``--json``). An error under
      ``--json`` is that document too: ``{"error": {...}}``.
    * The commands reach stores only through :mod:`ucm_db.maintenance`,
      :mod:`ucm_db.migrations` and the public ``ucm_db`` API.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
#: Key in ``click.Context.meta`` set when the command was given ``--json``.
JSON_META_KEY = "ucm_db.json"

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


class CliPath(click.Path):
    """A path argument of the commands (a :class:`pathlib.Path`). An empty
    string is a usage error: pathlib reads it as ".", so `ucm-db import A ""`
    wrote a store into the current directory (``ucm_db.open("")`` refuses)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("an empty path names nothing (it would be read as '.'); pass '.' for the current directory", param, ctx)
        return super().convert(value, param, ctx)


class SecondsRange(click.FloatRange):
    """A finite number of seconds in a range: nan and inf are refused (a
    FloatRange lets nan through, and ``time.sleep(inf)`` raises)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[JSON_META_KEY] = True
    return value


def json_option(fn: F) -> F:
    """``--json``: print one JSON document instead of the human report (the
    error, if the command fails)."""
    return click.option("--json", "as_json", is_flag=True, callback=_remember_json,
                        help="Print a JSON document for scripts.")(fn)


def wants_json(ctx: click.Context | None) -> bool:
    """Whether the running command was given ``--json``."""
    return bool(ctx is not None and ctx.meta.get(JSON_META_KEY))


def error_document(exc: BaseException, exit_code: int) -> dict[str, Any]:
    """The ``--json`` form of a failed command: type, message, hint, exit code."""
    if isinstance(exc, click.ClickException):
        message, hint = exc.format_message(), None
    else:
        message, hint = str(exc), getattr(exc, "hint", None) or None
        if hint and message.endswith(f" (hint: {hint})"):
            message = message[: -len(f" (hint: {hint})")]
    return {"error": {"type": type(exc).__name__, "message": message, "hint": hint, "exit_code": exit_code}}


def emit(as_json: bool, data: dict[str, Any], human: Callable[[dict[str, Any]], str]) -> None:
    """Prints ``data`` as JSON or as the human report ``human(data)``."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        click.echo(human(data))


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


class ProgressBar:
    """A stderr progress bar fed ``(done, total)`` (a maintenance
    :data:`~ucm_db.maintenance.ProgressFn`), created on the first update;
    does nothing under ``--json`` or when stderr is not a terminal."""

    def __init__(self, enabled: bool, label: str) -> None:
        self._enabled = enabled and sys.stderr.isatty()
        self._label = label
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled or total <= 0:
            return
        if self._bar is None:
            self._bar = click.progressbar(length=total, label=self._label, file=sys.stderr, show_pos=True)
            self._bar.__enter__()
        self._bar.update(max(0, done - self._bar.pos))

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None


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



def auth_options(purpose: str) -> Callable[[Any], Any]:
    """``--auth-key-file`` / ``--auth-key-env`` (:mod:`ucm_db.auth`'s key
    format), for a command that uses the keys to ``purpose``."""
    def decorate(fn: Any) -> Any:
        fn = click.option("--auth-key-env", metavar="NAME", default=None,
                          help=f"Environment variable holding hex auth key(s) (its name, not the key) to {purpose}.")(fn)
        return click.option("--auth-key-file", type=CliPath(), default=None,
                            help=f"Key file: hex auth keys, one per line, the first signs; mode 600. To {purpose}.")(fn)
    return decorate


def encryption_options(purpose: str) -> Callable[[Any], Any]:
    """``--encryption-key-file`` / ``--encryption-key-env`` (the same key
    format, keys of their own: AES-256-GCM, needs ``cryptography``), for a
    command that uses the keys to ``purpose``."""
    def decorate(fn: Any) -> Any:
        fn = click.option("--encryption-key-env", metavar="NAME", default=None,
                          help=f"Environment variable holding hex encryption key(s) (its name, not the key) to {purpose}.")(fn)
        return click.option("--encryption-key-file", type=CliPath(), default=None,
                            help=f"Key file: hex encryption keys, one per line, the first encrypts; mode 600. To {purpose}.")(fn)
    return decorate
