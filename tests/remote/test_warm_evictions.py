"""A warm that asks for more than the local store holds says how much of it
was evicted before it ended (``WarmReport.evicted``), and logs a warning:
counted ``fetched`` alone, a warm larger than ``capacity_bytes`` looked
whole while its own later chains had evicted its earlier ones. A warm that
fits reports 0. Node A writes through a real LMDB store to a real
``file://`` directory; node B, a small real LMDB store, warms from it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import ucm_db
from ucm_db.keys import Namespace

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/warm-evictions", kv_dtype="bfloat16", block_size=4, layout="test")
CHAINS = 8
BLOCKS = 4
BLOCK_BYTES = 256 << 10
PROMPTS = [list(range(1000 * i + 1, 1000 * i + 1 + 4 * BLOCKS)) for i in range(CHAINS)]


def written(tmp_path: Path) -> str:
    remote = tmp_path / "remote"
    remote.mkdir()
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through",
                     codec="none") as a:
        for c, prompt in enumerate(PROMPTS):
            a.put(NS, NS.block_keys(prompt), [bytes([c, b]) * (BLOCK_BYTES // 2) for b in range(BLOCKS)])
    return f"file://{remote}"


def stored(store: ucm_db.Store) -> int:
    """Blocks the local tier holds (a lookup would count the remote's too)."""
    return store.stats().blocks


@pytest.mark.parametrize("capacity_blocks", [CHAINS * BLOCKS, 2 * BLOCKS])
def test_warm_reports_the_blocks_it_found_that_were_evicted_before_it_ended(
    tmp_path: Path, capacity_blocks: int, caplog: pytest.LogCaptureFixture,
) -> None:
    url = written(tmp_path)
    with ucm_db.open(tmp_path / "b", capacity_bytes=capacity_blocks * (BLOCK_BYTES + 1024), remote=url,
                     codec="none") as b:
        with caplog.at_level(logging.WARNING, logger="ucm_db"):
            report = b.warm(NS, token_sequences=PROMPTS)
        assert report.fetched == CHAINS * BLOCKS and report.missing == report.failed == 0
        kept = stored(b)
        assert report.evicted == report.fetched - kept
        if capacity_blocks < CHAINS * BLOCKS:
            assert report.evicted > 0 and "evicted before it ended" in caplog.text
            assert report.to_dict()["evicted"] == report.evicted
        else:
            assert report.evicted == 0 and "evicted" not in caplog.text
