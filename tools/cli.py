"""The ``ucm-db`` command line: one click group, one module per command.

Exit status: 0 ok; 1 problems found (corrupt blocks, skipped imports, a
failed operation); 2 usage or configuration error (bad options, no store at
the path, a format that needs ``ucm-db migrate``, a store held by another
process). Errors print one line to stderr with the fix (the error's hint);
under ``--json`` stdout also holds the error as one JSON document.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ucm_db import ConfigError, FormatVersionError, LockedError, UcmDbError

from ucm_db.tools.archive_cmds import export_command, import_command
from ucm_db.tools.compact_cmd import compact_command
from ucm_db.tools.events_cmd import events_command
from ucm_db.tools.inspect_cmd import inspect_command
from ucm_db.tools.invalidate_cmd import invalidate_command
from ucm_db.tools.lookup_cmd import lookup_command
from ucm_db.tools.migrate_cmd import migrate_command
from ucm_db.tools.pin_cmds import pin_command, unpin_command
from ucm_db.tools.proxy_cmd import proxy_command
from ucm_db.tools.remote_cmds import gc_command, warm_command
# `ucm-db bench`: a lazy group; the benchmarks are imported only when one runs.
from ucm_db.tools.cli_bench import bench_group
from ucm_db.tools.verify_cmd import verify_command
from ucm_db.tools.cli_common import EXIT_PROBLEMS, EXIT_USAGE, JSON_META_KEY, error_document

#: Errors that mean "the command or its configuration must change".
USAGE_ERRORS = (ConfigError, FormatVersionError, LockedError)


def exit_code_for(exc: UcmDbError) -> int:
    return EXIT_USAGE if isinstance(exc, USAGE_ERRORS) else EXIT_PROBLEMS


#: Key in ``click.Context.meta`` holding the command line the group parsed.
ARGV_META_KEY = "ucm_db.argv"


def _json_requested(ctx: click.Context) -> bool:
    argv = ctx.meta.get(ARGV_META_KEY, [])
    before_separator = argv[: argv.index("--")] if "--" in argv else argv
    return bool(ctx.meta.get(JSON_META_KEY)) or "--json" in before_separator


def report_error(ctx: click.Context, exc: BaseException, exit_code: int) -> None:
    """One line on stderr; under ``--json`` also the error document on stdout."""
    if _json_requested(ctx):
        click.echo(json.dumps(error_document(exc, exit_code), indent=2, sort_keys=True))
    if isinstance(exc, click.ClickException):
        exc.show()
    else:
        click.echo(f"ucm-db: error: {exc}", err=True)


class UcmDbGroup(click.Group):
    """Turns ucm-db errors (and, under ``--json``, usage errors) into one
    stderr line, the JSON error document when asked, and an exit status."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV_META_KEY] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UcmDbError as exc:
            report_error(ctx, exc, exit_code_for(exc))
            ctx.exit(exit_code_for(exc))
        except click.ClickException as exc:
            if not _json_requested(ctx):
                raise
            report_error(ctx, exc, EXIT_USAGE)
            ctx.exit(EXIT_USAGE)


@click.group(cls=UcmDbGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ucm-db", prog_name="ucm-db")
def cli() -> None:
    """ucm-db: look after a KV-cache block store.

    \b
    Example:
        ucm-db inspect /var/cache/ucm-db
    """


for command in (inspect_command, verify_command, compact_command, gc_command, export_command, import_command,
                warm_command, bench_group, migrate_command, invalidate_command, events_command, proxy_command,
                pin_command, unpin_command, lookup_command):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ucm-db`` script."""
    try:
        result = cli.main(args=argv, prog_name="ucm-db", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_PROBLEMS
    except SystemExit as exc:
        if isinstance(exc.code, str):  # sys.exit("message"): show the message, as Python itself would
            click.echo(exc.code, err=True)
            return EXIT_PROBLEMS
        return int(exc.code or 0)
    return int(result or 0) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
