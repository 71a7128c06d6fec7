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

import hashlib
import json
import logging
import threading
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


def recorded_keyed(txn: Txn, url: str) -> bool:
    """Whether this store recorded ``url`` as keyed (a damaged record counts)."""
    try:
        return records.get_checked(txn, RECORD_PREFIX + remote_id(url)) is not None
    except records.DamagedRecord:
        return True


def record_keyed(txn: Txn, url: str, auth: AuthKeys) -> None:
    """Records ``url`` as keyed in this store (key ids only)."""
    value = json.dumps({"remote": url.rstrip("/"), "key_ids": [key_id(k).hex() for k in auth.keys]}, sort_keys=True)
    records.put_checked(txn, RECORD_PREFIX + remote_id(url), value.encode())


def recorded_encrypted(txn: Txn, url: str) -> bool:
    """Whether this store recorded ``url`` as encrypted (a damaged record counts)."""
    try:
        return records.get_checked(txn, ENCRYPTED_RECORD_PREFIX + remote_id(url)) is not None
    except records.DamagedRecord:
        return True


def record_encrypted(txn: Txn, url: str, sealing: SealingKeys) -> None:
    """Records ``url`` as encrypted in this store (key ids only)."""
    value = json.dumps({"remote": url.rstrip("/"), "key_ids": [k.hex() for k in sealing.key_ids]}, sort_keys=True)
    records.put_checked(txn, ENCRYPTED_RECORD_PREFIX + remote_id(url), value.encode())


def check_keying(engine: Engine, url: str, options: dict[str, Any], auth: AuthKeys | None, *, store_path: str,
                 sealing: SealingKeys | None = None) -> None:
    """Refuses a keyless open of a keyed remote, or an open without
    encryption keys of a remote this store used encrypted; records a keyed
    or encrypted one (module invariants). Called at open, before the remote
    wing exists."""
    if sealing is None and engine.read(lambda txn: recorded_encrypted(txn, url)):
        raise ConfigError(
            f"the store at {store_path} used the remote {url.rstrip('/')} with an encryption key; opening it without "
            "one would upload its queued blocks and its puts as plaintext, readable to whoever reads the remote and "
            "missed by every node with the key",
            hint="pass the same remote_encryption_key_file / remote_encryption_key_env (ucm-db: --encryption-key-file / "
            "--encryption-key-env), or open the store without the remote",
        )
    if auth is None and engine.read(lambda txn: recorded_keyed(txn, url)):
        raise ConfigError(
            f"the store at {store_path} used the remote {url.rstrip('/')} with an auth key; opening it without one "
            "would take unsigned objects into the local tier, which every reader of this store trusts",
            hint="pass the same remote_auth_key_file / remote_auth_key_env (ucm-db: --auth-key-file / --auth-key-env), "
            "or open the store without the remote",
        )
    markers = {MARKER_NAME: ("keyed", auth), ENCRYPTED_MARKER_NAME: ("encrypted", sealing)}
    lacking = [(name, field) for name, (field, keys) in markers.items() if keys is None]
    # One bounded step reads the markers of the keys this open lacks (and another writes those of the keys it has).
    present = _bounded(lambda: [name for name, field in lacking if _marker(url, options, name, field)], url) if lacking else []
    if MARKER_NAME in (present or ()):
        raise ConfigError(
            f"the remote {url.rstrip('/')} is keyed (its {MARKER_NAME} says so): a node without the key would take "
            "unsigned objects into its local tier and rewrite the fleet's signed objects unsigned",
            hint="pass the fleet's key (remote_auth_key_file / remote_auth_key_env; ucm-db: --auth-key-file / "
            "--auth-key-env), or use another remote",
        )
    if ENCRYPTED_MARKER_NAME in (present or ()):
        raise ConfigError(
            f"the remote {url.rstrip('/')} is encrypted (its {ENCRYPTED_MARKER_NAME} says so): a node without the key "
            "would upload its blocks as plaintext, readable to whoever reads the remote and missed by every node with it",
            hint="pass the fleet's key (remote_encryption_key_file / remote_encryption_key_env; ucm-db: "
            "--encryption-key-file / --encryption-key-env), or use another remote",
        )
    bodies = {}
    if auth is not None:
        engine.write(lambda txn: None if recorded_keyed(txn, url) else record_keyed(txn, url, auth))
        bodies[MARKER_NAME] = {"keyed": True, "key_ids": [key_id(k).hex() for k in auth.keys]}
    if sealing is not None:
        engine.write(lambda txn: None if recorded_encrypted(txn, url) else record_encrypted(txn, url, sealing))
        bodies[ENCRYPTED_MARKER_NAME] = {"encrypted": True, "key_ids": [k.hex() for k in sealing.key_ids]}
    if bodies:
        _bounded(lambda: _ensure_markers(url, options, {name: (markers[name][0], body) for name, body in bodies.items()}), url)


def _root(url: str, options: dict[str, Any]) -> Any:
    from ucm_db.remote.tier import RemoteRoot  # fsspec only where a remote is used

    return RemoteRoot.from_url(url, dict(options))


def _marker(url: str, options: dict[str, Any], name: str, field: str) -> bool:
    """Whether the root's marker ``name`` says ``field`` (keyed, encrypted)."""
    root = _root(url, options)
    path = f"{root.root}/{name}"
    try:
        info = root.fs.info(path)
    except FileNotFoundError:
        return False
    if int(info.get("size") or 0) > _MAX_MARKER_BYTES:
        return True  # not ours to parse; whoever put it meant it
    try:
        return bool(json.loads(root.fs.cat_file(path)).get(field, True))
    except (ValueError, AttributeError, RecursionError):
        return True  # damaged: the safe side


def _ensure_markers(url: str, options: dict[str, Any], wanted: dict[str, tuple[str, dict[str, Any]]]) -> bool:
    """Writes each root marker ``name -> (field, body)`` that does not say its field yet."""
    from ucm_db.remote.files import write_whole

    for name, (field, body) in wanted.items():
        if not _marker(url, options, name, field):
            root = _root(url, options)
            write_whole(root.fs, f"{root.root}/{name}", json.dumps(body, sort_keys=True).encode())
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
