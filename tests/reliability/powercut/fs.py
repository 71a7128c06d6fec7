"""A FUSE file system that forgets what was not fsynced: a power-cut simulator.

Run as a script (``python fs.py MOUNTPOINT CONTROL_SOCKET``); it serves the
mount from memory until it is unmounted. It imports only the standard
library and ``mfusepy``, so it starts fast and shares nothing with the test.

Model (what a journaling file system on a disk with a volatile write cache
guarantees, and no more):
    * A file's bytes live in two images: ``live`` (what reads return) and
      ``durable`` (what the disk holds). A write changes ``live`` and records
      the 4 KiB pages it touched, with every version each page had since the
      last sync. ``fsync``/``fdatasync`` of the file copy its live image to
      its durable one. A write through a descriptor opened with ``O_SYNC`` or
      ``O_DSYNC`` is durable when it returns.
    * Names (create, mkdir, unlink, rename) change the live tree; any fsync
      (of a file or a directory) is a journal commit that makes the whole
      live tree durable, as ext4's ordered journal does. With ``names
      strict`` (the control socket) a name is durable only once its
      directory is fsynced, as POSIX promises and no more: a file's fsync
      makes its bytes durable, not its name; a directory's fsync makes its
      own entries durable, not those of the directories under it. A cut
      then loses every file or directory whose name, or an ancestor's, was
      never synced.
    * A *cut* (``cut MODE SEED`` on the control socket) is the power loss:
      the tree reverts to its durable state, and each file keeps its durable
      image plus, in mode ``random``, a random subset of its unsynced pages,
      each at a random one of the versions it had (pages reach a disk in any
      order, and a page written twice may land in its first version). Mode
      ``drop`` keeps no unsynced page. The caller kills every process using
      the mount first, as a power loss does.
    * After a cut the kernel's cached pages are stale: files are opened
      without ``keep_cache`` and attributes and names are never cached, so
      the next ``open`` of a file drops the kernel's copy and reads come from
      here again.

Control socket: one line per connection, one reply line: ``cut drop|random
SEED`` -> ``ok <json stats of the cut>``; ``stats`` -> ``ok <json>``;
``fsync-errors on|off`` -> ``ok {}``: while on, every ``fsync``,
``fdatasync``, directory fsync and ``O_SYNC``/``O_DSYNC`` write fails with
EIO and makes nothing durable (a disk that stopped taking writes back).
``names journal|strict`` -> ``ok {}``: how names become durable (above;
``journal`` at start).
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import stat
import sys
import threading
import time
from typing import Any

import mfusepy

PAGE_BYTES = 4096
#: Versions kept per unsynced page (the first and the newest ones).
_MAX_VERSIONS = 4


class _Node:
    __slots__ = ("is_dir", "mode", "live", "durable", "dirty", "mtime_ns")

    def __init__(self, is_dir: bool, mode: int) -> None:
        self.is_dir = is_dir
        self.mode = mode
        self.live = bytearray()
        self.durable = bytearray()
        self.dirty: dict[int, list[bytes]] = {}  # page number -> versions since the last sync
        self.mtime_ns = time.time_ns()

    def write(self, data: bytes, offset: int) -> None:
        if not data:
            return
        end = offset + len(data)
        if end > len(self.live):
            self.live.extend(bytes(end - len(self.live)))
        self.live[offset:end] = data
        for page in range(offset // PAGE_BYTES, (end - 1) // PAGE_BYTES + 1):
            versions = self.dirty.setdefault(page, [])
            image = bytes(self.live[page * PAGE_BYTES:(page + 1) * PAGE_BYTES])
            if len(versions) >= _MAX_VERSIONS:
                versions.pop(1)
            versions.append(image)
        self.mtime_ns = time.time_ns()

    def truncate(self, length: int) -> None:
        if length < len(self.live):
            del self.live[length:]
        else:
            self.live.extend(bytes(length - len(self.live)))
        self.dirty[-1] = [length.to_bytes(8, "little")]  # the size itself is unsynced
        self.mtime_ns = time.time_ns()

    def sync(self) -> None:
        self.durable = bytearray(self.live)
        self.dirty.clear()

    def cut(self, rng: random.Random | None) -> int:
        """Reverts to the durable image plus (with ``rng``) a random subset of
        unsynced pages; returns how many unsynced pages were kept."""
        image = self.durable
        kept = 0
        if rng is not None:
            for page, versions in self.dirty.items():
                if page < 0 or rng.random() < 0.5:
                    continue
                version = rng.choice(versions)
                start = page * PAGE_BYTES
                if start + len(version) > len(image):
                    image.extend(bytes(start + len(version) - len(image)))
                image[start:start + len(version)] = version
                kept += 1
        self.durable = image
        self.live = bytearray(image)
        self.dirty.clear()
        return kept


class PowerCutFs(mfusepy.Operations):
    """The file system (see module doc). Every operation holds ``_mutex``
    (not ``lock``: mfusepy would take that for the POSIX lock handler, and
    without one the kernel keeps locks itself)."""

    use_ns = True

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        root = _Node(True, stat.S_IFDIR | 0o755)
        self.live: dict[str, _Node] = {"/": root}
        self.durable: dict[str, _Node] = {"/": root}
        self._sync_fhs: set[int] = set()
        self._next_fh = 1
        self.fsync_errors = False  # the control socket's ``fsync-errors``: syncs fail with EIO
        self.strict_names = False  # the control socket's ``names strict``: names durable by directory fsync only
        self.counters = {"cuts": 0, "writes": 0, "fsyncs": 0, "pages_dropped": 0, "pages_kept": 0}

    # -- helpers -----------------------------------------------------------------
    def _node(self, path: str) -> _Node:
        node = self.live.get(path)
        if node is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return node

    def _parent(self, path: str) -> _Node:
        parent = self.live.get(os.path.dirname(path))
        if parent is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        if not parent.is_dir:
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return parent

    def _journal_commit(self) -> None:
        """A file's or directory's fsync: every name durable (ext4's journal);
        with strict names, none (only :meth:`_sync_entries` makes names durable)."""
        if not self.strict_names:
            self.durable = dict(self.live)

    def _sync_entries(self, path: str) -> None:
        """A directory's fsync: its own entries as they are live (every name
        with ext4's journal)."""
        if not self.strict_names:
            self.durable = dict(self.live)
            return
        prefix = path.rstrip("/") + "/"
        for name in [p for p in self.durable if p != path and p.startswith(prefix) and "/" not in p[len(prefix):]]:
            del self.durable[name]
        for name in self._children(path):
            self.durable[name] = self.live[name]

    def _durable_tree(self) -> dict[str, _Node]:
        """The durable names whose every ancestor's name is durable too."""
        kept: dict[str, _Node] = {}
        for path in sorted(self.durable, key=lambda p: p.count("/")):
            if path == "/" or os.path.dirname(path) in kept:
                kept[path] = self.durable[path]
        return kept

    def _children(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return [p for p in self.live if p != path and p.startswith(prefix) and "/" not in p[len(prefix):]]

    def cut(self, mode: str, seed: int) -> dict[str, Any]:
        rng = random.Random(seed) if mode == "random" else None
        with self._mutex:
            dropped = sum(len(n.dirty) for n in set(self.live.values()) | set(self.durable.values()))
            kept = 0
            for node in set(self.durable.values()):
                if not node.is_dir:
                    kept += node.cut(rng)
            self.durable = self._durable_tree()
            self.live = dict(self.durable)
            self._sync_fhs.clear()
            self.counters["cuts"] += 1
            self.counters["pages_kept"] += kept
            self.counters["pages_dropped"] += dropped - kept
            return {"unsynced_pages": dropped, "kept": kept}

    # -- operations --------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        with self._mutex:
            node = self._node(path)
            return {
                "st_mode": node.mode, "st_nlink": 2 if node.is_dir else 1,
                "st_size": 0 if node.is_dir else len(node.live),
                "st_uid": os.getuid(), "st_gid": os.getgid(),
                "st_mtime": node.mtime_ns, "st_ctime": node.mtime_ns, "st_atime": node.mtime_ns,
                "st_blocks": -(-len(node.live) // 512),
            }

    def readdir(self, path: str, fh: int) -> list[str]:
        with self._mutex:
            return [".", ".."] + [os.path.basename(p) for p in self._children(path)]

    def mkdir(self, path: str, mode: int) -> int:
        with self._mutex:
            self._parent(path)
            if path in self.live:
                raise mfusepy.FuseOSError(errno.EEXIST)
            self.live[path] = _Node(True, stat.S_IFDIR | (mode & 0o7777))
            return 0

    def rmdir(self, path: str) -> int:
        with self._mutex:
            if not self._node(path).is_dir:
                raise mfusepy.FuseOSError(errno.ENOTDIR)
            if self._children(path):
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            del self.live[path]
            return 0

    def _new_fh(self, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        if flags & (os.O_SYNC | os.O_DSYNC):
            self._sync_fhs.add(fh)
        return fh

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        with self._mutex:
            self._parent(path)
            if path not in self.live:
                self.live[path] = _Node(False, stat.S_IFREG | (mode & 0o7777))
            return self._new_fh(0)

    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            node = self._node(path)
            if flags & os.O_TRUNC and not node.is_dir:
                node.truncate(0)
            return self._new_fh(flags)

    def release(self, path: str, fh: int) -> int:
        with self._mutex:
            self._sync_fhs.discard(fh)
            return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            return bytes(self._node(path).live[offset:offset + size])

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            node = self._node(path)
            if fh in self._sync_fhs and self.fsync_errors:
                raise mfusepy.FuseOSError(errno.EIO)  # a synchronous write the disk did not take
            node.write(data, offset)
            self.counters["writes"] += 1
            if fh in self._sync_fhs:
                node.sync()
                self._journal_commit()
            return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self._mutex:
            self._node(path).truncate(length)
            return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            if self.fsync_errors:
                raise mfusepy.FuseOSError(errno.EIO)
            self._node(path).sync()
            self._journal_commit()
            self.counters["fsyncs"] += 1
            return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            if self.fsync_errors:
                raise mfusepy.FuseOSError(errno.EIO)
            self._sync_entries(path)
            return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            if self._node(path).is_dir:
                raise mfusepy.FuseOSError(errno.EISDIR)
            del self.live[path]
            return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            node = self._node(old)
            self._parent(new)
            target = self.live.get(new)
            if target is not None and target.is_dir and self._children(new):
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            moved = {p: n for p, n in self.live.items() if p == old or p.startswith(old + "/")}
            for p in moved:
                del self.live[p]
            for p, n in moved.items():
                self.live[new + p[len(old):]] = n
            node.mtime_ns = time.time_ns()
            return 0

    def chmod(self, path: str, mode: int) -> int:
        with self._mutex:
            node = self._node(path)
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
            return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self._mutex:
            self._node(path).mtime_ns = times[1] if times else time.time_ns()
            return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": PAGE_BYTES, "f_frsize": PAGE_BYTES, "f_blocks": 1 << 24, "f_bfree": 1 << 23,
                "f_bavail": 1 << 23, "f_files": 1 << 20, "f_ffree": 1 << 19, "f_namemax": 255}


def _serve_control(fs: PowerCutFs, sock_path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as stream:
            words = stream.readline().split()
            try:
                if words[:1] == ["cut"] and len(words) == 3:
                    reply = fs.cut(words[1], int(words[2]))
                elif words[:1] == ["fsync-errors"] and words[1:] in (["on"], ["off"]):
                    with fs._mutex:
                        fs.fsync_errors = words[1] == "on"
                    reply = {}
                elif words[:1] == ["names"] and words[1:] in (["journal"], ["strict"]):
                    with fs._mutex:
                        fs.strict_names = words[1] == "strict"
                    reply = {}
                elif words == ["stats"]:
                    with fs._mutex:
                        reply = dict(fs.counters)
                else:
                    raise ValueError(f"unknown command {words}")
                stream.write("ok " + json.dumps(reply) + "\n")
            except Exception as exc:  # noqa: BLE001 - the reply carries it
                stream.write(f"error {exc!r}\n")


def main() -> None:
    mountpoint, sock_path = sys.argv[1], sys.argv[2]
    fs = PowerCutFs()
    threading.Thread(target=_serve_control, args=(fs, sock_path), daemon=True).start()
    mfusepy.FUSE(
        fs, mountpoint, foreground=True, nothreads=True, fsname="powercut",
        attr_timeout=0, entry_timeout=0, negative_timeout=0, hard_remove=True,
    )


if __name__ == "__main__":
    main()
