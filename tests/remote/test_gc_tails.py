"""``ucm-db gc`` evicts from the tails (audit finding: gc deleted whole live trees).

Objects are immutable and a hit never refreshes them, so the blocks of a
shared system prompt are always the oldest on the remote. gc used to rank
objects by their own upload time: ``--older-than`` took the shared blocks for
old however young the conversations under them, ``--max-bytes`` took them
first, and the cascade that keeps whole prefixes then removed every
conversation (a 5% trim emptied the remote). An object's age for the rules
is now that of the youngest object in its subtree, and ``--max-bytes``
removes tails (oldest first), counting the cascade, only until the remote is
within its limit.

Each test writes through a real LMDB store to a real ``file://`` remote (the
uploader's layout and envelopes), then sets upload times with ``os.utime``
so ages are exact, and runs ``ucm-db gc`` in-process through ``CliRunner``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db.keys import Namespace
from ucm_db.remote.gc import gc
from ucm_db.remote.tier import RemoteRoot, unpack_object
from ucm_db.tools.cli import cli

pytestmark = pytest.mark.timeout(180)
NS = Namespace(model="test/gc-tails", kv_dtype="bfloat16", block_size=4, layout="test")
CAP = 64 << 20
DAY_S = 86400
SYSTEM = list(range(8))  # 2 blocks every conversation shares
CONVERSATIONS = 12
TURN_BLOCKS = 4  # blocks of each conversation under the system prompt


def conversation(i: int) -> list[int]:
    return SYSTEM + [1000 + i] * (TURN_BLOCKS * NS.block_size)


def payload(key: bytes, i: int) -> bytes:
    return key * 8 + bytes([i % 256]) * 512


def written_remote(tmp_path: Path) -> tuple[str, list[bytes], list[list[bytes]]]:
    """A file:// remote holding the system prompt (10 days old) and the
    conversations under it, conversation i uploaded ``CONVERSATIONS - i``
    minutes ago (0 is the oldest); returns the url, the system prompt's keys
    and each conversation's own keys."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    system = NS.block_keys(SYSTEM)
    turns = [NS.block_keys(conversation(i))[len(system):] for i in range(CONVERSATIONS)]
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through") as store:
        store.put(NS, system, [payload(k, i) for i, k in enumerate(system)])
        for keys in turns:
            store.put(NS, keys, [payload(k, i) for i, k in enumerate(keys)], parent=system[-1])
    now_s = time.time()
    age(url, system, now_s - 10 * DAY_S)
    for i, keys in enumerate(turns):
        age(url, keys, now_s - 60 * (CONVERSATIONS - i))
    return url, system, turns


def age(url: str, keys: list[bytes], mtime_s: float) -> None:
    tier = RemoteRoot.from_url(url).tier(NS.digest[:16])
    for key in keys:
        os.utime(tier.path(key), (mtime_s, mtime_s))


def remote_objects(url: str) -> dict[bytes, bytes | None]:
    """Every object on the remote, verified: key -> parent."""
    root = RemoteRoot.from_url(url)
    root.fs.invalidate_cache()
    tier = root.tier(NS.digest[:16])
    return {key: unpack_object(root.fs.cat_file(tier.path(key)), key).parent for key in tier.iterate()}


def object_bytes(url: str, keys: list[bytes]) -> int:
    tier = RemoteRoot.from_url(url).tier(NS.digest[:16])
    return sum(os.path.getsize(tier.path(key)) for key in keys)


