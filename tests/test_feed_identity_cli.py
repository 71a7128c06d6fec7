"""``ucm-db events --since SEQ --feed-id ID``: a follower resumes from the
seq and feed id of the last line it read (``--with-feed-id`` puts the id on
every line); a store whose feed is another one (made again at the path)
is told on stderr, then AllBlocksCleared and the inventory are printed
instead of records read under the seq. Through CliRunner, and the real
entry point once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import ucm_db
from ucm_db.tools.cli import cli
from tests.test_feed_identity import _evented_puts, same_start  # noqa: F401 - a fixture


def _invoke(*args: object, expect: int = 0) -> Result:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == expect, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def _lines(result: Result) -> list[dict[str, object]]:
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.usefixtures("same_start")
def test_a_saved_cursor_of_a_deleted_store_is_explained_and_replayed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        _evented_puts(store, 2)
    first = _lines(_invoke("events", path, "--with-feed-id"))
    assert len(first) == 4 and len({e["feed_id"] for e in first}) == 1
    saved_seq, saved_id = first[-1]["seq"], first[-1]["feed_id"]
    resumed = _invoke("events", path, "--since", saved_seq, "--feed-id", saved_id)  # the same feed: nothing new, no warning
    assert resumed.stdout == "" and resumed.stderr == ""
    shutil.rmtree(path)
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        _evented_puts(store, 5, first_token=100)  # passes saved_seq in the new feed
    result = _invoke("events", path, "--since", saved_seq, "--feed-id", saved_id)
    events = _lines(result)
    new_id = events[0]["feed_id"]
    assert events[0] == {"type": "AllBlocksCleared", "medium": "STORAGE", "feed_id": new_id} and new_id != saved_id
    assert len(events) == 11 and all(e["type"] == "BlockStored" and e["feed_id"] == new_id for e in events[1:])
    assert f"is not the one --feed-id names (feed_id {saved_id}, now {new_id})" in result.stderr
    assert "the store was created again" in result.stderr and "pass them as --since and --feed-id" in result.stderr


def test_lines_carry_no_feed_id_unless_asked_and_feed_id_needs_since(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        start = store.feed_position()
        _evented_puts(store, 1)
    assert all("feed_id" not in e for e in _lines(_invoke("events", path, "--since", start)))  # as before feed ids
    refused = _invoke("events", path, "--feed-id", "00" * 16, expect=2)
    assert "--feed-id names the feed --since's seq came from" in refused.stderr and "add --since SEQ" in refused.stderr


def test_the_real_entry_point_resumes_with_the_feed_id(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path, capacity_bytes=1 << 30) as store:
        _evented_puts(store, 1)
        feed_id = store.event_inventory().feed_id
        saved = store.feed_position()
        _evented_puts(store, 1, first_token=1)
    exe = Path(sys.executable).parent / "ucm-db"
    done = subprocess.run([str(exe), "events", str(path), "--since", str(saved), "--feed-id", feed_id],
                          capture_output=True, text=True, timeout=120, check=True)
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["seq"], e["feed_id"]) for e in events] == [(saved, feed_id), (saved + 1, feed_id)] and done.stderr == ""
