"""``ucm-db events``: the store's KV cache events as JSON lines, for a
router that starts late (the inventory replay) or follows the store.

The command cannot import vLLM: each line is one event with vLLM's field
names (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``; a bytes block
hash as hex, an int hash as an int; ``--int-hashes``: a bytes hash as the
int vLLM's default events give it), plus ``seq``, ``namespace`` and ``key``
(and ``feed_id`` with ``--with-feed-id`` or ``--feed-id``: a seq means
something only in the feed it came from). The lines come from
:func:`ucm_db.maintenance.iter_event_lines`; a line ``AllBlocksCleared`` of
another feed than ``--feed-id`` (or the last line's) is explained on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from ucm_db import ConfigError, maintenance
from ucm_db.tools.cli_common import CliPath, SecondsRange

#: Lines written at once (one write per line costs a replay of 100k blocks ~0.5 s).
_LINES_PER_WRITE = 4096
_LOW_64_BITS = (1 << 64) - 1


@click.command("events")
@click.argument("path", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable.")
@click.option("--since", "since_seq", type=click.IntRange(min=0), default=None,
              help="Print the change feed from this seq on, without the inventory first.")
@click.option("--feed-id", default=None, metavar="ID",
              help="The feed_id of the line whose seq --since gives: if the store's feed is another one (the store was "
                   "created again, or an OS crash undid commits), print AllBlocksCleared and the inventory instead, "
                   "with a warning. Implies --with-feed-id.")
@click.option("--with-feed-id", is_flag=True, help="Add the change feed's feed_id to every line (save it with the seq).")
@click.option("--follow", is_flag=True, help="Keep printing new events as they are committed (Ctrl-C stops).")
@click.option("--int-hashes", is_flag=True,
              help="Print bytes block hashes as vLLM's live events do by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): "
                   "the low 64 bits as an int, so the lines match the hashes a router has from the engines.")
@click.option("--poll-interval", "poll_interval_s", type=SecondsRange(min=0.01, max=3600), default=0.5, show_default=True,
              help="Seconds between feed reads under --follow.")
def events_command(path: Path, namespaces: tuple[str, ...], since_seq: int | None, feed_id: str | None, with_feed_id: bool,
                   int_hashes: bool, follow: bool, poll_interval_s: float) -> None:
    """Print the store's KV cache events as JSON lines: a BlockStored line
    per block the store holds that was saved through the vLLM connector
    (parents first), then the change feed's BlockStored/BlockRemoved lines
    from that snapshot on. Blocks stored without vLLM's event fields
    (`warm`, `import`, remote promotion) are left out. Read-only. To resume
    later, save the last line's seq and feed_id (--with-feed-id) and pass
    them as --since and --feed-id.

    \b
    Example:
        ucm-db events /var/cache/ucm-db --follow --with-feed-id | my-router-feed
        ucm-db events /var/cache/ucm-db --since 4294967337 --feed-id 5f0c...e1 --follow
        ucm-db events /var/cache/ucm-db --int-hashes
    """
    ctx = click.get_current_context()
    if not follow and ctx.get_parameter_source("poll_interval_s") != ParameterSource.DEFAULT:
        raise ConfigError("--poll-interval sets how often --follow reads the feed; without --follow it does nothing",
                          hint="add --follow to keep reading new events, or drop --poll-interval")
    if feed_id is not None and since_seq is None:
        raise ConfigError("--feed-id names the feed --since's seq came from; without --since it does nothing",
                          hint="add --since SEQ (the seq of the line whose feed_id you pass), or drop --feed-id")
    try:
        lines = maintenance.iter_event_lines(path, namespaces, since_seq=since_seq, follow=follow, poll_interval_s=poll_interval_s,
                                             feed_id=feed_id, with_feed_id=with_feed_id)
        batch: list[str] = []
        shows_ids, known, source = with_feed_id or feed_id is not None, feed_id, "--feed-id names"
        for line in lines:
            if shows_ids and (known is None or line.startswith('{"type":"AllBlocksCleared"')):
                now = json.loads(line)["feed_id"]
                if known is not None and now != known:
                    _warn_feed_change(path, source, known, now)
                known, source = now, "the lines before came from"
            batch.append(_with_int_hashes(line) if int_hashes else line)
            if follow or len(batch) >= _LINES_PER_WRITE:
                click.echo("\n".join(batch))  # flushes: a follower sees each event as it comes
                batch = []
        if batch:
            click.echo("\n".join(batch))
    except KeyboardInterrupt:
        return


def _with_int_hashes(line: str) -> str:
    """``line`` with each bytes block hash (hex) as vLLM converts it for its
    int-hash events: the hash read big-endian, its low 64 bits; int hashes
    stay as they are (vLLM published them so already)."""
    event = json.loads(line)
    if "block_hashes" not in event:
        return line
    event["block_hashes"] = [_int_hash(h) for h in event["block_hashes"]]
    if event.get("parent_block_hash") is not None:
        event["parent_block_hash"] = _int_hash(event["parent_block_hash"])
    return json.dumps(event, separators=(",", ":"))


def _int_hash(value: str | int) -> int:
    return value if isinstance(value, int) else int(value, 16) & _LOW_64_BITS


def _warn_feed_change(path: Path, source: str, was: str, now: str) -> None:
    """Says on stderr why the events start over: the store's change feed is
    another one (a reader that fell behind the same feed is not warned)."""
    click.echo(f"ucm-db events: warning: the change feed of {path} is not the one {source} (feed_id {was or '(none)'}, "
               f"now {now or '(none)'}): the store was created again, or an OS crash undid commits not yet synced, so "
               f"its seqs name other records. Printed instead: AllBlocksCleared, then every block the store holds. Save "
               f"the seq and feed_id of the last line you read and pass them as --since and --feed-id next time.", err=True)
