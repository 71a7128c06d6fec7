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

from ucm_db.index.entries import BlockMeta, body_of
from ucm_db.index.local import LocalTier
from ucm_db.maintenance.archive.macs import ArchiveSigner
from ucm_db.maintenance.archive.sealed import ArchiveSealer


def _blob(_key: bytes, meta: Any, head: Any, stored: Any) -> bytes | None:
    """The block's blob (head + body) as stored, or None where it is gone;
    a block whose head alone is missing is written as read (import finds it
    corrupt), as before."""
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
        self.written = 0
        self.stored_bytes = 0

    @property
    def left_out(self) -> int:
        """Blocks left out: gone when their chunk was read, or below one that was."""
        return len(self._gone)

    def chunk(self, blocks: list[tuple[bytes, BlockMeta]]) -> Iterator[tuple[bytes, bytes]]:
        """``(key, member)`` of each block of ``blocks`` (parents first) that
        is written; one read transaction for the chunk."""
        blobs = self._tier.visit_stored([key for key, _ in blocks], _blob)
        for (key, meta), blob in zip(blocks, blobs):
            if blob is None or (meta.parent is not None and meta.parent in self._gone):
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
