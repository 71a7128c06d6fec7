"""Audit (events): ``ucm-db events`` (the replay of
:mod:`ucm_db.maintenance.event_replay`) tells every block the live stream
tells, with the same ``extra_keys``.

A salted, LoRA, multimodal or prompt-embeds request's blocks are saved with
vLLM's ``extra_keys`` (connector/events.py ``block_extra_keys``), packed as
record version 2. The live stream (:class:`~ucm_db.connector.events.FeedEvents`)
publishes them; the replay dropped every such record from its JSON lines as
"malformed" (the fast formatter reads version 1 only) and left their
``extra_keys`` out of its dicts, so a router fed by ``ucm-db events`` never
learnt those blocks, nor could it match a salted prompt.

Real parts: a real LMDB store, the real replay, the connector's real
``FeedEvents`` over the same store.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import ucm_db
from ucm_db import BlockEventFields, Namespace, maintenance

NS = Namespace(model="audit-extra", kv_dtype="bfloat16", block_size=4)


def _fill(path: Path) -> list[bytes]:
    """Three blocks of one chain: the first salted, the second with a
    multimodal item and a prompt-embeds digest, the third plain."""
    keys = NS.block_keys(list(range(12)))
    salted = BlockEventFields(b"h0" * 8, None, (0, 1, 2, 3), 4, None, None, 0, 0, ("salt-a",))
    mm = BlockEventFields(b"h1" * 8, b"h0" * 8, (4, 5, 6, 7), 4, None, None, 0, 0, (("img-7", 0), b"\x00\xff"))
    plain = BlockEventFields(b"h2" * 8, b"h1" * 8, (8, 9, 10, 11), 4, None, None, 0, 0, None)
    with ucm_db.open(path) as store:
        store.put(NS, keys, [b"x" * 64] * 3, event_fields=dict(zip(keys, (salted, mm, plain))))
    return keys


def test_the_json_lines_tell_blocks_with_extra_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fill(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="ucm_db"):
        lines = [json.loads(line) for line in maintenance.iter_event_lines(tmp_path / "store")]
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]  # nothing is malformed here
    assert [line["block_hashes"] for line in lines] == [[(b"h0" * 8).hex()], [(b"h1" * 8).hex()], [(b"h2" * 8).hex()]]
    assert [line.get("extra_keys") for line in lines] == [[["salt-a"]], [[["img-7", 0], "00ff"]], None]


@pytest.mark.usefixtures("feed_from_zero")  # the feed is read from seq 0
def test_the_dicts_and_the_lines_agree(tmp_path: Path) -> None:
    keys = _fill(tmp_path / "store")
    with ucm_db.open(tmp_path / "store") as store:
        assert store.delete(NS, keys[1:])  # the removal of a block with extra_keys is told too
    dicts = list(maintenance.iter_events(tmp_path / "store"))
    lines = [json.loads(line) for line in maintenance.iter_event_lines(tmp_path / "store")]
    assert dicts == lines and len(dicts) == 1 and dicts[0]["extra_keys"] == [["salt-a"]]
    since = [json.loads(line) for line in maintenance.iter_event_lines(tmp_path / "store", since_seq=0)]
    assert since == list(maintenance.iter_events(tmp_path / "store", since_seq=0))
    removed = [e["block_hashes"] for e in since if e["type"] == "BlockRemoved"]
    assert sorted(removed) == [[(b"h1" * 8).hex()], [(b"h2" * 8).hex()]]  # the multimodal block's removal is not lost


def test_the_replay_tells_what_the_live_stream_tells(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockStored

    from ucm_db.connector.events import FeedEvents

    _fill(tmp_path / "store")
    with ucm_db.open(tmp_path / "store") as store:
        feed = FeedEvents(store, NS)
        live = feed.take()
        for _ in range(200):  # the inventory is read in a thread: it arrives within a few steps
            if live:
                break
            live = feed.take()
    assert all(isinstance(e, BlockStored) for e in live) and len(live) == 3
    lines = [json.loads(line) for line in maintenance.iter_event_lines(tmp_path / "store")]

    def plain(value: object) -> object:
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value.hex() if isinstance(value, bytes) else value

    assert [plain(e.extra_keys) for e in live] == [line.get("extra_keys") for line in lines]
