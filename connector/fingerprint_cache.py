"""The persisted fingerprint cache: per-file digests of large checkpoints
(:data:`~ucm_db.connector.fingerprints.PERSIST_MIN_BYTES` or more) kept
across starts in ``$XDG_CACHE_HOME/ucm-db/fingerprints.json`` (else
``~/.cache/ucm-db/fingerprints.json``), so an engine's next start stats its
files instead of hashing them.

Invariants:
    * An entry whose stats match a file supplies that file's digest, so the
      file decides models' namespaces: whoever can write it can give one
      model another's namespace (its engines then read the other's KV). It
      is trusted only as far as the serving user's own files are: the
      directory is made ``0700`` (an existing one of this user's too), the
      cache and its lock file are created ``0600``, and a cache file that
      another user owns, that group or others may write, that is a link,
      or in a directory of another user's, supplies nothing: it is ignored
      with a warning (every file hashed again) and replaced by this user's.
    * Written atomically: a private temporary file (``O_EXCL``, never
      through a link), flushed to disk, then renamed over the cache; a
      crash leaves the old cache or the new one, never a mix.
    * The processes of one engine starting together read, hash and write
      under one ``flock`` of the lock file beside it.
    * A cache that cannot be read or written (a read-only home) costs
      hashing again, never a start.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_MAX_CACHED_DIRS = 64
_CACHE_FORMAT = 1
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/ucm-db/fingerprints.json`` (else under ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucm-db" / "fingerprints.json"


@contextmanager
def cache_file() -> Iterator[dict[str, dict[str, list[Any]]]]:
    """The cached directories' entries (absolute path -> file name ->
    ``[ino, size, mtime_ns, ctime_ns, digest]``), read under an exclusive
    lock and written back (atomically) when the block ends. Where the cache
    directory cannot be used, an empty dict and nothing is kept."""
    path = cache_path()
    try:
        if not _private_folder(path.parent):
            yield {}
            return
        lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield {}
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dirs, trusted = _read_cache(path)
        files: dict[str, dict[str, list[Any]]] = {k: v["files"] for k, v in dirs.items()}
        yield files
        stored = [k for k, entries in files.items() if k not in dirs or dirs[k]["files"] is not entries]
        for key in stored:
            dirs[key] = {"used_s": int(time.time()), "files": files[key]}
        if stored or not trusted:
            _write_cache(path, dirs)
    finally:
        os.close(lock)  # releases the flock


def _private_folder(folder: Path) -> bool:
    """Makes the cache directory (``0700``); False, with a warning, where it
    is another user's (its files could be swapped under this user's)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(folder)
    if st.st_uid != os.geteuid():
        _warn_distrusted(folder, "is another user's directory")
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)  # one an older ucm-db made with the umask's bits
    return True


def _read_cache(path: Path) -> tuple[dict[str, dict[str, Any]], bool]:
    """(the cache's directories; whether the file may be trusted: none at all is)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}, True
    except OSError:  # a link (ELOOP) or unreadable
        _warn_distrusted(path, "is a link or cannot be read")
        return {}, False
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & _OTHERS_WRITE:
            _warn_distrusted(path, f"is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}")
            return {}, False
        try:
            data = json.loads(handle.read())
        except (OSError, ValueError):
            return {}, True  # damaged: rebuilt from the files
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or not isinstance(data.get("dirs"), dict):
        return {}, True
    return {k: v for k, v in data["dirs"].items() if isinstance(v, dict) and isinstance(v.get("files"), dict)}, True


def _write_cache(path: Path, dirs: dict[str, dict[str, Any]]) -> None:
    kept = sorted((k for k in dirs if os.path.exists(k)), key=lambda k: dirs[k].get("used_s", 0))[-_MAX_CACHED_DIRS:]
    body = json.dumps({"format": _CACHE_FORMAT, "dirs": {k: dirs[k] for k in kept}}, sort_keys=True).encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # one a crashed process of this pid left
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full or read-only disk: the next start hashes again


def _warn_distrusted(where: Path, why: str) -> None:
    logger.warning("ucm-db: the fingerprint cache %s %s: ignored, so the model files are hashed again (anyone who "
                   "can write it could give one model another's namespace); ucm-db keeps it private to the serving "
                   "user (directory 0700, file 0600, docs/trust.md)", where, why)
