"""A remote that can be taken down, for the remote benchmark's "remote down" row.

``ucmbench-down://`` wraps a local directory; while its :class:`DownSwitch`
is down, every request hangs until the switch is healed (or ``hang_s``
passes) and then raises ``TimeoutError``, which is what an unreachable
object store looks like to a client. Measuring code only: the product knows
nothing of this protocol (the tests have their own fault injection in
``tests/faultfs.py``).

Invariants:
    * Registered only by :func:`register`, which the benchmark calls.
    * While up, requests pass to the directory unchanged; writes go through
      the remote tier's own whole-object write, so objects appear whole.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from ucm_db.components import write_whole

PROTOCOL = "ucmbench-down"


class DownSwitch:
    """Shared live state: up or down. Never copied (config snapshots deep-copy options)."""

    def __init__(self, hang_s: float = 30.0) -> None:
        self.hang_s = hang_s
        self._up = threading.Event()
        self._up.set()

    def __deepcopy__(self, memo: dict[int, Any]) -> DownSwitch:
        return self

    def take_down(self) -> None:
        self._up.clear()

    def heal(self) -> None:
        """Brings the remote back and releases every hung request."""
        self._up.set()

    def gate(self) -> None:
        if not self._up.is_set():
            self._up.wait(self.hang_s)
            raise TimeoutError("benchmark: remote down")


class DownableFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """A local directory behind a :class:`DownSwitch`."""

    protocol = (PROTOCOL,)
    cachable = False  # each store gets its own switch

    def __init__(self, switch: DownSwitch | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = fsspec.filesystem("file")
        self.switch = switch if switch is not None else DownSwitch()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self.switch.gate()
        return bytes(self.target.cat_file(path, start=start, end=end, **kwargs))

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.switch.gate()
        write_whole(self.target, path, bytes(value))

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.switch.gate()
        return bool(self.target.exists(path))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.switch.gate()
        return dict(self.target.info(path, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.switch.gate()
        return self.target.ls(path, detail=detail, **kwargs)

    def find(self, path: str, **kwargs: Any) -> Any:
        self.switch.gate()
        return self.target.find(path, **kwargs)

    def rm_file(self, path: str) -> None:
        self.switch.gate()
        self.target.rm_file(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(path, create_parents=create_parents, **kwargs)


def register() -> None:
    """Registers ``ucmbench-down://`` with fsspec in this process (idempotent)."""
    fsspec.register_implementation(PROTOCOL, DownableFileSystem, clobber=True)