def run_gc(url: str, *limits: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["gc", url, *limits, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def assert_whole_prefixes(objects: dict[bytes, bytes | None]) -> None:
    orphans = [k.hex()[:16] for k, parent in objects.items() if parent is not None and parent not in objects]
    assert orphans == [], f"objects whose parent gc removed: {orphans}"


def test_older_than_keeps_an_old_shared_prompt_while_conversations_under_it_are_young(tmp_path: Path) -> None:
    """The audit's repro (t5b): 40 conversations written seconds ago under a
    system prompt written earlier; ``--older-than`` removed the prompt by its
    own age, then every conversation with it (removed_by_rule 2,
    removed_descendants 160, bytes_after 0). Here the prompt is 10 days old,
    one conversation too, the others minutes old: gc removes that one
    conversation only."""
    url, system, turns = written_remote(tmp_path)
    age(url, turns[0], time.time() - 10 * DAY_S)  # a conversation nobody continued: it goes
    before = remote_objects(url)
    stale_bytes = object_bytes(url, turns[0])

    report = run_gc(url, "--older-than", "7d")

    after = remote_objects(url)
    assert report["removed_by_rule"] == TURN_BLOCKS and report["removed_descendants"] == 0, report
    assert set(before) - set(after) == set(turns[0])
    assert all(key in after for key in system), "the shared prompt has young conversations under it"
    assert report["removed_bytes"] == stale_bytes and report["bytes_after"] == report["bytes_before"] - stale_bytes
    assert_whole_prefixes(after)

    # A fresh node still reads a live conversation through, prompt included.
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_deadline_s=10) as reader:
        keys = NS.block_keys(conversation(CONVERSATIONS - 1))
        expected = [payload(k, i) for i, k in enumerate(system)] + [payload(k, i) for i, k in enumerate(turns[-1])]
        assert [None if v is None else bytes(v) for v in reader.get(NS, keys)] == expected

    # Once nothing under it is young, the prompt is old: everything goes.
    everything_old = time.time() - 10 * DAY_S
    for keys in turns[1:]:
        age(url, keys, everything_old)
    assert run_gc(url, "--older-than", "7d")["bytes_after"] == 0 and remote_objects(url) == {}


def test_max_bytes_trims_the_oldest_tails_only_as_far_as_needed(tmp_path: Path) -> None:
    """The audit's repro (t5): ``--max-bytes`` at 95% of the remote removed
    the shared prompt first (the oldest objects) and the cascade took the
    whole remote (bytes_after 0). Now it removes the oldest conversation's
    tail blocks until the remote fits, and nothing else."""
    url, system, turns = written_remote(tmp_path)
    total = object_bytes(url, system + [k for keys in turns for k in keys])
    target = total * 95 // 100
    largest = max(object_bytes(url, [k]) for k in system + [k for keys in turns for k in keys])

    dry = run_gc(url, "--max-bytes", str(target), "--dry-run")
    report = run_gc(url, "--max-bytes", str(target))

    assert {k: dry[k] for k in ("removed_objects", "removed_bytes")} == {k: report[k] for k in ("removed_objects", "removed_bytes")}
    assert report["bytes_before"] == total
    assert target - largest < report["bytes_after"] <= target, report  # only as much as needed
    assert report["removed_descendants"] == 0
    after = remote_objects(url)
    assert_whole_prefixes(after)
    assert all(key in after for key in system)
    removed = set(k for keys in turns for k in keys) - set(after)
    oldest_first = [k for keys in turns for k in reversed(keys)]  # the oldest conversation's tail first
    assert removed == set(oldest_first[: len(removed)]), "tails of the oldest conversations go first"
    assert all(all(k in after for k in keys) for keys in turns[1:])


def test_max_bytes_removes_a_shared_prompt_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit that holds only the prompt and one conversation keeps the
    newest conversation and the prompt it hangs from; a limit of 0 then
    removes everything, children before their parents at every step (a gc
    stopped midway leaves no orphan)."""
    url, system, turns = written_remote(tmp_path)
    keep = object_bytes(url, system + turns[-1])

    report = run_gc(url, "--max-bytes", str(keep))

    assert report["bytes_after"] == keep and report["removed_descendants"] == 0, report
    assert set(remote_objects(url)) == set(system + turns[-1])

    root = RemoteRoot.from_url(url)
    removed: list[str] = []
    remove = root.fs.rm_file

    def recorded(path: str) -> None:
        parent = unpack_object(root.fs.cat_file(path), bytes.fromhex(path.rsplit("/", 1)[1])).parent
        assert parent is None or not any(p.endswith(parent.hex()) for p in removed), "a parent went before its child"
        removed.append(path)
        remove(path)

    monkeypatch.setattr(root.fs, "rm_file", recorded)
    gc(root, older_than_s=None, max_bytes=0, dry_run=False)
    monkeypatch.undo()
    assert len(removed) == len(system) + TURN_BLOCKS and remote_objects(url) == {}
