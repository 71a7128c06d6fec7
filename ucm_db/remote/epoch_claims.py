"""Epoch claims: how the nodes sharing a remote number their namespaces'
epochs, so that two invalidations never share one.

A node that moves a namespace's epoch on (``Store.bump_epoch``, ``ucm-db
invalidate --remote``) *claims* the new epoch on the remote before it
records it: it creates ``ROOT/epoch-claims/<namespace short id>/<epoch>``
(20 decimal digits; a small JSON document carrying the epoch as a manifest
does, signed with an auth key where one is configured) where none is, with
:func:`~ucm_db.remote.files.write_new` (a hard link on a directory, a
conditional put, ``If-None-Match``, on S3). The namespace's
``manifest.json`` then carries it for the nodes meeting the remote later
(:mod:`ucm_db.remote.manifests`).

An audit found two nodes taking the same epoch (each counted from the
epoch it had read when it first met the remote, or a node invalidated
without the remote), so the node invalidating served the other node's
blocks stored before its own invalidation; or a bump landing *below* the
fleet's epoch. Hence:

Invariants:
    * Two bumps never share an epoch: each records only an epoch whose
      claim it created, and a claim is created only where none is (a
      claimer finding one takes the next number). Where a file system
      cannot create exclusively (no hard links, an S3 server without
      conditional puts) :func:`~ucm_db.remote.files.write_new` checks the
      name first: a claimer in between goes unseen.
    * A bump goes above the fleet: above the manifest's epoch (a verified
      one, or one signed by a key rotated out, up to
      :data:`~ucm_db.remote.manifests.UNVERIFIED_EPOCH_LIMIT`) and above
      every claim listed (one listing of the namespace's claims, each read
      from the highest down, at most :data:`MAX_CLAIM_READS`: a claim no
      configured key signed is followed only below
      :data:`~ucm_db.remote.manifests.UNVERIFIED_EPOCH_LIMIT`, so a planted
      one cannot use up the epoch space). The first number it tries is the caller's choice
      (:func:`ucm_db.store.shared_epochs.claimable`: the plain count where
      it is free, so a namespace's first bump still gives 1).
    * The manifest converges on the highest claim: after writing its epoch
      (never lowering, :func:`~ucm_db.remote.manifests.record_epoch`), a
      claimer lists the claims again and raises the manifest to a higher
      one it finds, so two bumps whose manifest writes cross leave the
      higher epoch, not the later write.
    * An epoch a store took without the remote (and so could not claim) is
      claimed when the store tells it to the remote (:func:`publish`),
      unless a claim made after it was taken is there (a review found a
      partitioned node's fresh epoch, told later, raising the fleet above an
      invalidation made meanwhile through the remote, whose nodes then
      served the partitioned node's blocks of before it): the tell is then
      :class:`EpochSuperseded`, and the store bumps through the remote
      instead (:mod:`ucm_db.store.epoch_gate`).
    * Claims are never removed (one small object per invalidation);
      ``ucm-db gc`` leaves the directory alone (a root marker,
      :data:`~ucm_db.remote.manifests.ROOT_MARKERS`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from ucm_db.errors import EpochSupersededError as EpochSuperseded, TierError, UcmDbError
from ucm_db.remote.files import write_new
from ucm_db.remote.manifests import (
    EPOCH_CLAIMS_NAME, ManifestError, RemoteRoot, epoch_fields, epoch_of, read_manifest, record_epoch, rotated_out_epoch,
)

#: Numbers a bump tries past claims that are already there before it gives up (the remote is then taken as not reached).
MAX_CLAIM_STEPS = 64
#: Claims above the manifest's epoch read, from the highest listed down, looking for one that verifies.
MAX_CLAIM_READS = 8
#: Rounds of raising the manifest to a higher claim found after writing it.
MAX_PUBLISH_ROUNDS = 4
_MAX_CLAIM_BYTES = 1 << 12
_DIGITS = 20


def claims_dir(root: RemoteRoot, namespace_id: bytes) -> str:
    """Where the namespace's claims live (``ROOT/epoch-claims/<short id>``)."""
    return f"{root.root}/{EPOCH_CLAIMS_NAME}/{namespace_id[:8].hex()}"


def claim_path(root: RemoteRoot, namespace_id: bytes, epoch: int) -> str:
    return f"{claims_dir(root, namespace_id)}/{epoch:0{_DIGITS}d}"


def claim(root: RemoteRoot, namespace_id: bytes, choose: Callable[[int], int], description: dict[str, Any],
          deadline: float) -> int | UcmDbError:
    """Claims a new epoch of the namespace above the fleet's (module
    invariants) and makes the manifest carry it; returns it, or the error
    ``choose`` raised (an answer, not a failure of the remote: no epoch is
    left above the fleet's, :class:`~ucm_db.store.epochs.EpochSpaceError`).

    Args:
        choose: the first epoch to try, given the highest epoch found on the
            remote (0: none); claims already there push it further up.
        deadline: ``time.monotonic()`` after which no further request starts.

    Raises:
        TierError: the deadline passed, or :data:`MAX_CLAIM_STEPS` numbers were taken.
        Exception: remote failures propagate (the caller takes an epoch no node can have taken).
    """
    try:
        epoch = choose(highest_claim(root, namespace_id, _manifest_floor(root, namespace_id), signed_only=False))
    except UcmDbError as exc:
        return exc
    for _ in range(MAX_CLAIM_STEPS):
        if time.monotonic() > deadline:
            raise TierError(f"claiming an epoch of namespace {namespace_id.hex()} on remote {root.root} ran out of time",
                            hint="check remote/remote_options; the bump took an epoch no other node can have taken")
        if _create(root, namespace_id, epoch):
            publish(root, namespace_id, epoch, description, claimed=True)
            return epoch
        epoch += 1  # another node's claim: above it
    raise TierError(f"{MAX_CLAIM_STEPS} epochs of namespace {namespace_id.hex()} from {epoch - MAX_CLAIM_STEPS} on are "
                    f"claimed on remote {root.root} already", hint=f"look at {claims_dir(root, namespace_id)}")


