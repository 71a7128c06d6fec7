"""Mounting the power-cut file system (:mod:`.fs`) for a test.

:func:`require_fuse` fails (never skips) with the reason and the fix when
FUSE cannot be used here; :class:`PowerCutMount` starts ``fs.py`` in its own
process, waits for the mount, sends cuts, and unmounts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FS_SCRIPT = Path(__file__).with_name("fs.py")
_MOUNT_WAIT_S = 20.0


def fuse_problem() -> str | None:
    """Why FUSE cannot be used on this machine, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (FUSE is not available in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing: install Debian's fuse3 (`apt-get install -y fuse3`; `python3 dev.py setup` does it as root)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError, EnvironmentError) as exc:
        return f"the FUSE binding mfusepy cannot be loaded ({exc}): `pip install -e '.[dev]'` installs it, fuse3 brings libfuse3"
    return None


def require_fuse() -> None:
    """Fails the calling test loudly when FUSE is unavailable."""
    problem = fuse_problem()
    if problem is not None:
        raise AssertionError(f"the power-cut simulator needs FUSE: {problem}")


class PowerCutMount:
    """A mounted power-cut file system; use as a context manager."""

    def __init__(self, mountpoint: Path, work_dir: Path) -> None:
        self.mountpoint = mountpoint
        self._socket = work_dir / "powercut.sock"
        self._log = work_dir / "powercut-fs.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PowerCutMount:
        require_fuse()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._socket.unlink(missing_ok=True)
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen([sys.executable, str(FS_SCRIPT), str(self.mountpoint), str(self._socket)],
                                          stdout=log, stderr=log)
        deadline = time.monotonic() + _MOUNT_WAIT_S
        while not (os.path.ismount(self.mountpoint) and self._socket.exists()):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError(f"the power-cut file system did not mount at {self.mountpoint}:\n{self._log.read_text()[-3000:]}")
            time.sleep(0.02)
        return self

    def command(self, line: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(str(self._socket))
            sock.sendall(line.encode() + b"\n")
            reply = sock.makefile().readline()
        status, _, payload = reply.partition(" ")
        if status != "ok":
            raise AssertionError(f"power-cut file system refused {line!r}: {reply}")
        return json.loads(payload)  # type: ignore[no-any-return]

    def cut(self, mode: str, seed: int) -> dict[str, Any]:
        """The power loss (every process using the mount must be dead)."""
        return self.command(f"cut {mode} {seed}")

    def fail_syncs(self, failing: bool) -> None:
        """While ``failing``, every sync on the mount fails with EIO (fs.py)."""
        self.command(f"fsync-errors {'on' if failing else 'off'}")

    def strict_names(self, strict: bool) -> None:
        """With ``strict``, a name is durable only once its directory is
        fsynced (fs.py); otherwise as in ext4's journal."""
        self.command(f"names {'strict' if strict else 'journal'}")

    def __exit__(self, *exc: object) -> None:
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False, capture_output=True)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
