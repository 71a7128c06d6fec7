"""An export's block members, read beside live writers (``ucm-db export``
runs beside a serving engine, cli.md "Working beside live processes").

The manifest lists the blocks of one metadata snapshot; their payloads are
read afterwards, a chunk per read transaction (a snapshot held for the
whole export would keep LMDB from reusing pages while a writer grows the
file). A writer may evict or delete a listed block meanwhile: it was
written as an empty member and the export reported success (16 of 250
blocks beside a writer evicting in a 1 MiB store; import then skipped them
as corrupt).

Invariants:
    * A chunk's metadata and payloads are read in one read transaction
      (:meth:`~ucm_db.index.upkeep.IndexUpkeep.visit_stored`, as
      :func:`~ucm_db.maintenance.verification.verify_view` reads them): a
      block is written whole, as stored in that snapshot, or left out.
    * A block without metadata or payload in its chunk's snapshot is left
      out, and so is every block below it (even one stored again by the time
      its chunk is read): the archive keeps the prefix invariant, each
      block's parent before it. :attr:`ExportMembers.left_out` counts them.
    * A block is written only if it verifies under its key (header, owning
      key, checksum: :func:`ucm_db.codec.verify`, what import checks): a
      corrupt one is left out with its descendants and named in
      :attr:`ExportMembers.corrupt` (``ucm-db export`` exits 1 naming
      ``verify --fix``). It was written, signed with the archive's key when
      there was one, and the export succeeded; every importer then skipped it.
    * Export reads the tables as this ucm-db lays them out, so a store of a
      newer format is refused (:func:`check_export_format`): format 3 moved
      block heads into a table of their own, which a format-2 ucm-db would
      have left behind, exporting every block without its head.
    * The manifest (written first, at its snapshot's size) is made to list
      exactly the members written: :func:`final_manifest` drops the rows of
      the blocks left out and pads it with JSON whitespace to the size
      written, and :func:`rewrite_in_place` writes it over the first one
      before the archive is renamed into place. Its MAC is made over those
      final bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from ucm_db import codec
from ucm_db.errors import CorruptBlockError, FormatVersionError
from ucm_db.format import STORE_FORMAT_VERSION
from ucm_db.index.entries import BlockMeta, body_of
from ucm_db.index.local import LocalTier
from ucm_db.maintenance.archive.macs import ArchiveSigner
from ucm_db.maintenance.archive.sealed import ArchiveSealer
from ucm_db.store.view import StoreView


def check_export_format(view: StoreView) -> None:
    """FormatVersionError for a store of a newer format than this ucm-db's
    (module invariants); an older one is read as migrations leave it."""
    if view.format_version > STORE_FORMAT_VERSION:
        raise FormatVersionError(f"store at {view.path} has format {view.format_version}; this ucm-db exports format "
                                 f"{STORE_FORMAT_VERSION} and older", hint="export it with the ucm-db that wrote it (or a newer one)")


def _blob(_key: bytes, meta: Any, head: Any, stored: Any) -> bytes | None:
    """The block's blob (head + body) as stored, or None where it is gone;
    a block whose head alone is missing is read as its body (it then fails
    :func:`ucm_db.codec.verify` and is left out as corrupt)."""
    if meta is None or stored is None:
        return None
    head_view = memoryview(head if head is not None else b"")
    return b"".join([head_view, body_of(head_view, memoryview(stored))])


class ExportMembers:
    """Makes the members of an export's blocks, chunk by chunk (module invariants)."""

    def __init__(self, tier: LocalTier, epochs: dict[str, int], signer: ArchiveSigner | None,
                 sealer: ArchiveSealer | None) -> None:
        self._tier, self._epochs, self._signer, self._sealer = tier, epochs, signer, sealer
        self._gone: set[bytes] = set()
        #: Key hex and reason of each block left out as corrupt (its descendants are left out too).
        self.corrupt: list[dict[str, str]] = []
        self.written = 0
        self.stored_bytes = 0

    @property
    def left_out(self) -> int:
        """Blocks left out: gone when their chunk was read, corrupt, or below one that was."""
        return len(self._gone)

    def chunk(self, blocks: list[tuple[bytes, BlockMeta]]) -> Iterator[tuple[bytes, bytes]]:
        """``(key, member)`` of each block of ``blocks`` (parents first) that
        is written; one read transaction for the chunk."""
        blobs = self._tier.visit_stored([key for key, _ in blocks], _blob)
        for (key, meta), blob in zip(blocks, blobs):
            if blob is None or (meta.parent is not None and meta.parent in self._gone):
                self._gone.add(key)
                continue
            try:
                codec.verify(blob, key)
            except CorruptBlockError as exc:
                self.corrupt.append({"key": key.hex(), "reason": exc.message})
                self._gone.add(key)
                continue
            member = blob if self._sealer is None else self._sealer.seal(
                key, meta.parent, meta.namespace_id, self._epochs[meta.namespace_id.hex()], blob)
            if self._signer is not None:
                self._signer.block(key, member)  # over the member as written: encrypt, then MAC
            self.written += 1
            self.stored_bytes += len(blob)
            yield key, member

    def final_manifest(self, manifest: dict[str, Any], written_bytes: bytes) -> bytes:
        """The manifest listing exactly the blocks written: ``written_bytes``
        itself when none was left out, else without the rows of those left
        out, padded with spaces to the size of ``written_bytes``."""
        if not self._gone:
            return written_bytes
        rows = [row for row in manifest["blocks"] if bytes.fromhex(row[0]) not in self._gone]
        data = json.dumps({**manifest, "blocks": rows}).encode()
        assert len(data) <= len(written_bytes), "dropping rows never lengthens the manifest"
        return data + b" " * (len(written_bytes) - len(data))


def rewrite_in_place(out: IO[bytes], data_at: int, data: bytes) -> None:
    """Writes ``data`` (a member's new bytes, of its size) over the member
    whose data starts at ``data_at`` of the archive being written to ``out``,
    then returns to the end."""
    end = out.seek(0, 2)
    out.seek(data_at)
    out.write(data)
    out.seek(end)
