"""An epoch met elsewhere never takes a namespace past the room to
invalidate it, and a bump always moves it on.

Audit finding: an archive carrying epoch 2**64 - 1 (a valid epoch) was
imported; every later ``ucm-db invalidate`` failed ("its epoch would pass
2**64; it is not served") while lookups still served the old blocks, and the
hint named the command that had just failed. Now an archive's epoch is taken
below 2**48 (2**63, where the engines' private epochs start, where an auth
key authenticated it), as the remote takes its manifests'
(tests/remote/test_epoch_ceiling_remote.py). A store epoch at or above 2**63
(an older ucm-db took it unbounded) is unknown: not served until an
invalidation records a fresh one. A bump never records a lower epoch (a
review found the first fix's wrap at the top brought the old epoch back at
the next import or remote contact): at the top it fails.

Every case reads through :func:`served`, keyed at ``store.epoch(ns)`` as the
connector is: no block stored before an invalidation ever comes back.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import ucm_db
from tests import epoch_reads
from ucm_db import ConfigError, Namespace, maintenance
from ucm_db.auth import load_keys
from ucm_db.maintenance.archive.macs import AUTH_MEMBER, ArchiveSigner
from ucm_db.remote import manifests
from ucm_db.store import epochs

NS = Namespace(model="test/epoch-ceiling", kv_dtype="bfloat16", block_size=4)
NS_HEX = NS.digest[:16].hex()
TOKENS = list(range(21, 21 + 4 * 4))
OLD = [f"old-{i}".encode().ljust(64, b".") for i in range(len(TOKENS) // 4)]


def served(store: ucm_db.Store) -> list[bytes]:
    return epoch_reads.served(store, NS, TOKENS)


def store_at(path: Path, epoch: int) -> None:
    """A store holding OLD at ``epoch``: what a ucm-db before the ceilings
    left after taking that epoch from an archive or a remote (test-only write
    of the epoch record)."""
    with ucm_db.open(path) as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), OLD)
        store.put(NS, NS.block_keys(TOKENS, epoch=epoch), OLD)  # its chain at that epoch
        store._engine.write(lambda txn: epochs._put(txn, NS.id, epoch))
        if epoch < epochs.SIGNED_EPOCH_LIMIT:
            assert store.epoch(NS) == epoch and served(store) == OLD


def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "auth.key"
    path.write_text(bytes(range(32)).hex() + "\n")
    path.chmod(0o600)
    return path


def rewritten(archive: Path, out: Path, epoch: int, key: Path | None = None) -> Path:
    """``archive`` with its namespace's epoch set to ``epoch`` (re-signed with ``key``)."""
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    manifest = json.loads(members.pop("manifest.json"))
    manifest["epochs"][NS_HEX] = epoch
    data = json.dumps(manifest).encode()
    members.pop(AUTH_MEMBER, None)
    signer = ArchiveSigner(load_keys(key, None)) if key is not None else None  # type: ignore[arg-type]
    with tarfile.open(out, "w") as tar:
        for name, body in [("manifest.json", data), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
            if signer is not None and name != "manifest.json":
                signer.block(bytes.fromhex(name.removeprefix("blocks/")), body)
        if signer is not None:
            signer.manifest(data)
            auth = signer.member()
            info = tarfile.TarInfo(AUTH_MEMBER)
            info.size = len(auth)
            tar.addfile(info, io.BytesIO(auth))
    return out


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    with ucm_db.open(tmp_path / "src") as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), OLD)
    maintenance.export_archive(tmp_path / "src", tmp_path / "x.tar")
    return tmp_path / "x.tar"


