"""``ucm-db events``: the store's KV cache events as JSON lines, for a
router that starts late (the inventory replay) or follows the store.

The command cannot import vLLM: each line is one event with vLLM's field
names (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``; a bytes block
hash as hex, an int hash as an int), plus ``seq``, ``namespace`` and ``key``.
The lines come from :func:`ucm_db.maintenance.iter_event_lines`.
"""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from ucm_db import ConfigError, maintenance
from ucm_db.tools.cli_common import CliPath, SecondsRange

#: Lines written at once (one write per line costs a replay of 100k blocks ~0.5 s).
_LINES_PER_WRITE = 4096


@click.command("events")
@click.argument("path", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable.")
@click.option("--since", "since_seq", type=click.IntRange(min=0), default=None,
              help="Print the change feed from this seq on, without the inventory first.")
@click.option("--follow", is_flag=True, help="Keep printing new events as they are committed (Ctrl-C stops).")
@click.option("--poll-interval", "poll_interval_s", type=SecondsRange(min=0.01, max=3600), default=0.5, show_default=True,
              help="Seconds between feed reads under --follow.")
def events_command(path: Path, namespaces: tuple[str, ...], since_seq: int | None, follow: bool, poll_interval_s: float) -> None:
    """Print the store's KV cache events as JSON lines: a BlockStored line
    per block the store holds that was saved through the vLLM connector
    (parents first), then the change feed's BlockStored/BlockRemoved lines
    from that snapshot on. Blocks stored without vLLM's event fields
    (`warm`, `import`, remote promotion) are left out. Read-only.

    \b
    Example:
        ucm-db events /var/cache/ucm-db --follow | my-router-feed
    """
    ctx = click.get_current_context()
    if not follow and ctx.get_parameter_source("poll_interval_s") != ParameterSource.DEFAULT:
        raise ConfigError("--poll-interval sets how often --follow reads the feed; without --follow it does nothing",
                          hint="add --follow to keep reading new events, or drop --poll-interval")
    try:
        lines = maintenance.iter_event_lines(path, namespaces, since_seq=since_seq, follow=follow, poll_interval_s=poll_interval_s)
        batch: list[str] = []
        for line in lines:
            batch.append(line)
            if follow or len(batch) >= _LINES_PER_WRITE:
                click.echo("\n".join(batch))  # flushes: a follower sees each event as it comes
                batch = []
        if batch:
            click.echo("\n".join(batch))
    except KeyboardInterrupt:
        return
