"""The epochs an archive carries (issue 48): the invalidation epoch travels
with the blocks.

An archive of version 2 (:data:`~ucm_db.maintenance.archive.ARCHIVE_VERSION`)
holds ``"epochs": {namespace id hex: epoch}`` in its ``manifest.json``, one
entry per namespace it describes: inside the bytes the archive MAC covers
(:mod:`ucm_db.maintenance.archive.macs`), so a signed archive's epochs are
authenticated with its blocks.

Invariants:
    * Export refuses (:class:`~ucm_db.store.epochs.EpochUnknownError`, before
      writing anything) a namespace whose epoch the store cannot establish:
      an archive never carries a guessed epoch.
    * Import records, before any block is written, ``max(store's epoch,
      carried epoch)`` for each namespace (:func:`ucm_db.store.epochs.adopt`):
      epochs only move forward. A namespace whose epoch the store cannot
      establish stays unknown (the archive's may be older than the lost
      one) and is reported.
    * Import marks every namespace it records shared
      (:mod:`ucm_db.store.shared_epochs`): the source's epochs may be a
      fleet's, counted through a remote this store has not met, so an
      invalidation here without that remote takes a fresh epoch, never the
      next count (which a fleet node may claim meanwhile: both
      invalidations would then live at one epoch, each side serving the
      other's blocks: tests/remote/test_epoch_seeded_by_import.py).
    * An archive of version 1 (ucm-db before epochs travelled) carries no
      epoch: each of its namespaces is read as "epoch unknown", and import
      lowers nothing and raises nothing: the store keeps its epochs and the
      archive's blocks keep their keys (a note in the report says so).
      Archives of version 2 are refused by ucm-db before it ("export it
      again with this ucm-db"), rather than imported without their epochs.
    * A carried epoch must leave room to bump (:mod:`ucm_db.store.epochs`):
      import refuses (ConfigError, before anything is written) one at or
      above :data:`~ucm_db.store.epochs.CARRIED_EPOCH_LIMIT` (2**48, above
      every epoch a store reaches) unless an auth key authenticated the
      archive, and then one at or above
      :data:`~ucm_db.store.epochs.SIGNED_EPOCH_LIMIT` (2**63, where the
      engines' private epochs start); an archive carrying 2**64 - 1 made its
      namespace impossible to invalidate. A store epoch at or above 2**63
      (an older ucm-db took it) is unknown, so export refuses it like any
      unknown epoch (one ``ucm-db invalidate`` records a fresh one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError
from ucm_db.store import epochs, shared_epochs
from ucm_db.store.view import StoreView

_DAMAGED = "the archive is damaged or not written by ucm-db export; export it again"
NO_EPOCH_NOTE = ("the archive carries no epoch (exported by a ucm-db before epochs travelled with archives): this store's "
                 "epoch is kept; if the source store was ever invalidated, run `ucm-db invalidate` on this one too")


def export_epochs(view: StoreView, namespace_ids: list[bytes]) -> dict[str, int]:
    """The epoch of each exported namespace, by id hex; raises
    EpochUnknownError for one the store cannot establish."""
    states = view.engine.read(lambda txn: {ns_id: epochs.state(txn, ns_id) for ns_id in namespace_ids})
    for ns_id, found in states.items():
        fix = f"run `ucm-db invalidate {view.path} --namespace {ns_id.hex()}` first, or export the other namespaces (--namespace)"
        if found.epoch is None:
            error = epochs.unknown_error(ns_id, found.problem, str(view.path))
            raise epochs.EpochUnknownError(f"cannot export: {error.message}", hint=fix)
    return {ns_id.hex(): found.epoch for ns_id, found in states.items() if found.epoch is not None}


def carried_epochs(manifest: dict[str, Any], archive: Path, *, signed: bool = False) -> dict[str, int | None]:
    """The epoch each namespace of a checked manifest carries (None:
    unknown, a version-1 archive); ConfigError if version 2's are malformed
    or above the ceiling (``signed``: an auth key authenticated the
    manifest; module invariants)."""
    if manifest["version"] == 1:
        return {ns_hex: None for ns_hex in manifest["namespaces"]}
    carried = manifest.get("epochs")
    if not isinstance(carried, dict) or set(carried) != set(manifest["namespaces"]):
        raise ConfigError(f"{archive}: the manifest's epochs do not name exactly its namespaces", hint=_DAMAGED)
    for ns_hex, epoch in carried.items():
        if not epochs.is_epoch(epoch):
            raise ConfigError(f"{archive}: namespace {ns_hex} carries epoch {str(epoch)[:40]!r}, not an epoch", hint=_DAMAGED)
        if epoch >= epochs.carried_limit(signed):
            raise _over_ceiling(archive, ns_hex, epoch, signed)
    return dict(carried)


def _over_ceiling(archive: Path, ns_hex: str, epoch: int, signed: bool) -> ConfigError:
    if signed:
        return ConfigError(
            f"{archive}: namespace {ns_hex} carries epoch {epoch}, at or above 2**63, where the engines' private epochs "
            "start (no store records one); nothing was imported",
            hint=f"on the source store run `ucm-db invalidate SOURCE --namespace {ns_hex}` (it records a fresh epoch, "
                 "below the ceiling) and export it again")
    return ConfigError(
        f"{archive}: namespace {ns_hex} carries epoch {epoch}, at or above 2**48, the most a store takes from an archive "
        "imported without an auth key (no store reaches such an epoch by invalidations); nothing was imported",
        hint="the archive was altered, or its source took the epoch from a signed archive: export it again from the "
             "source with --auth-key-file and import it with the same key (signed epochs are taken up to 2**63)")


def adopt_epochs(store: Any, carried: dict[str, int | None]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Records the carried epochs in ``store`` (an open Store) before any
    block is written; returns ``({id hex: {"carried", "epoch", "note"}},
    problems)``: one problem line per namespace whose epoch the store
    cannot establish."""
    rows: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for ns_hex, epoch in sorted(carried.items()):
        found = store._epochs.adopt(bytes.fromhex(ns_hex), epoch)
        note = NO_EPOCH_NOTE if epoch is None else None
        if found.epoch is None:
            problems.append(str(epochs.unknown_error(bytes.fromhex(ns_hex), found.problem, str(store.path))))
        else:
            shared_epochs.mark(store._engine, bytes.fromhex(ns_hex))  # its source's epochs may be a fleet's
        rows[ns_hex] = {"carried": epoch, "epoch": found.epoch, "note": note}
    return rows, problems
