"""Files of a remote tier: its fsspec file system opened from a URL
(:func:`open_filesystem`), and on a local or NFS directory, whole-object
writes and reads that open regular files only.

Invariants:
    * :func:`write_whole` never leaves a partial object under its final name
      (temp file in the same directory, fsync, rename; temp names start with
      :data:`TEMP_PREFIX` and are never read as objects). :func:`write_new`
      neither, and never replaces an object another writer created first
      (a hard link on a directory, a conditional put on S3), where the
      file system can tell (elsewhere an existence check first: a writer
      in between is replaced).
    * On a local or NFS directory a name is durable before a write or a
      removal returns: the rename, link or unlink is followed by an fsync of
      its directory, and of the parent of each directory the write created
      (:func:`_sync_dirs`); :func:`remove_all` (``gc``) fsyncs each
      directory once after its last removal. Callers drop their own records once the call
      returned (the upload queue's row, a retraction's confirmation, both
      made durable by ``flush``): the audit that taught it
      (tests/remote/test_audit_uploads_durable_names.py) lost, with the
      remote disk's power, every object whose rename was still cached, and
      brought back the object of a block deleted with ``remote=True``.
      A write given a :class:`DirSyncs` leaves those fsyncs to it instead:
      an upload batch syncs each distinct directory once, before its queue
      rows go (one fsync per object cost a quarter of the uploads' rate).
    * A directory this node may write and search but not read (``-wx``: a
      locked-down share) cannot be opened to fsync it: its names are left
      to the file system (a warning, once per process), never an error
      after the object was written (every upload failed, retried for ever:
      tests/remote/test_review_uploads_dir_sync.py).
    * :func:`read_local_range` never opens anything but a regular file for
      reading: a symlink, FIFO, device, socket or directory raises
      :class:`NotRegularFileError` without blocking or streaming.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from ucm_db.crashpoints import crashpoint
from ucm_db.errors import ConfigError

TEMP_PREFIX = ".tmp-"
#: What ``link`` raises where a file system has no hard links (some FUSE, SMB and object-store mounts).
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)
#: What opening a directory we may write but not read fails with (module invariants).
_UNREADABLE_DIR = (errno.EACCES, errno.EPERM)

_log = logging.getLogger("ucm_db")
_warned_unreadable = False


class DirSyncs:
    """Directories whose names a batch of writes changed, fsynced once each
    by the calls of :meth:`calls` (module invariants). Thread-safe: a
    batch's uploads run on several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[str, None] = {}

    def add(self, directories: Iterable[str]) -> None:
        with self._lock:
            self._dirs.update(dict.fromkeys(directories))

    def calls(self, count: int) -> list[Callable[[], str | None]]:
        """At most ``count`` calls that together fsync every directory added
        so far, each once, to run at once (on a pool's threads: a batch's
        fsyncs overlap as its uploads did); each raises its first failure
        and forgets the directories it synced."""
        with self._lock:
            directories = list(self._dirs)
        return [partial(self._sync, directories[i::count]) for i in range(min(count, len(directories)))]

    def _sync(self, directories: list[str]) -> None:
        _sync_dirs(directories)
        with self._lock:
            for directory in directories:
                self._dirs.pop(directory, None)


class NotRegularFileError(OSError):
    """A local remote path is not a regular file (a symlink, FIFO, device or
    directory in an object's place); it is never opened for reading."""


