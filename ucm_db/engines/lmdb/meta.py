"""LMDB's two meta pages, read and written without mapping the file.

An LMDB data file starts with two meta pages (page 0 and page 1); the one
with the larger transaction id is the current snapshot. Each names the page
size, the roots of the free-page and main trees and the last page in use.
Reading them with ``pread`` tells a damaged file (not LMDB, a wrong version,
truncated below its last page) from an intact one before LMDB maps it:
mapping a file shorter than its meta page claims ends in SIGBUS on the first
access past its end, which no Python code can catch.

Invariants:
    * Nothing here maps the file; a damaged file costs at most a few
      ``pread`` calls and a :class:`FileCheck` naming the damage.
    * :func:`write_meta_body` changes nothing but the two meta pages' first
      ``PAGE_HEADER_BYTES + META_BODY_BYTES`` bytes, and fsyncs before it
      returns.

The layout is LMDB 0.9's on-disk format (data version 1) on a 64-bit host:
a 16-byte page header, then ``MDB_meta`` (136 bytes).
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ucm_db.engines.lmdb.pages import DamagedTree, first_reachable_page_past_end

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER_BYTES = 16
META_BODY_BYTES = 136
_P_META = 0x08
_DB = struct.Struct("<IHHQQQQQ")  # md_pad (page size in the free db), flags, depth, branch, leaf, overflow, entries, root
_HEAD = struct.Struct("<IIQQ")     # magic, version, address, map size
_TAIL = struct.Struct("<QQ")       # last page, transaction id
#: Where a meta page (its page header included) holds its transaction id: after the last page number.
TXNID_OFFSET = PAGE_HEADER_BYTES + _HEAD.size + 2 * _DB.size + 8
_MIN_PAGE_BYTES, _MAX_PAGE_BYTES = 512, 1 << 16
_CHECK_TRIES, _RECHECK_PAUSE_S = 3, 0.01


@dataclass(frozen=True)
class MetaPage:
    """One decoded meta page."""

    slot: int
    page_bytes: int
    map_size_bytes: int
    last_page: int
    txnid: int
    free_root: int   # 2**64-1 (P_INVALID): empty tree
    main_root: int
    body: bytes      # the raw MDB_meta, for :func:`write_meta_body`


@dataclass(frozen=True)
class FileCheck:
    """What :func:`check_file` found. ``problem`` is None for an intact file."""

    path: Path
    file_bytes: int
    problem: str | None
    current: MetaPage | None = None
    #: Bytes between the file's end and its snapshot's last page that no
    #: tree reaches (pages LMDB freed before writing them): harmless.
    unwritten_tail_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None


def _decode(slot: int, page: bytes) -> MetaPage | str:
    """A meta page, or why it is not one."""
    if len(page) < PAGE_HEADER_BYTES + META_BODY_BYTES:
        return "it is cut short"
    pgno, _pad, flags = struct.unpack_from("<QHH", page, 0)
    body = page[PAGE_HEADER_BYTES:PAGE_HEADER_BYTES + META_BODY_BYTES]
    magic, version, _address, map_size = _HEAD.unpack_from(body, 0)
    if magic != MAGIC:
        return f"it has no LMDB magic (0x{magic:08x})"
    if version != DATA_VERSION:
        return f"it is LMDB data version {version}, not {DATA_VERSION}"
    if pgno != slot or not flags & _P_META:
        return f"its header says page {pgno} with flags 0x{flags:x}"
    free = _DB.unpack_from(body, _HEAD.size)
    main = _DB.unpack_from(body, _HEAD.size + _DB.size)
    last_page, txnid = _TAIL.unpack_from(body, _HEAD.size + 2 * _DB.size)
    page_bytes = free[0]
    if not _MIN_PAGE_BYTES <= page_bytes <= _MAX_PAGE_BYTES or page_bytes & (page_bytes - 1):
        return f"its page size {page_bytes} is impossible"
    return MetaPage(slot, page_bytes, map_size, last_page, txnid, free[7], main[7], bytes(body))


def read_meta_pages(data_path: Path) -> tuple[list[MetaPage], list[str]]:
    """Both meta pages of ``data_path`` that decode, and what is wrong with
    the others. Raises OSError if the file cannot be read at all."""
    fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        first = os.pread(fd, _MAX_PAGE_BYTES, 0)
        pages: list[MetaPage] = []
        problems: list[str] = []
        zero = _decode(0, first)
        if isinstance(zero, str):
            return [], [f"meta page 0: {zero}"]
        pages.append(zero)
        one = _decode(1, os.pread(fd, zero.page_bytes, zero.page_bytes))
        if isinstance(one, str):
            problems.append(f"meta page 1: {one}")
        else:
            pages.append(one)
        return pages, problems
    finally:
        os.close(fd)


def check_file(data_path: str | os.PathLike[str]) -> FileCheck:
    """Checks an LMDB data file against its meta pages, without mapping it
    (see :func:`_check_once`). A problem is reported only if it is still
    there on a second and third read: a meta page read while another process
    writes it can come back half old, half new."""
    check = _check_once(Path(data_path))
    for _ in range(_CHECK_TRIES - 1):
        if check.ok:
            break
        time.sleep(_RECHECK_PAUSE_S)
        check = _check_once(Path(data_path))
    return check


def _check_once(data_path: Path) -> FileCheck:
    """One check of an LMDB data file against its meta pages.

    Intact means: a regular file holding two valid meta pages (magic,
    version, page size) whose current snapshot's reachable pages all lie
    inside the file (checked page by page with
    :mod:`ucm_db.engines.lmdb.pages` only when the file is shorter than
    ``(last_page + 1) * page_bytes``) and whose tree
    roots lie at or below that last page. A missing file is intact (LMDB
    creates it); anything else gets ``problem`` set to one sentence.
    """
    path = Path(data_path)
    try:
        info = path.stat()
    except FileNotFoundError:
        return FileCheck(path, 0, None)
    if not path.is_file():
        return FileCheck(path, 0, f"{path} is not a regular file")
    size = info.st_size
    if size == 0:
        return FileCheck(path, 0, None)  # created, never written: LMDB initialises it
    try:
        pages, problems = read_meta_pages(path)
        # The size after the meta pages: LMDB writes a commit's pages before
        # its meta page, so a meta page read first never names pages past the
        # size read after it (read before, a commit of another process in
        # between looked like a truncated file: a false TierError at open).
        size = max(size, path.stat().st_size)
    except OSError as exc:
        return FileCheck(path, size, f"{path} cannot be read: {exc}")
    if not pages:
        return FileCheck(path, size, f"{path} is not an LMDB data file ({'; '.join(problems)})")
    if problems:
        return FileCheck(path, size, f"{path} is damaged: {'; '.join(problems)}", pages[0])
    current = max(pages, key=lambda m: m.txnid)
    needed = (current.last_page + 1) * current.page_bytes
    if needed > size:
        # LMDB never writes a page freed in the transaction that allocated
        # it, so a healthy file can end before its last page: only a
        # reachable page past the end is damage.
        try:
            past_end = first_reachable_page_past_end(
                path, page_bytes=current.page_bytes, last_page=current.last_page,
                roots=(current.free_root, current.main_root), file_bytes=size,
            )
        except DamagedTree as exc:
            return FileCheck(path, size, f"{path} is damaged: {exc}", current)
        except OSError as exc:
            return FileCheck(path, size, f"{path} cannot be read: {exc}", current)
        if past_end is not None:
            return FileCheck(
                path, size,
                f"{path} is truncated: its snapshot {current.txnid} uses page {past_end} "
                f"but the file has {size} bytes ({size // current.page_bytes} pages)",
                current,
            )
        return FileCheck(path, size, None, current, unwritten_tail_bytes=needed - size)
    for name, root in (("free-page", current.free_root), ("main", current.main_root)):
        if root != (1 << 64) - 1 and root > current.last_page:
            return FileCheck(path, size, f"{path} is damaged: its {name} tree root is page {root}, past its last page {current.last_page}", current)
    return FileCheck(path, size, None, current)


def write_meta_body(data_path: Path, body: bytes) -> None:
    """Writes ``body`` as the meta of both meta pages (with their page
    headers) and fsyncs: LMDB then opens the snapshot ``body`` describes."""
    if len(body) != META_BODY_BYTES:
        raise ValueError(f"a meta body is {META_BODY_BYTES} bytes, not {len(body)}")
    page_bytes = _DB.unpack_from(body, _HEAD.size)[0]
    fd = os.open(data_path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for slot in (0, 1):
            header = struct.pack("<QHHHH", slot, 0, _P_META, 0, 0)
            os.pwrite(fd, header + body, slot * page_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
