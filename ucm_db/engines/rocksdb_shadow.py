"""Read-only opens of a RocksDB store: a private *shadow* directory that pins
the store's files as of one moment.

Why a shadow: rocksdict rewrites its ``rocksdict-config.json`` in the
directory it opens, even read-only, so a read-only open opens a directory of
its own (in the temp directory) instead of the store's, which it never
writes to (a store on a read-only volume opens too).

Why pinned files: a writer in another process flushes, compacts and
switches its write-ahead log all the time, and deletes the files these make
obsolete. A shadow of plain links to the store's paths dangled as soon as
one went, between the listing and the end of the open (``ucm-db events
--follow`` beside a writer doing 100 puts/s exited after 3 failed opens in 3
of 8 runs; 29 of 100 opens failed beside an unthrottled writer). So:

    * Every data file (tables, blob files, logs, OPTIONS, IDENTITY) is
      opened read-only when the shadow is made, and its link in the shadow
      names that descriptor (``/proc/self/fd/N``): a file the writer deletes
      afterwards stays readable through it. The descriptors of blob files,
      which RocksDB opens only when a value is read, are held until the
      shadow is removed (deleted blob files keep their disk space until
      then, as a long read keeps an LMDB page); the others are closed, and
      their links removed, once the open has read them (it opens every
      table file itself: ``max_open_files`` -1).
    * One version, every file of it pinned: after the files are pinned, the
      version is read (``CURRENT`` and the length of the MANIFEST it names),
      the directory is listed again and what is new pinned too, then the
      version is read again. Unchanged, no edit came in meanwhile, so no
      file of that version was deleted before it was pinned (a writer
      deletes a file only once an edit has made it obsolete), and every log
      it still needs was pinned: the open replays a prefix of the writer's
      commits, never one with a gap. Changed, the last two steps run again
      (up to :data:`PIN_TRIES` times; they take about a millisecond).
    * The shadow gets a copy of ``CURRENT`` and of the MANIFEST's bytes up
      to that length (appended to only, so they never change): the open
      sees that version, not an edit appended later that names a file the
      shadow lacks.
    * An open that still fails while the directory changes builds a new
      shadow and tries again, after a short pause, up to
      :data:`OPEN_TRIES` times.

RocksDB's secondary instances (``AccessType.secondary``), made to follow a
primary, are not used: upstream RocksDB does not support them with BlobDB
(the ``blocks`` table's blob files), rocksdict 0.3.29 crashes (SIGSEGV)
reading a blob value through one, and rocksdict rewrites its config file in
the primary's directory when opening one. Without ``/proc/self/fd`` (not
Linux), links name the store's files: a deletion between the listing and
the open fails the open, which is then tried again.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ucm_db.errors import TierError

D = TypeVar("D")

#: Files an open writes (rocksdict's config; RocksDB's lock and info logs, which a read-only open does not
#: touch): never in a shadow.
WRITTEN_AT_OPEN = ("rocksdict-config.json", "LOCK", "LOG")
#: Files copied into a shadow rather than pinned: they name the version the open sees.
COPIED = ("CURRENT", "MANIFEST-")
#: Opens tried beside a writer that keeps changing the directory; the pause after the n-th failed one.
OPEN_TRIES = 8
RETRY_PAUSE_S = 0.02
#: Tries to pin files while no edit is added to the version (each takes about a millisecond).
PIN_TRIES = 50
_FD_LINKS = Path("/proc/self/fd")


class _Version:
    """The version a RocksDB directory names now: ``CURRENT``'s bytes and the
    MANIFEST it names, held open, with the length it had. Raises
    ``FileNotFoundError`` where either is missing."""

    def __init__(self, real: Path) -> None:
        self.current = (real / "CURRENT").read_bytes()
        self.manifest = self.current.decode("ascii", "replace").strip()
        self.fd = os.open(real / Path(self.manifest).name, os.O_RDONLY | os.O_CLOEXEC)
        self.length = os.fstat(self.fd).st_size

    def unchanged(self, real: Path) -> bool:
        """Whether no edit has been added since it was read: then no file of
        its version was deleted meanwhile (a writer deletes a file only once
        an edit has made it obsolete)."""
        try:
            return os.fstat(self.fd).st_size == self.length and (real / "CURRENT").read_bytes() == self.current
        except FileNotFoundError:
            return False

    def copy_into(self, shadow: Path) -> None:
        """``CURRENT`` and the MANIFEST's first ``length`` bytes (appended to
        only, so these never change) into ``shadow``."""
        (shadow / "CURRENT").write_bytes(self.current)
        with open(shadow / Path(self.manifest).name, "xb") as copy:
            done = 0
            while done < self.length:
                chunk = os.pread(self.fd, min(1 << 20, self.length - done), done)
                if not chunk:
                    break
                copy.write(chunk)
                done += len(chunk)

    def close(self) -> None:
        os.close(self.fd)


class Shadow:
    """A private directory of pinned links to a RocksDB directory's files
    (module docs). ``remove`` closes every descriptor it holds and deletes
    the directory; it may run more than once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: The directory's listing when it was last pinned.
        self.names: list[str] = []
        #: File name -> the descriptor its link names.
        self._pinned: dict[str, int] = {}
        self._linked: set[str] = set()
        self._by_descriptor = _FD_LINKS.is_dir()

    @classmethod
    def pin(cls, real: Path) -> Shadow:
        """A shadow of ``real`` as of one moment: its version, and every
        file that version may name pinned (module docs)."""
        try:
            path = Path(tempfile.mkdtemp(prefix="ucm-db-rocksdb-ro-"))
        except OSError as exc:
            raise TierError(f"RocksDB store at {real} cannot be opened read-only: the private directory of links to "
                            f"its files could not be made in {tempfile.gettempdir()} ({exc})",
                            hint="set TMPDIR to a writable directory") from exc
        shadow = cls(path)
        try:
            shadow._link_all(real)
            for attempt in range(PIN_TRIES):
                if attempt:
                    time.sleep(RETRY_PAUSE_S * attempt / PIN_TRIES)
                try:
                    version = _Version(real)
                except FileNotFoundError:
                    if not (real / "CURRENT").exists():
                        return shadow  # no version to pin: the open says what is wrong
                    continue  # the MANIFEST it named was replaced meanwhile
                try:
                    shadow._link_all(real)  # files made since the first listing that the version may name
                    if version.unchanged(real):
                        version.copy_into(shadow.path)
                        return shadow
                finally:
                    version.close()
        except BaseException:
            shadow.remove()
            raise
        shadow.remove()
        raise TierError(f"RocksDB store at {real} cannot be opened read-only: its writer changed it during each of "
                        f"{PIN_TRIES} tries to pin one version of it", hint="try again, or when it writes less")

    def _link_all(self, real: Path) -> None:
        """Links every file of ``real`` not linked yet (but those an open
        writes or that are copied)."""
        self.names = sorted(os.listdir(real))
        for name in self.names:
            if name not in self._linked and not name.startswith(WRITTEN_AT_OPEN + COPIED):
                self._link(real, name)

    def _link(self, real: Path, name: str) -> None:
        if not self._by_descriptor:
            self._linked.add(name)
            os.symlink(real / name, self.path / name)
            return
        fd = _open(real, name)
        if fd is None:
            return
        self._pinned[name] = fd
        self._linked.add(name)
        os.symlink(_FD_LINKS / str(fd), self.path / name)

    def settle(self) -> None:
        """After the open: closes the descriptors it has no more use for
        (all but blob files') and removes their links, so no link can name a
        descriptor number reused for another file."""
        for name in [name for name in self._pinned if not name.endswith(".blob")]:
            os.unlink(self.path / name)
            os.close(self._pinned.pop(name))

    def remove_in_owner(self, pid: int) -> None:
        """``remove``, deleting the directory only in process ``pid`` (a
        forked child exiting leaves its parent's shadow alone)."""
        self.remove(delete=os.getpid() == pid)

    def remove(self, *, delete: bool = True) -> None:
        """Deletes the directory (unless ``delete`` is false: a forked
        child's copy of its parent's shadow), then closes the pinned
        descriptors (no link is left naming a closed one)."""
        if delete:
            shutil.rmtree(self.path, ignore_errors=True)
        pinned, self._pinned = self._pinned, {}
        for fd in pinned.values():
            try:
                os.close(fd)
            except OSError:
                pass  # closed already (a process that closed every descriptor)


def _open(real: Path, name: str) -> int | None:
    """A read-only descriptor of the regular file ``real/name``; ``None`` if
    it is gone (deleted since the listing) or is no regular file."""
    try:
        fd = os.open(real / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TierError(f"RocksDB store at {real} cannot be opened read-only: {name}: {exc}",
                        hint="raise the open-files limit (ulimit -n) if it ran out, else check the store's permissions"
                        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def open_pinned(real: Path, open_db: Callable[[Path], D]) -> tuple[D, Shadow]:
    """``open_db`` run on a new shadow of the RocksDB directory ``real``,
    tried again while the directory changes under it (module docs); the
    caller removes the shadow once the database is closed."""
    for attempt in range(OPEN_TRIES):
        shadow = Shadow.pin(real)
        try:
            db = open_db(shadow.path)
        except BaseException as exc:
            shadow.remove()
            if not isinstance(exc, Exception) or attempt + 1 == OPEN_TRIES or sorted(os.listdir(real)) == shadow.names:
                raise
            time.sleep(RETRY_PAUSE_S * (attempt + 1))
            continue
        shadow.settle()
        return db, shadow
    raise AssertionError("unreachable")
