"""The ``ucm-db`` command line: one click group, one module per command.

Exit status: 0 ok; 1 problems found (corrupt blocks, skipped imports, a
failed operation); 2 usage or configuration error (bad options, no store at
the path, a format that needs ``ucm-db migrate``, a store held by another
process). Errors print one line to stderr with the fix (the error's hint).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ucm_db.errors import ConfigError, FormatVersionError, LockedError, UcmDbError

from ucm_db.tools.archive import export_command, import_command
from ucm_db.tools.compact_cmd import compact_command
from ucm_db.tools.inspect_cmd import inspect_command
from ucm_db.tools.migrate_cmd import migrate_command
from ucm_db.tools.remote_cmds import bench_command, gc_command, warm_command
from ucm_db.tools.verify_cmd import verify_command
from ucm_db.tools.cli_common import EXIT_PROBLEMS, EXIT_USAGE

#: Errors that mean "the command or its configuration must change".
USAGE_ERRORS = (ConfigError, FormatVersionError, LockedError)


def exit_code_for(exc: UcmDbError) -> int:
    return EXIT_USAGE if isinstance(exc, USAGE_ERRORS) else EXIT_PROBLEMS


class UcmDbGroup(click.Group):
    """Turns ucm-db errors into one stderr line and a meaningful exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UcmDbError as exc:
            click.echo(f"ucm-db: error: {exc}", err=True)
            ctx.exit(exit_code_for(exc))


@click.group(cls=UcmDbGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ucm-db", prog_name="ucm-db")
def cli() -> None:
    """ucm-db: look after a KV-cache block store.

    \b
    Example:
        ucm-db inspect /var/cache/ucm-db
    """


for command in (inspect_command, verify_command, compact_command, gc_command, export_command, import_command,
                warm_command, bench_command, migrate_command):
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
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_PROBLEMS
    return int(result or 0) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
