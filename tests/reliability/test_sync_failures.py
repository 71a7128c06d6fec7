"""A group store whose syncs fail stops acknowledging puts.

The disk under the store is the power-cut file system (``powercut/fs.py``)
told to fail every sync with EIO, as a disk that stopped taking writes
back: commits still land in the page cache, nothing becomes durable. A
store that went on acknowledging puts would lose all of them at the next
power loss; it refuses them once two sync budgets are committed since the
last sync that succeeded, and takes them again once a sync succeeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db

from .harness import NS, chain_tokens, payload_for, put_once_taken_again, put_until_refused
from .powercut import PowerCutMount

pytestmark = [pytest.mark.multiprocess]

BUDGET_BYTES = 1 << 20  # sync_bytes: the budget between syncs
BLOCK_BYTES = 128 << 10
OPTIONS = {"codec": "none", "durability": "group", "sync_bytes": BUDGET_BYTES, "sync_interval_s": 0.05,
           "capacity_bytes": 64 << 20}


def test_puts_are_refused_while_syncs_fail_and_resume_once_one_succeeds(tmp_path: Path) -> None:
    keys = NS.block_keys(chain_tokens("sync-failures", 64))
    with PowerCutMount(tmp_path / "mnt", tmp_path) as mount:
        with ucm_db.open(tmp_path / "mnt" / "store", **OPTIONS) as store:
            store.put(NS, keys[:1], [payload_for(keys[0], BLOCK_BYTES)])
            store.flush()
            mount.fail_syncs(True)
            acknowledged, refused = put_until_refused(store, keys, BLOCK_BYTES)
            assert "syncs fail" in str(refused) and "Input/output error" in str(refused), refused
            unsynced_bytes = (acknowledged - 1) * BLOCK_BYTES
            assert 2 * BUDGET_BYTES <= unsynced_bytes <= 4 * BUDGET_BYTES, \
                f"{acknowledged} puts acknowledged with every sync failing"
            with pytest.raises(ucm_db.TierError):
                store.flush()  # an explicit sync fails too, and says so
            assert store.lookup(NS, keys) == acknowledged, "a refused put stores nothing"

            mount.fail_syncs(False)  # the background's next round syncs, and puts are taken again
            put_once_taken_again(store, keys, acknowledged, BLOCK_BYTES, "the disk took syncs again")
            store.flush()
        mount.cut("drop", 1)  # the power loss: what was acknowledged and flushed is on the disk
        with ucm_db.open(tmp_path / "mnt" / "store", **OPTIONS) as store:
            assert store.lookup(NS, keys) == acknowledged + 1
