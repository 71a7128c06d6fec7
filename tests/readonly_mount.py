"""A real read-only view of a directory: a bind mount remounted ``ro``.

Needs root (the test machines run as root); a test using it is skipped with
the reason where mounting is not allowed. Writes through the view fail with
EROFS exactly as on a read-only volume, while the source stays writable.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def read_only_view(source: Path, view: Path) -> Iterator[Path]:
    """``view``: ``source`` mounted read-only for the duration."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    view.mkdir(parents=True, exist_ok=True)
    bound = subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"mount --bind is not allowed here: {bound.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        probe = view / ".probe"
        with pytest.raises(OSError):  # the view really is read-only
            probe.touch()
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``path``: what a read-only open must not change."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}