def is_local_fs(fs: Any) -> bool:
    """True for fsspec's local filesystem (where rename is atomic)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def write_new(fs: Any, path: str, data: bytes, syncs: DirSyncs | None = None) -> bool:
    """Writes ``data`` as one whole object where ``path`` holds none;
    False where it does (another writer's: left as it is). Exclusive on a
    local directory (a hard link), on S3 (a conditional put) and in
    memory; where a file system refuses an exclusive write, or has no hard
    links, the name is checked first: a writer in between is replaced.
    A file system that ignores ``mode="create"`` replaces it too.
    ``syncs``: where the directory fsyncs go (module invariants; None: now)."""
    if not is_local_fs(fs):
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except Exception:  # noqa: BLE001 - no exclusive write here (an older s3fs, a server without If-None-Match)
            if fs.exists(path):  # checked first, not atomic: a writer in between may be replaced
                return False
            fs.pipe_file(path, data)
        return True
    tmp, created = _write_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if os.path.lexists(path):  # a file system without hard links: checked first, not atomic
            return False
        os.replace(tmp, path)
    finally:
        _unlink_quietly(tmp)
    _sync_names(path, created, syncs)
    return True


def write_whole(fs: Any, path: str, data: bytes, syncs: DirSyncs | None = None) -> None:
    """Writes ``data`` as one whole object: readers see all of it or nothing.

    Object stores and ``memory://`` replace objects atomically on
    ``pipe_file``; a local or NFS directory gets a temp file in the same
    directory, fsync, then rename (``syncs``: where the directory fsyncs
    go, module invariants; None: now).
    """
    if not is_local_fs(fs):
        fs.pipe_file(path, data)
        return
    tmp, created = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _sync_names(path, created, syncs)


def remove_whole(fs: Any, path: str) -> None:
    """Removes the object at ``path``; on a local directory the removal is
    durable when this returns (module invariants).

    Raises:
        FileNotFoundError: no object there.
    """
    fs.rm_file(path)
    if is_local_fs(fs):
        _sync_names(path, [])


def remove_all(fs: Any, paths: Iterable[str]) -> int:
    """Removes the objects at ``paths`` (one already gone is passed over);
    on a local directory the removals are durable when this returns, each
    directory fsynced once after its last removal. Returns how many it
    removed."""
    removed: list[str] = []
    for path in paths:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    if removed and is_local_fs(fs):
        _sync_dirs(dict.fromkeys(os.path.dirname(path) for path in removed))
    return len(removed)


def _sync_names(path: str, created: list[str], syncs: DirSyncs | None = None) -> None:
    """Makes the name ``path`` (its directory's entry) durable, and the
    entries of the directories in ``created`` (in their parents): now, or
    by ``syncs``."""
    directories = dict.fromkeys([os.path.dirname(path), *(os.path.dirname(d) for d in created)])
    if syncs is not None:
        syncs.add(directories)
    else:
        _sync_dirs(directories)


def _sync_dirs(directories: Iterable[str]) -> None:
    """Fsyncs each directory; one that cannot be opened for it (``-wx``)
    or cannot be fsynced here is left to the file system (module invariants)."""
    for directory in directories:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in _UNREADABLE_DIR:
                raise
            _warn_unreadable(directory, exc)
            continue
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # no directory fsync here
                raise
        finally:
            os.close(fd)


def _warn_unreadable(directory: str, exc: OSError) -> None:
    global _warned_unreadable
    if _warned_unreadable:
        return
    _warned_unreadable = True
    _log.warning("ucm-db: cannot open remote directory %s to fsync it (%s): names written and removed there are left "
                 "to the file system, and a power cut of the remote's disk may lose them (hint: give this node read "
                 "permission on the remote's directories to make them durable); said once", directory, exc)


def _write_temp(path: str, data: bytes) -> tuple[str, list[str]]:
    """A fsynced temp file holding ``data`` beside ``path`` (its name),
    and the directories made for it (the deepest last)."""
    directory = os.path.dirname(path)
    created: list[str] = []
    missing = directory
    while missing and not os.path.isdir(missing):
        created.insert(0, missing)
        missing = os.path.dirname(missing)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            crashpoint("remote.during_upload")
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp, created


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: What opening a path through a file or a symlink loop fails with.
_NOT_A_PATH_ERRNOS = (errno.ENOTDIR, errno.ELOOP)


def read_local_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a regular local file (fewer at its end).

    Nothing but a regular file is ever opened for reading: the path is
    checked with ``lstat`` first, then opened with ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block the open) and
    checked again with ``fstat``. At most ``end - start`` bytes are read,
    in one pass into the returned buffer.

    Raises:
        FileNotFoundError: no such path (a miss).
        NotRegularFileError: a symlink, FIFO, device, socket or directory,
            or a path through something that is not a directory (a file
            where a fan-out directory belongs, a symlink loop).
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        if exc.errno in _NOT_A_PATH_ERRNOS:  # the path's directories are not what they should be
            raise NotRegularFileError(f"{path} cannot be reached as a regular file: {exc}") from exc
        raise  # a miss (ENOENT) or a failure of the remote (EIO, ESTALE, EACCES...): not the object's fault
    require_regular_file(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _NOT_A_PATH_ERRNOS:  # ELOOP: replaced by a symlink after the lstat
            raise NotRegularFileError(f"{path} cannot be opened as a regular file: {exc}") from exc
        raise
    try:
        info = os.fstat(fd)
        require_regular_file(path, info.st_mode)
        want = max(0, min(end, info.st_size) - start)
        data = os.pread(fd, want, start)
        if len(data) < want:  # a short read (large reads, or truncated while read)
            parts = [data]
            got = len(data)
            while got < want and (more := os.pread(fd, want - got, start + got)):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def require_regular_file(path: str, mode: int) -> None:
    """Raises :class:`NotRegularFileError` naming what ``path`` is, unless
    ``mode`` (from ``lstat``/``fstat``) is a regular file's."""
    if not stat.S_ISREG(mode):
        kind = ("symlink" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode)
                else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "socket" if stat.S_ISSOCK(mode) else "special file")
        raise NotRegularFileError(f"{path} is a {kind}, not a regular file")


def open_filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Resolves an fsspec URL to ``(filesystem, root path)``.

    The filesystem keeps no directory listings (``use_listings_cache``
    False unless ``options`` set it): other nodes write to the same root,
    and a listing kept from before their writes would make ``exists`` and
    ``ls`` answer "absent" for their objects (a new namespace unseen by
    ``warm``, an object a delete skips).

    Raises:
        ConfigError: unknown protocol or a missing fsspec backend.
    """
    try:
        import fsspec.core
    except ImportError as exc:  # pragma: no cover - fsspec is in the remote extra
        raise ConfigError("the remote tier needs fsspec", hint="pip install 'ucm-db[remote]' (or [s3])") from exc
    try:
        try:
            fs, root = fsspec.core.url_to_fs(url, **{"use_listings_cache": False, **dict(options or {})})
        except TypeError:  # a filesystem whose constructor takes no listing-cache option (so keeps no listings)
            if "use_listings_cache" in (options or {}):
                raise
            fs, root = fsspec.core.url_to_fs(url, **dict(options or {}))
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot open remote {url!r}: {exc}", hint="install the fsspec backend for its protocol (s3fs for s3://)") from exc
    return fs, str(root).rstrip("/")


def range_past_the_end(exc: OSError) -> bool:
    """Whether a ranged read failed only because the range starts at or
    past the object's end (S3's 416 InvalidRange, which s3fs raises as
    ``OSError(EINVAL, "The requested range is not satisfiable")``): the
    object holds no bytes there, which is no remote failure."""
    text = str(exc)
    return exc.errno == errno.EINVAL and ("InvalidRange" in text or "range is not satisfiable" in text)