@pytest.mark.parametrize("epoch", [2**64 - 1, 2**62, 2**48])
def test_an_archive_epoch_past_the_ceiling_is_refused_before_anything_is_written(tmp_path: Path, archive: Path,
                                                                                 epoch: int) -> None:
    planted = rewritten(archive, tmp_path / "planted.tar", epoch)
    with ucm_db.open(tmp_path / "dst") as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), OLD)
    with pytest.raises(ConfigError, match=r"at or above 2\*\*48.*nothing was imported") as caught:
        maintenance.import_archive(planted, tmp_path / "dst")
    assert "--auth-key-file" in (caught.value.hint or "")
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.epoch(NS) == 0 and store.bump_epoch(NS) == 1  # untouched, and invalidation works
    with pytest.raises(ConfigError):
        maintenance.import_archive(planted, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_an_archive_epoch_just_below_the_ceiling_is_taken_and_can_still_be_invalidated(tmp_path: Path, archive: Path) -> None:
    maintenance.import_archive(rewritten(archive, tmp_path / "high.tar", 2**48 - 1), tmp_path / "dst")
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.epoch(NS) == 2**48 - 1
        assert store.bump_epoch(NS) == 2**48 and served(store) == []


def test_a_signed_archive_carries_an_epoch_up_to_2_63_and_only_with_its_key(tmp_path: Path, archive: Path) -> None:
    key = key_file(tmp_path)
    signed = rewritten(archive, tmp_path / "signed.tar", 2**50, key)
    with pytest.raises(ConfigError, match=r"2\*\*48"):  # without the key nothing authenticates it
        maintenance.import_archive(signed, tmp_path / "unkeyed")
    report = maintenance.import_archive(signed, tmp_path / "keyed", auth_key_file=key)
    assert report["epochs"][NS_HEX]["epoch"] == 2**50 and report["stored"] == len(OLD)
    with ucm_db.open(tmp_path / "keyed") as store:
        assert store.bump_epoch(NS) == 2**50 + 1
    with pytest.raises(ConfigError, match=r"at or above 2\*\*63") as caught:
        maintenance.import_archive(rewritten(archive, tmp_path / "top.tar", 2**63, key), tmp_path / "top", auth_key_file=key)
    assert "ucm-db invalidate" in (caught.value.hint or "")
    assert not (tmp_path / "top").exists()


def test_a_bump_never_records_a_lower_epoch_so_a_reimport_cannot_bring_the_old_one_back(tmp_path: Path, archive: Path) -> None:
    """Review finding: a signed archive at 2**62 - 1 was taken; the bump
    wrapped to a fresh, lower epoch, and importing the same archive again
    raised the namespace back to 2**62 - 1, serving the old blocks."""
    key = key_file(tmp_path)
    high = rewritten(archive, tmp_path / "high.tar", 2**62 - 1, key)
    maintenance.import_archive(high, tmp_path / "dst", auth_key_file=key)
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.epoch(NS) == 2**62 - 1
        store.put(NS, NS.block_keys(TOKENS, epoch=2**62 - 1), OLD)  # an engine's blocks at that epoch
        assert served(store) == OLD
        assert store.bump_epoch(NS) == 2**62 and served(store) == []
    maintenance.import_archive(high, tmp_path / "dst", auth_key_file=key)
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.epoch(NS) == 2**62 and served(store) == []
        assert store.bump_epoch(NS) == 2**62 + 1


def test_a_bump_at_the_top_of_the_epoch_space_fails_and_records_nothing(tmp_path: Path, archive: Path) -> None:
    key = key_file(tmp_path)
    maintenance.import_archive(rewritten(archive, tmp_path / "top.tar", 2**63 - 1, key), tmp_path / "dst", auth_key_file=key)
    with ucm_db.open(tmp_path / "dst") as store:
        with pytest.raises(epochs.EpochSpaceError, match=r"2\*\*63"):
            store.bump_epoch(NS)
        assert store.epoch(NS) == 2**63 - 1  # nothing lower recorded


@pytest.mark.parametrize("epoch", [2**64 - 1, 2**63])
def test_a_store_epoch_an_older_ucm_db_took_past_2_63_is_unknown_until_invalidated(tmp_path: Path, epoch: int) -> None:
    store_at(tmp_path / "s", epoch)  # as an older ucm-db left it
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(epochs.EpochUnknownError, match=r"at or above 2\*\*63"):
            store.epoch(NS)
        assert served(store) == []  # not served meanwhile
        new = store.bump_epoch(NS)
        assert epochs.FRESH_EPOCH_BASE <= new < epochs.CARRIED_EPOCH_LIMIT and served(store) == []
        assert store.bump_epoch(NS) == new + 1


def test_ucm_db_invalidate_fixes_a_store_an_older_ucm_db_took_past_the_top(tmp_path: Path) -> None:
    """The audit's repro: `invalidate` exited 1 and lookups still served."""
    store_at(tmp_path / "s", 2**64 - 1)
    cli = Path(sys.executable).with_name("ucm-db")
    result = subprocess.run([str(cli), "invalidate", str(tmp_path / "s"), "--namespace", NS.model],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with ucm_db.open(tmp_path / "s") as store:
        assert store.epoch(NS) < epochs.CARRIED_EPOCH_LIMIT and served(store) == []


def test_export_refuses_an_epoch_past_2_63_and_names_invalidate(tmp_path: Path) -> None:
    store_at(tmp_path / "s", 2**63)
    with pytest.raises(epochs.EpochUnknownError, match=r"at or above 2\*\*63") as caught:
        maintenance.export_archive(tmp_path / "s", tmp_path / "x.tar")
    assert f"ucm-db invalidate {tmp_path / 's'}" in (caught.value.hint or "")
    assert not (tmp_path / "x.tar").exists()
    maintenance.invalidate(tmp_path / "s", (NS.model,))  # the fix the hint names
    maintenance.export_archive(tmp_path / "s", tmp_path / "x.tar")
    maintenance.import_archive(tmp_path / "x.tar", tmp_path / "dst")
    with ucm_db.open(tmp_path / "dst") as store:
        assert store.epoch(NS) < epochs.CARRIED_EPOCH_LIMIT and served(store) == []


def test_adopt_and_bump_refuse_numbers_past_the_ceiling(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s") as store:
        with pytest.raises(ValueError):
            epochs.adopt(store._engine, NS.id, 2**63)
        with pytest.raises(ValueError):
            epochs.bump(store._engine, NS.id, floor=2**63)
        assert epochs.adopt(store._engine, NS.id, 2**63 - 2).epoch == 2**63 - 2
        assert epochs.bump(store._engine, NS.id) == 2**63 - 1
        with pytest.raises(epochs.EpochSpaceError):
            epochs.bump(store._engine, NS.id)


def test_the_remote_wing_holds_the_same_ceilings() -> None:
    """The wing never imports the store, so it keeps its own copy of the numbers."""
    assert manifests.UNKEYED_EPOCH_LIMIT == epochs.CARRIED_EPOCH_LIMIT == epochs.carried_limit(signed=False)
    assert manifests.KEYED_EPOCH_LIMIT == epochs.SIGNED_EPOCH_LIMIT == epochs.carried_limit(signed=True)
    assert epochs.FRESH_EPOCH_BASE < epochs.fresh_epoch() < manifests.UNVERIFIED_EPOCH_LIMIT == epochs.CARRIED_EPOCH_LIMIT


def test_a_lost_epoch_is_repaired_above_the_highest_epoch_the_store_recorded(tmp_path: Path) -> None:
    """Review finding: the namespace had taken 2**45 (an unsigned archive may
    carry up to 2**48), was invalidated to 2**45 + 1, then its record was
    damaged; the repair recorded a fresh epoch (about 2**41), below both, and
    re-importing an archive taken at 2**45 raised the namespace back to it:
    every block stored before the invalidation was served again."""
    path = tmp_path / "s"
    with ucm_db.open(path) as store:
        epochs.adopt(store._engine, NS.id, 2**45)
        store.put(NS, NS.block_keys(TOKENS, epoch=2**45)[:2], OLD[:2])
    maintenance.export_archive(path, tmp_path / "early.tar")  # carries 2**45
    with ucm_db.open(path) as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=2**45), OLD)
        assert store.bump_epoch(NS) == 2**45 + 1 and served(store) == []
        name = epochs.EPOCH_PREFIX + NS.id
        store._engine.write(lambda txn: txn.put("info", name, (2**45 + 1 ^ 1).to_bytes(8, "little")))  # bit rot
    with ucm_db.open(path) as store:
        repaired = store.bump_epoch(NS)  # what `ucm-db invalidate` records for a damaged epoch
        assert repaired > 2**45 + 1
    maintenance.import_archive(tmp_path / "early.tar", path)
    with ucm_db.open(path) as store:
        assert store.epoch(NS) == repaired and served(store) == []


def test_a_lost_epoch_with_a_damaged_high_water_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ucm_db.open(path) as store:
        store.put(NS, NS.block_keys(TOKENS, epoch=store.epoch(NS)), OLD)
        assert store.bump_epoch(NS) == 1
        store._engine.write(lambda txn: txn.put("info", epochs.EPOCH_PREFIX + NS.id, b"\x07" * 8))
        store._engine.write(lambda txn: txn.put("info", epochs.HIGH_KEY, b"\x07" * 8))
    with ucm_db.open(path) as store:
        with pytest.raises(epochs.EpochUnknownError, match="high-water"):
            store.bump_epoch(NS)
        assert served(store) == []