def publish(root: RemoteRoot, namespace_id: bytes, epoch: int, description: dict[str, Any], *, claimed: bool = False,
            taken_unix_s: float | None = None) -> EpochSuperseded | None:
    """Makes the manifest carry ``epoch`` unless it carries a higher one,
    then raises it to a higher claim found (module invariants). An epoch not
    ``claimed`` here (taken without the remote, at ``taken_unix_s`` where
    known: a fresh epoch's clock) is claimed first where no claim of it is;
    where a claim made after ``taken_unix_s`` is there, nothing is written
    and the answer is :class:`EpochSuperseded` (returned, not raised: an
    answer of the remote, not its failure)."""
    if not claimed:
        if taken_unix_s is not None and claimed_after(root, namespace_id, taken_unix_s):
            return EpochSuperseded(f"epoch {epoch} of namespace {namespace_id.hex()} was taken without remote {root.root} "
                                   "before another node's invalidation claimed there")
        _create(root, namespace_id, epoch)
    top = epoch
    for _ in range(MAX_PUBLISH_ROUNDS):
        record_epoch(root, namespace_id, top, description)
        higher = highest_claim(root, namespace_id, top, signed_only=True)
        if higher <= top:
            return None
        top = higher
    return None


def claimed_after(root: RemoteRoot, namespace_id: bytes, taken_unix_s: float) -> bool:
    """Whether a claim of the namespace that verifies (a key rotated out
    too) says it was made after ``taken_unix_s`` (one listing, at most
    :data:`MAX_CLAIM_READS` claims read, the highest first)."""
    listed = _listed_claims(root, namespace_id)
    for epoch in listed[:MAX_CLAIM_READS]:
        document = _claim_document(root, namespace_id, epoch)
        if document is None:
            continue
        made_s = document.get("claimed_unix_s")
        if (isinstance(made_s, (int, float)) and not isinstance(made_s, bool) and made_s > taken_unix_s
                and _floor_of(root, namespace_id, document, signed_only=False) == epoch):
            return True
    return False


def highest_claim(root: RemoteRoot, namespace_id: bytes, above: int, *, signed_only: bool) -> int:
    """The highest claim above ``above`` that verifies (one listing, at most
    :data:`MAX_CLAIM_READS` claims read); ``above`` where none does.
    ``signed_only``: not one signed by a key rotated out either."""
    listed = _listed_claims(root, namespace_id)
    for epoch in [e for e in listed if e > above][:MAX_CLAIM_READS]:
        if _verified(root, namespace_id, epoch, signed_only):
            return epoch
    return above


def _manifest_floor(root: RemoteRoot, namespace_id: bytes) -> int:
    """The manifest's epoch as a bump goes above it: a verified one, one a
    key rotated out signed, else 0 (none, or malformed: the bump rewrites it)."""
    try:
        manifest = read_manifest(root, namespace_id)
    except ManifestError:
        return 0
    return 0 if manifest is None else _floor_of(root, namespace_id, manifest, signed_only=False) or 0


def _floor_of(root: RemoteRoot, namespace_id: bytes, document: dict[str, Any], *, signed_only: bool) -> int | None:
    epoch, problem = epoch_of(root, namespace_id, document)
    if problem is None:
        return epoch
    return None if signed_only else rotated_out_epoch(root, document)


def _listed_claims(root: RemoteRoot, namespace_id: bytes) -> list[int]:
    """The epochs the namespace's claims name, highest first (one listing; none where no claim is)."""
    root.count(requests=1)
    try:
        names = root.fs.ls(claims_dir(root, namespace_id), detail=False)
    except FileNotFoundError:
        return []
    return sorted({int(n) for n in map(_basename, names) if len(n) == _DIGITS and n.isdigit()}, reverse=True)


def _verified(root: RemoteRoot, namespace_id: bytes, epoch: int, signed_only: bool) -> bool:
    document = _claim_document(root, namespace_id, epoch)
    return document is not None and _floor_of(root, namespace_id, document, signed_only=signed_only) == epoch


def _claim_document(root: RemoteRoot, namespace_id: bytes, epoch: int) -> dict[str, Any] | None:
    data = root.read_range(claim_path(root, namespace_id, epoch), 0, _MAX_CLAIM_BYTES + 1)
    if data is None or len(data) > _MAX_CLAIM_BYTES:
        return None
    try:
        document = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _create(root: RemoteRoot, namespace_id: bytes, epoch: int) -> bool:
    """Creates the claim of ``epoch`` where none is; False where one is."""
    body = {"namespace_id": namespace_id.hex(), "claimed_unix_s": round(time.time(), 3),
            **epoch_fields(root, namespace_id, epoch)}
    root.count(requests=1, puts=1)
    return write_new(root.fs, claim_path(root, namespace_id, epoch), json.dumps(body, sort_keys=True).encode())


def _basename(path: Any) -> str:
    return os.path.basename(str(path).rstrip("/"))
