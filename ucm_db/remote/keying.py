"""Whether a remote is keyed or encrypted, recorded where a keyless node would meet it.

A remote used with auth keys (:mod:`ucm_db.auth`) is recorded as *keyed*
in two places: in every local store that opened it with keys (the
checksummed info record ``remote-keyed:<remote id>``, :func:`remote_id`)
and at the remote root (the object ``ROOT/auth.json``, :data:`MARKER_NAME`:
``{"keyed": true, "key_ids": [...]}``, key ids only, never keys). A keyless
open of a store whose record says keyed, or of a remote whose root holds
the marker, is refused with a :class:`~ucm_db.errors.ConfigError` naming
the fix. Without a key such a node would take unsigned (possibly planted)
objects into its local tier, which every reader trusts, so the keyed node
sharing the store would serve a forgery (issue 46 finding 3); and its puts
would rewrite the fleet's signed objects unsigned, which keyed readers then
miss for good (finding 4).

A remote used with encryption keys (:mod:`ucm_db.remote.sealing`) is
recorded as *encrypted* the same two ways: in every local store that opened
it with them (the checksummed info record ``remote-encrypted:<remote id>``,
key ids only) and at the root (``ROOT/encryption.json``,
:data:`ENCRYPTED_MARKER_NAME`: ``{"encrypted": true, "key_ids": [...]}``). An
open without encryption keys of that store with that remote, or of a remote
whose root holds the marker, is refused with a
:class:`~ucm_db.errors.ConfigError` naming the fix, before the uploader
exists. Without a key such an open (``ucm-db warm`` after a serving process
left uploads queued, or a node never given the key) uploaded KV as
plaintext objects: readable to whoever reads the bucket, and misses for
every node with the key.

Invariants:
    * An open first refuses on this store's records, then reads the root's
      markers of the keys it lacks (one bounded step: a keyless open reads
      both); once every refusal has passed, it records the store as keyed
      or encrypted for the keys it has and writes their markers where they
      are missing (whole-object writes, one bounded step), before anything
      of the remote is fetched. An open without a kind of key never writes
      that kind's record or marker.
    * A damaged local record reads as keyed (or encrypted): the safe side.
    * The marker guards against mistakes, not an attacker: whoever can
      write the bucket can delete it. What protects a keyed node's reads is
      the MAC; what keeps a keyless node from undermining it is this check.
    * Reaching the remote at open is bounded by :data:`MARKER_WAIT_S`: a
      remote that does not answer in time (or fails) is logged once and the
      open goes on; the local record still refuses a keyless open.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ucm_db.auth import AuthKeys, key_id
from ucm_db.engines.base import Engine, Txn
from ucm_db.errors import ConfigError
from ucm_db.index import records
from ucm_db.remote.manifests import ENCRYPTED_MARKER_NAME
from ucm_db.remote.manifests import KEYED_MARKER_NAME as MARKER_NAME
from ucm_db.remote.sealing import SealingKeys

logger = logging.getLogger("ucm_db.remote")

#: Info record name prefix; the remote's 16-byte id follows.
RECORD_PREFIX = b"remote-keyed:"
#: Info record name prefix of an encrypted remote; the remote's 16-byte id follows.
ENCRYPTED_RECORD_PREFIX = b"remote-encrypted:"
#: Longest wait at open for the marker's read (and write).
MARKER_WAIT_S = 10.0
_MAX_MARKER_BYTES = 1 << 16


def remote_id(url: str) -> bytes:
    """16 bytes naming a remote URL (trailing slashes ignored)."""
    return hashlib.blake2b(url.rstrip("/").encode(), digest_size=16).digest()


@dataclass(frozen=True)
class _Kind:
    """A kind of remote key and where an open records it (module docstring)."""

    field: str        # the root marker's field: "keyed", "encrypted"
    prefix: bytes     # this store's info record, the remote's id after it
    marker: str       # the root's marker
    key: str          # the key, as the messages name it
    store_risk: str   # what an open without it would do to a store that used it
    remote_risk: str  # what a node without it would do on such a remote
    settings: str     # the store options that give it
    flags: str        # the CLI's flags that give it

    def store_refusal(self, store_path: str, url: str) -> ConfigError:
        return ConfigError(
            f"the store at {store_path} used the remote {url.rstrip('/')} with {self.key}; opening it without one "
            f"{self.store_risk}",
            hint=f"pass the same {self.settings} (ucm-db: {self.flags}), or open the store without the remote")

    def remote_refusal(self, url: str) -> ConfigError:
        return ConfigError(
            f"the remote {url.rstrip('/')} is {self.field} (its {self.marker} says so): a node without the key "
            f"{self.remote_risk}",
            hint=f"pass the fleet's key ({self.settings}; ucm-db: {self.flags}), or use another remote")


KEYED = _Kind("keyed", RECORD_PREFIX, MARKER_NAME, "an auth key",
              "would take unsigned objects into the local tier, which every reader of this store trusts",
              "would take unsigned objects into its local tier and rewrite the fleet's signed objects unsigned",
              "remote_auth_key_file / remote_auth_key_env", "--auth-key-file / --auth-key-env")
ENCRYPTED = _Kind("encrypted", ENCRYPTED_RECORD_PREFIX, ENCRYPTED_MARKER_NAME, "an encryption key",
                  "would upload its queued blocks and its puts as plaintext, readable to whoever reads the remote and "
                  "missed by every node with the key",
                  "would upload its blocks as plaintext, readable to whoever reads the remote and missed by every node "
                  "with it", "remote_encryption_key_file / remote_encryption_key_env",
                  "--encryption-key-file / --encryption-key-env")


def recorded(txn: Txn, kind: _Kind, url: str) -> bool:
    """Whether this store recorded ``url`` as of ``kind`` (a damaged record counts)."""
    try:
        return records.get_checked(txn, kind.prefix + remote_id(url)) is not None
    except records.DamagedRecord:
        return True


def record(txn: Txn, kind: _Kind, url: str, key_ids: list[bytes]) -> None:
    """Records ``url`` as of ``kind`` in this store (key ids only), unless it is already."""
    if recorded(txn, kind, url):
        return
    value = json.dumps({"remote": url.rstrip("/"), "key_ids": [k.hex() for k in key_ids]}, sort_keys=True)
    records.put_checked(txn, kind.prefix + remote_id(url), value.encode())


def check_keying(engine: Engine, url: str, options: dict[str, Any], auth: AuthKeys | None, *, store_path: str,
                 sealing: SealingKeys | None = None) -> None:
    """Refuses an open without a kind of key (auth, encryption) of a remote
    this store used with one, or whose root's marker says it needs one;
    records the kinds it has (module invariants). Called at open, before
    the remote wing exists."""
    given = {ENCRYPTED: None if sealing is None else list(sealing.key_ids),
             KEYED: None if auth is None else [key_id(k) for k in auth.keys]}
    lacking = [kind for kind, ids in given.items() if ids is None]
    for kind in lacking:
        if engine.read(functools.partial(recorded, kind=kind, url=url)):
            raise kind.store_refusal(store_path, url)
    # One bounded step reads the markers of the kinds this open lacks, another writes those of the kinds it has.
    present = _bounded(lambda: [kind for kind in lacking if _marker(url, options, kind)], url) if lacking else None
    for kind in present or ():
        raise kind.remote_refusal(url)
    having = {kind: ids for kind, ids in given.items() if ids is not None}
    for kind, ids in having.items():
        engine.write(functools.partial(record, kind=kind, url=url, key_ids=ids))
    if having:
        _bounded(lambda: _ensure_markers(url, options, having), url)


def _root(url: str, options: dict[str, Any]) -> Any:
    from ucm_db.remote.tier import RemoteRoot  # fsspec only where a remote is used

    return RemoteRoot.from_url(url, dict(options))


def _marker(url: str, options: dict[str, Any], kind: _Kind) -> bool:
    """Whether the root's marker of ``kind`` says the remote needs its key.
    Read as objects and manifests are (:meth:`~ucm_db.remote.tier.RemoteRoot.read_range`:
    one bounded request; on a directory a regular file only, never blocking):
    a FIFO in its place held the open for :data:`MARKER_WAIT_S`, then the
    open went on as if there were no marker."""
    root = _root(url, options)
    path = f"{root.root}/{kind.marker}"
    data = root.read_range(path, 0, _MAX_MARKER_BYTES + 1)
    if data is None:
        return path in root.quarantined  # something not a regular file in its place: the safe side
    if len(data) > _MAX_MARKER_BYTES:
        return True  # not ours to parse; whoever put it meant it
    try:
        return bool(json.loads(bytes(data)).get(kind.field, True))
    except (ValueError, AttributeError, RecursionError):
        return True  # damaged: the safe side


def _ensure_markers(url: str, options: dict[str, Any], having: dict[_Kind, list[bytes]]) -> bool:
    """Writes the root's marker of each kind in ``having`` (key ids only) where it is missing."""
    from ucm_db.remote.files import write_whole

    for kind, ids in having.items():
        if not _marker(url, options, kind):
            root = _root(url, options)
            body = {kind.field: True, "key_ids": [k.hex() for k in ids]}
            write_whole(root.fs, f"{root.root}/{kind.marker}", json.dumps(body, sort_keys=True).encode())
    return True


def _bounded(step: Any, url: str) -> Any:
    """``step()`` on a daemon thread, waited for at most
    :data:`MARKER_WAIT_S`; its value, or None (logged) when it fails or does
    not finish."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(step())
        except Exception as exc:  # noqa: BLE001 - any remote failure: logged, the open goes on
            outcome.append(exc)

    thread = threading.Thread(target=run, name="ucm-db-remote-keying", daemon=True)
    thread.start()
    thread.join(MARKER_WAIT_S)
    if not outcome:
        logger.warning("remote %s: no answer about its markers (%s, %s) within %.0f s; going on", url, MARKER_NAME,
                       ENCRYPTED_MARKER_NAME, MARKER_WAIT_S)
        return None
    if isinstance(outcome[0], Exception):
        logger.warning("remote %s: cannot read or write its markers (%s, %s): %s; going on", url, MARKER_NAME,
                       ENCRYPTED_MARKER_NAME, outcome[0])
        return None
    return outcome[0]
