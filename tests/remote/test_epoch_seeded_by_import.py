"""A store seeded by ``ucm-db import`` from a node of a fleet, invalidated before it ever met the fleet's remote,
never shares an epoch number with an invalidation the fleet made meanwhile.

Found by the epoch-travel review (tests/test_review_epoch_travel_fuzz.py's note): such a store counted its offline
invalidation on (1 -> 2, the namespace was not marked shared: it had never met a remote), while a fleet node claimed
2 through the remote. When the seeded store joined, both invalidations lived at epoch 2: each side served the other's
blocks as its own. Now an imported namespace is marked shared (its source's epochs may be a fleet's), so an offline
invalidation takes a fresh epoch, which no count reaches, and is told to the remote at the store's next contact
(where a later claim of the fleet makes it claim above both).
"""

from __future__ import annotations

from pathlib import Path

import ucm_db
from tests import epoch_reads
from ucm_db import Namespace, maintenance
from ucm_db.maintenance.archive import export_archive, import_archive
from ucm_db.store.epochs import FRESH_EPOCH_BASE

NS = Namespace(model="test/epoch-seeded", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(21, 21 + 4 * 4))


def payloads(tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(64, b".") for i in range(len(TOKENS) // 4)]


def put(store: ucm_db.Store, tag: str) -> None:
    store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), payloads(tag))


def test_an_import_seeded_store_invalidated_offline_never_lands_on_the_fleets_epoch(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    fleet, seeded = tmp_path / "fleet", tmp_path / "seeded"
    with ucm_db.open(fleet, remote=url) as store:
        put(store, "v1")
        assert store.bump_epoch(NS) == 1  # claimed through the remote
        store.flush(upload_timeout_s=60)
    export_archive(fleet, tmp_path / "seed.tar")
    import_archive(tmp_path / "seed.tar", seeded)
    [row] = maintenance.invalidate(seeded, (NS.id.hex(),))  # offline: the seeded store never met the remote
    assert row["epoch"] >= FRESH_EPOCH_BASE and row["remote"] == "pending", row
    with ucm_db.open(seeded) as store:
        put(store, "seeded")  # computed under the seeded store's own invalidation
    with ucm_db.open(fleet, remote=url) as store:
        assert store.bump_epoch(NS) == 2  # the fleet's next invalidation, claimed meanwhile
        put(store, "fleet")
        store.flush(upload_timeout_s=60)
    with ucm_db.open(seeded, remote=url) as store:  # the seeded store joins the fleet
        epoch = store.epoch(NS)
        # Its fresh epoch was taken before the fleet's claim of 2, which it must not undo: it claims above both
        # (epoch_gate's tell), so neither invalidation's blocks are served as the other's.
        assert epoch >= row["epoch"] > 2
        served = epoch_reads.served(store, NS, TOKENS)
        assert not set(served) & set(payloads("fleet")), served
    with ucm_db.open(fleet, remote=url) as store:  # the fleet node learns of it at its next start
        assert store.epoch(NS) == epoch
        assert not set(epoch_reads.served(store, NS, TOKENS)) & set(payloads("seeded"))
