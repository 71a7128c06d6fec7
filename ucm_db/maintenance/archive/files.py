"""File plumbing of archives: the safe write of an export, and bounded reads
of an import's tar members and manifest.

:mod:`ucm_db.maintenance.archive` owns the archive's format and checks; this module owns
how its bytes reach and leave the disk. A keyed MAC over the manifest and
members belongs to the format (``archive``), not here: the writer hands out a
plain binary file object and the readers return plain bytes.

Invariants:
    * An export replaces only a regular file or nothing: a target that is a
      symlink, directory, FIFO, device or socket is refused (ConfigError)
      before anything is written, and checked again just before the rename;
      so is one inside a store's directory (its data file, its lock file).
    * The temp file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a
      random name in the target's directory (never through a planted
      symlink, never over an existing file), with the permissions of the
      store's files (:func:`store_file_mode`), fsynced, then renamed over the
      target; the directory is fsynced after the rename. A failure removes
      the temp file and leaves the target as it was. A directory the temp
      file cannot be created in (EACCES, EPERM, EROFS) is a ConfigError.
      The temp file is locked from its creation until after the rename,
      and an export first removes the temp files in its directory whose
      export is gone (killed mid-write: their lock is free), never a live
      one's (:mod:`ucm_db.maintenance.archive.temps`).
    * A member is read into one buffer of its declared size, chunk by chunk,
      only if it is a regular member no larger than the caller's bound;
      a short read (a truncated archive) is an error, never a short blob.
    * The tar's own structure is read within bounds too (:class:`BoundedTarInfo`):
      tarfile reads an extended header (pax, GNU long name) whole and
      nested in the one before it, so one over
      :data:`MAX_EXTENDED_HEADER_BYTES` or more than
      :data:`MAX_EXTENDED_CHAIN` in a row is a ConfigError (a 200 MB pax
      header took an import to 640 MiB; 3000 in a row, a RecursionError).
      What tarfile keeps of them is bounded by the members read: it keeps
      every member's TarInfo (``tar.members``) with its pax records (a
      member with records of its own holds a copy of every global record
      before it too) and its long names; these, charged
      :data:`PAX_RECORD_HELD_BYTES` a record beyond their text, plus the
      global records' bytes, may not pass :data:`MAX_EXTENDED_BASE_BYTES`
      + :data:`MAX_EXTENDED_PER_MEMBER_BYTES` per member read (a
      ConfigError at the first member past it). So what the headers hold
      grows by at most 2 KiB a member (beside the ~0.5 KiB tarfile holds
      for a plain one), whatever the member count: a re-pack by GNU tar
      ``--format=posix`` (atime and ctime, ~60 bytes of pax records a
      member, ~0.4 KiB charged) imports at any member count, while one
      global header of 5000 records before members with pax records of
      their own (each member then holds a 5000-entry copy: 2000 members of
      a 4 MB archive took a listing from 40 to 240 MiB) is refused after a
      few dozen members. ucm-db's export writes none.
      A sparse member (GNU, any version) is refused as tarfile reads its
      map: it declares bytes it does not hold (a few bytes made import
      allocate and zero-fill 512 MiB), and its map is read whole too.
    * The member listing must end at the tar's end-of-archive block
      (:func:`check_archive_end`): tarfile stops silently at a header it
      cannot read, so an archive cut short at a member boundary, or with a
      header damaged midway, read as a shorter archive.
    * The manifest is parsed only after a bound on its size and on the
      nesting depth of its JSON (:func:`parse_bounded_json`), so neither a
      huge nor a deeply nested manifest can exhaust memory or the stack
      (RecursionError never escapes).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from ucm_db.errors import ConfigError, TierError
from ucm_db.maintenance.archive.temps import TEMP_NAME, locked_temp, remove_abandoned_temps
from ucm_db.store.path import enclosing_store, path_error
from ucm_db.storelock import fsync_dir

#: Errors creating the export's temp file that mean the directory cannot be
#: written (permission, a read-only file system): the command must change.
#: A full disk or an I/O error stays a TierError.
_UNWRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: Bytes per read of a member (a member is never read in one call).
READ_CHUNK_BYTES = 1 << 20
#: Deepest JSON nesting a manifest may have (a valid one has 4).
MAX_MANIFEST_DEPTH = 16
#: Largest extended header (pax, GNU long name) import lets tarfile read.
MAX_EXTENDED_HEADER_BYTES = 64 << 10
#: What tarfile may keep of an archive's extended headers beyond the
#: per-member allowance below (module invariants).
MAX_EXTENDED_BASE_BYTES = 16 << 20
#: What it may keep of them per member read: a posix re-pack's atime and
#: ctime are charged ~0.4 KiB a member.
MAX_EXTENDED_PER_MEMBER_BYTES = 2 << 10
#: Charge of a member's pax record beyond its key and value: at least what
#: a record of its own holds (two str objects of ~50 bytes, a dict slot); a
#: global record copied into each member holds ~20 (measured: 5000 of them
#: copied into 2000 members, +200 MiB).
PAX_RECORD_HELD_BYTES = 128
#: Most extended headers in a row (tarfile reads each one nested in the last).
MAX_EXTENDED_CHAIN = 8
_EXTENDED_TYPES = frozenset({tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK})
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte that is not a bracket
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")  # objects nest as arrays do


def store_file_mode(store_path: Path) -> int:
    """Permission bits for a file holding the store's data: the store
    directory's bits without execute (a 0700 store gives 0600 files, a 0750
    one 0640), so an archive is readable by exactly whoever can read the store."""
    return stat.S_IMODE(os.stat(store_path).st_mode) & 0o666


def check_target(target: Path) -> None:
    """Refuses a target an export must not replace (module invariants)."""
    if str(target) == "-":
        raise ConfigError("exporting to standard output (-) is not supported",
                          hint="name a regular file to write, e.g. DIR/store.tar")
    if TEMP_NAME.fullmatch(target.name):  # the next export to the directory would remove it as abandoned
        raise ConfigError(f"refusing to write {target}: its name is the pattern of an export's temp file",
                          hint="name the archive otherwise, e.g. DIR/store.tar")
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc}", hint="check the path and its permissions") from exc
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        raise ConfigError(f"refusing to write {target}: it is {kind}, not a regular file",
                          hint="name a new or regular file for the archive, e.g. DIR/store.tar "
                          "(an export never replaces a symlink, directory, FIFO or device)")
    if not target.parent.is_dir():
        raise ConfigError(f"cannot write {target}: directory {target.parent} does not exist",
                          hint=f"create it first (mkdir -p {target.parent}) or pick another path")
    store = enclosing_store(target)
    if store is not None:  # its data file, lock file or RocksDB's CURRENT replaced: the store is gone
        raise ConfigError(f"refusing to write {target}: it lies inside the ucm-db store at {store}, among its own files",
                          hint="write the archive outside every store directory")


def check_import_target(path: Path) -> None:
    """Refuses importing into ``path`` where it is a file; a path that
    cannot be checked (permission denied on the way, a name too long) is
    an error naming it."""
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as exc:
        raise path_error(path, exc) from exc
    if is_file:
        raise ConfigError(f"cannot import into {path}: it is a file", hint="pass a store directory (new or existing)")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


@contextmanager
def atomic_output(target: Path, mode: int) -> Iterator[IO[bytes]]:
    """A binary file that becomes ``target`` when the block exits normally
    (module invariants); OSError becomes TierError with the fix. The temp
    files of exports killed mid-write in ``target``'s directory are removed
    first (:func:`~ucm_db.maintenance.archive.temps.remove_abandoned_temps`)."""
    check_target(target)
    remove_abandoned_temps(target.parent)
    with ExitStack() as stack:
        try:
            fd, temp = stack.enter_context(locked_temp(target, mode))
        except OSError as exc:
            raise _creation_error(target, exc) from exc
        try:  # the file stays locked until the stack closes it: after the rename, or after its removal
            os.fchmod(fd, mode)  # exactly the store's bits, whatever the umask
            with os.fdopen(fd, "wb", closefd=False) as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            check_target(target)  # something may have been planted meanwhile
            os.replace(temp, target)
            fsync_dir(target.parent)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise TierError(f"cannot write {target}: {exc}",
                            hint=f"check the free space and permissions of {target.parent}") from exc
        except BaseException:
            temp.unlink(missing_ok=True)
            raise


def _creation_error(target: Path, exc: OSError) -> Exception:
    """The error for ``exc``, met creating the temp file of the archive ``target``."""
    if exc.errno in _UNWRITABLE:  # a destination that cannot be written: a usage error (exit 2), as cli.md says
        return ConfigError(f"cannot write {target}: cannot create a file in {target.parent}: {exc.strerror}",
                           hint=f"write the archive to a directory this user can write (uid {os.getuid()}), "
                           "on a file system mounted read-write")
    return TierError(f"cannot create a temp file in {target.parent}: {exc}",
                     hint=f"check the permissions and free space of {target.parent}")


_NOT_EXPORTED_HINT = "the archive is damaged or not written by ucm-db export; export it again"


def _where(tar: tarfile.TarFile) -> str:
    return os.fsdecode(tar.name) if tar.name is not None else "the archive"


def held_bytes(member: tarfile.TarInfo) -> int:
    """What tarfile keeps of ``member``'s extended headers, as charged
    against the archive's bound: its pax records (its own and the global
    ones copied in), :data:`PAX_RECORD_HELD_BYTES` each beyond their text,
    and its names (a long name may come from a GNU long-name header)."""
    records = sum(len(key) + len(value) + PAX_RECORD_HELD_BYTES for key, value in member.pax_headers.items())
    return records + len(member.name) + len(member.linkname)


class BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose extended headers are bounded before tarfile reads
    them, and what tarfile keeps of them by the members read (module
    invariants); pass as ``tarfile.open(..., tarinfo=BoundedTarInfo)``."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type not in _EXTENDED_TYPES:
            return super()._proc_member(tar)  # type: ignore[misc, no-any-return]
        budget = tar.__dict__.setdefault("_ucm_db_extended", {"chain": 0, "bytes": 0})
        if self.size > MAX_EXTENDED_HEADER_BYTES:
            raise ConfigError(f"{_where(tar)}: an extended header (pax or GNU long name) of {self.size} bytes at byte "
                              f"{self.offset} is over the bound import reads ({MAX_EXTENDED_HEADER_BYTES} bytes); "
                              "ucm-db export writes none", hint=_NOT_EXPORTED_HINT)
        if budget["chain"] >= MAX_EXTENDED_CHAIN:
            raise ConfigError(f"{_where(tar)}: more than {MAX_EXTENDED_CHAIN} extended headers in a row at byte {self.offset}",
                              hint=_NOT_EXPORTED_HINT)
        if self.type == tarfile.XGLTYPE:
            budget["bytes"] += self.size  # its records stay in tar.pax_headers for the rest of the archive
        budget["chain"] += 1
        try:
            member: tarfile.TarInfo = super()._proc_member(tar)  # type: ignore[misc]
        finally:
            budget["chain"] -= 1
        if budget["chain"] == 0:  # the outermost header: ``member`` is what tar.members will keep
            budget["bytes"] += held_bytes(member)
            members = len(tar.members) + 1  # type: ignore[attr-defined]  # this one is appended next
            allowed = MAX_EXTENDED_BASE_BYTES + MAX_EXTENDED_PER_MEMBER_BYTES * members
            if budget["bytes"] > allowed:
                raise ConfigError(f"{_where(tar)}: the extended headers (pax or GNU long name) of its first {members} "
                                  f"members, up to the one at byte {self.offset}, hold {budget['bytes']} bytes, over "
                                  f"the bound import keeps ({MAX_EXTENDED_BASE_BYTES} bytes and "
                                  f"{MAX_EXTENDED_PER_MEMBER_BYTES} per member); ucm-db export writes none",
                                  hint=_NOT_EXPORTED_HINT)
        return member

    def _refuse_sparse(self, *args: Any) -> None:
        member = args[0] if args and isinstance(args[0], tarfile.TarInfo) else self  # pax: the member it describes
        raise ConfigError(f"archive member {member.name} at byte {self.offset} is a sparse file; ucm-db export writes none",
                          hint=_NOT_EXPORTED_HINT)

    # tarfile's four ways of reading a sparse member's map (old GNU, pax 0.0, 0.1, 1.0)
    _proc_sparse = _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


def check_archive_end(tar: tarfile.TarFile, archive: Path, damaged_hint: str) -> None:
    """ConfigError unless the member listing ends at an end-of-archive
    block (module invariants). Loads the whole listing."""
    tar.getmembers()
    end_at = tar.offset
    fileobj = tar.fileobj
    assert fileobj is not None
    fileobj.seek(end_at)
    if fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
        raise ConfigError(f"{archive} is cut short or damaged at byte {end_at}: no member header and no end-of-archive "
                          f"block there, after {len(tar.getmembers())} members; nothing was imported",
                          hint=f"copy the archive again (compare its size with the source's), or {damaged_hint}")


def read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit_bytes: int, damaged_hint: str) -> bytearray:
    """The bytes of regular ``member``, read in chunks into one buffer.

    Raises:
        ConfigError: the member is not a regular file (symlink, hardlink,
            device...), is larger than ``limit_bytes``, or is cut short.
    """
    if not member.isreg():
        kind = "a symlink" if member.issym() else "a hard link" if member.islnk() else "not a regular file"
        raise ConfigError(f"archive member {member.name} is {kind}", hint=damaged_hint)
    if member.size > limit_bytes:
        raise ConfigError(f"archive member {member.name} is {member.size} bytes, over the bound of {limit_bytes}",
                          hint=damaged_hint)
    handle = tar.extractfile(member)
    if handle is None:  # pragma: no cover - a regular member always has a handle
        raise ConfigError(f"archive member {member.name} is not a file", hint=damaged_hint)
    try:
        buf = bytearray(member.size)
    except MemoryError:
        # A process under a memory limit (RLIMIT_DATA, a container's) cannot
        # hold the member: that block is skipped, named, the rest imported.
        raise ConfigError(f"archive member {member.name} of {member.size} bytes does not fit in this process's memory",
                          hint="raise the process's memory limit (ulimit -d / -v, the container's), or import on a host "
                          "with more memory") from None
    view = memoryview(buf)
    done = 0
    with handle:
        while done < member.size:
            try:
                n = handle.readinto(view[done : done + READ_CHUNK_BYTES])  # type: ignore[attr-defined]
            except (tarfile.TarError, OSError) as exc:  # tarfile's "unexpected end of data"
                raise ConfigError(f"archive member {member.name} cannot be read: {exc}", hint=damaged_hint) from exc
            if not n:
                raise ConfigError(f"archive member {member.name} is cut short ({done} of {member.size} bytes)",
                                  hint=damaged_hint)
            done += n
    return buf


def json_depth_within(data: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects at most
    ``max_depth`` deep with balanced brackets, in C-speed bytes operations
    and no recursion: escapes are dropped, the text between quotes (the
    strings) is dropped, then each pass removes the innermost bracket
    pairs, so a text of depth d empties in d passes. (For text that is not
    JSON the answer may be wrong; json.loads rejects such text anyway, and
    a RecursionError from it is still caught.)"""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(_AS_SQUARE, _BRACKETS)
    if b"[" * (max_depth + 1) in brackets:  # a run of openers deeper than allowed: no need to peel
        return False
    for _ in range(max_depth):
        if not brackets:
            return True
        brackets = brackets.replace(b"[]", b"")
    return not brackets


def parse_bounded_json(data: bytes, max_depth: int = MAX_MANIFEST_DEPTH) -> Any:
    """``json.loads(data)`` after checking its nesting depth.

    Raises:
        ValueError: nested deeper than ``max_depth`` (or unbalanced), or not
            valid JSON.
    """
    if not json_depth_within(data, max_depth):
        raise ValueError(f"nested more than {max_depth} levels deep, or its brackets do not balance")
    try:
        return json.loads(data)
    except RecursionError as exc:  # pragma: no cover - the depth check comes first
        raise ValueError("nested too deeply") from exc


def is_hex(value: Any, n_bytes: int) -> bool:
    """True if ``value`` is the hex of exactly ``n_bytes`` bytes."""
    if not isinstance(value, str) or len(value) != 2 * n_bytes:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True
