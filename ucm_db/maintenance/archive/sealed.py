"""Encrypted export archives (``ucm-db export/import --encryption-key-file``).

An archive exported with encryption keys is of version
:data:`SEALED_ARCHIVE_VERSION`: its manifest carries ``"encryption":
{"cipher": "AES-256-GCM", "key_id": <hex id of the sealing key>}`` and each
``blocks/<key hex>`` member is the block's codec blob sealed
(:mod:`ucm_db.remote.sealing`: key id, nonce, length, ciphertext, tag) under
a context binding the block's key, parent, namespace id, that namespace's
epoch (the manifest's ``epochs``) and the archive version: a member moved to
another row, or a manifest row or epoch altered, no longer opens.

The manifest stays readable: namespace descriptions (the model and its
settings), block keys, chain structure and epochs are what import checks
before reading a block; the KV, from which prompts can be recovered, is not
readable without a key.

Invariants:
    * Import refuses (ConfigError, before anything is written) an encrypted
      archive without an encryption key, an archive that is not encrypted
      when a key is given, and one whose manifest names a key id no given
      key has.
    * A member that no given key opens for its manifest row is skipped as
      undecryptable (its descendants as "parent missing"), like a corrupt
      one; nothing of it is written.
    * With an auth key too (:mod:`ucm_db.maintenance.archive.macs`), the
      block MACs cover the sealed members (encrypt, then MAC) and the
      manifest MAC its ``encryption`` field.
    * An older ucm-db refuses a version 3 archive as one it cannot read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucm_db.buffers import Buffer
from ucm_db.errors import ConfigError
from ucm_db.remote import sealing
from ucm_db.remote.sealing import SealingKeys, UnsealError

#: The archive version of an encrypted export (plain exports stay version 2).
SEALED_ARCHIVE_VERSION = 3
#: The label of an archive member's sealing context.
ARCHIVE_LABEL = b"ucm-db arc seal"
_NO_PARENT = bytes(32)


def block_context(key: bytes, parent: bytes | None, namespace_id: bytes, epoch: int) -> bytes:
    """What a sealed member is bound to: key, parent (and whether it has
    one), namespace id, the namespace's epoch, the archive version."""
    return sealing.context(ARCHIVE_LABEL, key, parent or _NO_PARENT, bytes((parent is not None,)), namespace_id,
                           epoch.to_bytes(8, "little"), SEALED_ARCHIVE_VERSION.to_bytes(2, "little"))


class ArchiveSealer:
    """Seals an export's members with the first encryption key."""

    def __init__(self, keys: SealingKeys) -> None:
        self._keys = keys

    def manifest_field(self) -> dict[str, Any]:
        """The manifest's ``encryption`` field."""
        return {"cipher": sealing.CIPHER, "key_id": self._keys.sealing_id.hex()}

    def seal(self, key: bytes, parent: bytes | None, namespace_id: bytes, epoch: int, blob: bytes) -> bytes:
        return self._keys.seal(blob, block_context(key, parent, namespace_id, epoch))


class ArchiveOpener:
    """Opens an import's sealed members with the given encryption keys."""

    def __init__(self, keys: SealingKeys, epochs: dict[str, int]) -> None:
        self._keys, self._epochs = keys, epochs

    def open(self, key: bytes, parent: bytes | None, namespace_id: bytes, member: Buffer) -> tuple[bytes | None, str]:
        """``(codec blob, "")`` of a member, or ``(None, why)`` if no given
        key opens it for this row."""
        epoch = self._epochs.get(namespace_id.hex())
        if epoch is None:
            return None, "undecryptable: its namespace carries no epoch"
        try:
            return bytes(self._keys.open(member, block_context(key, parent, namespace_id, epoch))), ""
        except UnsealError as exc:
            return None, f"undecryptable: {exc}"


def archive_opener(manifest: dict[str, Any], epochs: dict[str, Any], archive: Path, keys: SealingKeys | None) -> ArchiveOpener | None:
    """The opener an import of ``manifest`` (checked) needs: None for a
    plain archive and no keys; ConfigError for the refusals of the module
    invariants."""
    field = manifest.get("encryption")
    encrypted = manifest.get("version") == SEALED_ARCHIVE_VERSION
    if encrypted != (field is not None):
        raise ConfigError(f"{archive}: the manifest's version and encryption field disagree",
                          hint="the archive is damaged or altered; export it again")
    if not encrypted:
        if keys is not None:
            raise ConfigError(f"{archive} is not encrypted and an encryption key was given",
                              hint="import it without --encryption-key-file/--encryption-key-env if you trust its source")
        return None
    if not isinstance(field, dict) or field.get("cipher") != sealing.CIPHER or not isinstance(field.get("key_id"), str):
        raise ConfigError(f"{archive}: the manifest's encryption field is malformed", hint="export it again with this ucm-db")
    if keys is None:
        raise ConfigError(f"{archive} is encrypted ({sealing.CIPHER}, key id {field['key_id'][:16]}) and no encryption key was given",
                          hint="pass the key it was exported with: --encryption-key-file FILE or --encryption-key-env NAME")
    if not any(key_id.hex() == field["key_id"] for key_id in keys.key_ids):
        raise ConfigError(f"{archive} was encrypted with key id {field['key_id'][:16]}, which no given encryption key has",
                          hint="pass the key it was exported with (keys are tried by id)")
    return ArchiveOpener(keys, {ns: e for ns, e in epochs.items() if isinstance(e, int)})
