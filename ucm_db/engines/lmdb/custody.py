"""Which opens may skip the page walk: a data file that nothing but LMDB has
written since a clean walk, within one boot.

The page check at open (:func:`ucm_db.engines.lmdb.checks.check_pages_at_open`)
walks every branch and leaf page of the store in a child process: 1.2 s at
a million records, once per process that opens the store (a vLLM engine
opens it three times as it starts). Damage that walk can find comes from
writes LMDB did not make (a disk fault, a tool writing into the file) or
from an OS crash (pages LMDB wrote but the disk never got). Within one boot
the page cache holds what LMDB wrote, and LMDB's own commits, from any
process (one killed mid-commit too), never leave a reachable page damaged.

So each handle keeps a *custody* of the file: the file's state (boot id,
device, inode, size, modification and change times in ns) when the handle
last saw it whole: after its own walk, or a matching record at open; then
after each of its own commits, where the state at the commit's start (the
LMDB writer lock held: no other commit runs) was the one it held. A state
that differs (another process's commit, any other write) ends the custody
for good. At close, a handle still in custody of an unchanged file writes
the state to :data:`RECORD_FILE` beside the data file; the next open whose
state equals the record skips the walk.

Invariants:
    * A record matches only in the boot that wrote it: after an OS crash
      (a new boot id) every open walks. No boot id (not Linux, no
      ``UCM_DB_BOOT_ID``): nothing is recorded, every open walks.
    * The record is written only by a handle whose custody never broke,
      with the state it holds equal to the file's at close; it is replaced
      atomically (never read half-written) and needs no fsync (it is worth
      nothing after a reboot).
    * What it cannot see: a write that lands between a commit and the
      handle's look at the file after it, or in the same clock tick as a
      commit keeping the file's size; and a disk returning other bytes for
      a page nobody wrote (``ucm-db verify`` walks every page, always).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ucm_db.engines.lmdb.recovery import boot_id

logger = logging.getLogger("ucm_db")

#: The record of the last clean state, in the LMDB directory.
RECORD_FILE = "walked-clean"


@dataclass(frozen=True)
class FileState:
    """What tells one version of the data file from another within a boot."""

    boot: str
    device: int
    inode: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int


def file_state(data: Path, boot: str | None = None) -> FileState | None:
    """The data file's state now; None without a boot id or a file.
    ``boot``: the boot id read already (a handle reads it once, at open:
    reading it costs more than the ``stat``)."""
    boot = boot if boot is not None else boot_id()
    if boot is None:
        return None
    try:
        st = os.stat(data)
    except OSError:
        return None
    return FileState(boot, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_record(env_dir: Path) -> FileState | None:
    """The recorded clean state; None where there is none or it does not parse."""
    try:
        return FileState(**json.loads((env_dir / RECORD_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_record(env_dir: Path, state: FileState) -> None:
    """Replaces the record atomically; a failure (a read-only volume) only
    means the next open walks."""
    tmp = env_dir / f".{RECORD_FILE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # a store's files are 0600
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(asdict(state)))
        os.replace(tmp, env_dir / RECORD_FILE)
    except OSError as exc:
        logger.debug("ucm-db: could not record the clean state of %s: %s", env_dir, exc)
        tmp.unlink(missing_ok=True)


class Custody:
    """One handle's custody of its data file (module docstring). Not
    thread-safe by itself: the engine calls it under its write lock or its
    open lock."""

    def __init__(self, env_dir: Path) -> None:
        self._env_dir = env_dir
        self._data = env_dir / "data.mdb"
        self._held: FileState | None = None
        self._fresh = False
        self._boot: str | None = None  # read at each open: a process lives in one boot

    def take_recorded(self) -> bool:
        """Before the open's page check: True if the file is in the state a
        clean close recorded (custody taken at once: no walk is needed);
        else False, and a caller that walks calls :meth:`walked_clean`."""
        self._boot = boot_id()
        state = file_state(self._data, self._boot)
        self._held = None
        self._fresh = state is None and not self._data.exists()
        self._candidate = state
        if state is not None and read_record(self._env_dir) == state:
            self._held = state
            return True
        return False

    def walked_clean(self) -> None:
        """The page check found no damage in the state seen before it."""
        self._held = self._candidate

    def opened(self) -> None:
        """After the environment is open: a file this open created (LMDB's
        own first pages) is taken into custody as it is now."""
        if self._fresh:
            self._held = file_state(self._data, self._boot)
            self._fresh = False

    def before_commit(self) -> None:
        """Inside a write transaction (the LMDB writer lock held)."""
        if self._held is not None and file_state(self._data, self._boot) != self._held:
            self._held = None

    def after_commit(self) -> None:
        if self._held is not None:
            self._held = file_state(self._data, self._boot)

    def close(self) -> None:
        """Records the state if custody never broke and the file is unchanged."""
        held, self._held = self._held, None
        if held is not None and file_state(self._data, self._boot) == held:
            write_record(self._env_dir, held)
