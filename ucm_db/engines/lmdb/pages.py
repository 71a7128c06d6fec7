"""Which pages of an LMDB snapshot are reachable, read without mapping the file.

A data file may legitimately end before its snapshot's last page: LMDB
counts a page allocated and freed inside one transaction (a "loose" page)
in the snapshot's page count but never writes it, so when that page is the
highest one the file stays shorter. Only a *reachable* page past the end
means damage (mapping it ends in SIGBUS). :func:`first_reachable_page_past_end`
tells the two apart by walking the snapshot's trees with ``pread``: the free
page tree, the main tree, and every named or duplicate-sort tree below it.

Invariants:
    * Nothing here maps or writes the file; a damaged tree (a page whose
      header names another page, a loop, more pages than the snapshot has)
      is reported as a sentence, never followed further.
    * Overflow pages are not read: a leaf node's data size gives their count.

The layout is LMDB 0.9's (data version 1) on a 64-bit little-endian host:
a 16-byte page header (page number, pad, flags, lower/upper bounds), an
array of 16-bit node offsets, nodes of 8-byte headers (``mn_lo``, ``mn_hi``,
``mn_flags``, ``mn_ksize``) followed by the key and the data.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree
PAGE_HEADER_BYTES = 16
_P_BRANCH, _P_LEAF, _P_LEAF2 = 0x01, 0x02, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_PAGE_HEAD = struct.Struct("<QHHHH")  # page number, pad, flags, lower, upper
_NODE_HEAD = struct.Struct("<HHHH")   # mn_lo, mn_hi, mn_flags, mn_ksize
_NODE_HEAD_BYTES = 8
_DB_ROOT_OFFSET = 40                  # md_root inside an MDB_db record (48 bytes)


class DamagedTree(Exception):
    """A tree of the snapshot cannot be walked; the message says where."""


def first_reachable_page_past_end(
    data_path: Path, *, page_bytes: int, last_page: int, roots: tuple[int, ...], file_bytes: int,
) -> int | None:
    """The first page reachable from the trees at ``roots`` (a snapshot's
    free-page and main roots, from its meta page) that lies wholly or partly
    past ``file_bytes``, or None when every reachable page is inside the
    file. Raises :class:`DamagedTree` for a tree that cannot be walked and
    OSError when the file cannot be read."""
    pages_in_file = file_bytes // page_bytes
    fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        walker = _Walker(fd, page_bytes, pages_in_file, last_page)
        return walker.walk([root for root in roots if root != NO_PAGE])
    finally:
        os.close(fd)


class _Walker:
    """One depth-first walk over every tree page of a snapshot."""

    def __init__(self, fd: int, page_bytes: int, pages_in_file: int, last_page: int) -> None:
        self.fd = fd
        self.page_bytes = page_bytes
        self.pages_in_file = pages_in_file
        self.last_page = last_page
        self.seen: set[int] = set()

    def walk(self, roots: list[int]) -> int | None:
        stack = list(roots)
        while stack:
            pgno = stack.pop()
            if pgno in self.seen:
                raise DamagedTree(f"page {pgno} is reached twice (a loop or a shared page)")
            self.seen.add(pgno)
            if pgno > self.last_page:
                raise DamagedTree(f"page {pgno} is past the snapshot's last page {self.last_page}")
            if pgno >= self.pages_in_file:
                return pgno
            past_end = self._children(pgno, stack)
            if past_end is not None:
                return past_end
        return None

    def _children(self, pgno: int, stack: list[int]) -> int | None:
        """Pushes the tree pages ``pgno`` points to; returns the first
        overflow page past the end, if one of its values has any."""
        page = os.pread(self.fd, self.page_bytes, pgno * self.page_bytes)
        if len(page) < self.page_bytes:
            return pgno
        number, _pad, flags, lower, _upper = _PAGE_HEAD.unpack_from(page, 0)
        if number != pgno:
            raise DamagedTree(f"page {pgno}'s header says it is page {number}")
        if flags & _P_LEAF2 or not flags & (_P_BRANCH | _P_LEAF):
            if not flags & _P_LEAF2:
                raise DamagedTree(f"page {pgno} is neither a branch nor a leaf (flags 0x{flags:x})")
            return None
        n_nodes = (lower - PAGE_HEADER_BYTES) // 2
        if n_nodes < 0 or PAGE_HEADER_BYTES + 2 * n_nodes > self.page_bytes:
            raise DamagedTree(f"page {pgno} claims {n_nodes} nodes")
        for index in range(n_nodes):
            (offset,) = struct.unpack_from("<H", page, PAGE_HEADER_BYTES + 2 * index)
            if offset + _NODE_HEAD_BYTES > self.page_bytes:
                raise DamagedTree(f"page {pgno} has a node at offset {offset}, past its end")
            lo, hi, node_flags, key_bytes = _NODE_HEAD.unpack_from(page, offset)
            if flags & _P_BRANCH:
                stack.append(lo | hi << 16 | node_flags << 32)
                continue
            past_end = self._leaf_node(page, pgno, offset + _NODE_HEAD_BYTES + key_bytes, lo | hi << 16, node_flags, stack)
            if past_end is not None:
                return past_end
        return None

    def _leaf_node(self, page: bytes, pgno: int, data_at: int, data_bytes: int, node_flags: int, stack: list[int]) -> int | None:
        if node_flags & _F_BIGDATA:
            if data_at + 8 > self.page_bytes:
                raise DamagedTree(f"page {pgno} has a value reference past its end")
            (first,) = struct.unpack_from("<Q", page, data_at)
            n_pages = (PAGE_HEADER_BYTES - 1 + data_bytes) // self.page_bytes + 1
            if first + n_pages - 1 > self.last_page:
                raise DamagedTree(f"page {pgno} names overflow pages {first}-{first + n_pages - 1}, past the last page")
            return first + n_pages - 1 if first + n_pages > self.pages_in_file else None
        if node_flags & _F_SUBDATA:  # a named tree, or a duplicate-sort tree
            if data_at + _DB_ROOT_OFFSET + 8 > self.page_bytes:
                raise DamagedTree(f"page {pgno} has a tree record past its end")
            (root,) = struct.unpack_from("<Q", page, data_at + _DB_ROOT_OFFSET)
            if root != NO_PAGE:
                stack.append(root)
        return None  # plain data, or duplicates kept inside this page
