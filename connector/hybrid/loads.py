"""A hybrid model's async loads, merged across its KV cache groups.

Every load of a model with several KV cache groups is asynchronous
(hybrid.py): each group's worker half loads its part of a request's hit in
its own background thread (async_loads.py), and vLLM must hear of the
request once, when all of them have ended.

Invariants:
    * A request is reported finished (``finished_recving``) once every
      group's async load of it submitted so far has ended; it is reported
      failed (``failed_recving``, in the same step: vLLM releases a failed
      request from WAITING_FOR_REMOTE_KVS only when it is finished too) if
      any group failed a block of it.
    * Failures are never reported as block ids: vLLM 0.32 stops the engine
      on block-level load failures of a model with several groups
      (``Scheduler._handle_invalid_blocks``); per request, with
      ``kv_load_failure_policy: "recompute"``, it recomputes the request
      from its first token (``Scheduler._handle_failed_recving``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class GroupLoads:
    """Which groups' async loads of each request are still running."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self._parts = parts  # one worker half per group, each with ``finished_requests(wait_s)``
        self._waiting: dict[str, set[int]] = {}  # request -> groups whose load of it has not ended
        self._failed: set[str] = set()  # a group failed it; other groups' loads may still run
        self._failed_done: set[str] = set()  # finished and failed, until taken
        self._failed_now: dict[int, set[str]] = {}  # group -> requests whose load it could not plan

    def submitted(self, group: int, req_ids: Iterable[str]) -> None:
        """Group ``group`` started async loads of ``req_ids``."""
        for req_id in req_ids:
            self._waiting.setdefault(req_id, set()).add(group)

    def failed_now(self, group: int, req_ids: Iterable[str]) -> None:
        """Group ``group`` has no load to run for ``req_ids`` though their
        hit was claimed: each is ended and failed for it at once."""
        for req_id in req_ids:
            self._waiting.setdefault(req_id, set()).add(group)
            self._failed_now.setdefault(group, set()).add(req_id)

    def finished(self, wait_s: float = 0.0) -> set[str]:
        """Requests every group's load of which has ended since the last
        call (the failed ones among them go to :meth:`take_failed`). With
        ``wait_s``, waits that long at most per group while none has ended."""
        done: set[str] = set()
        for group, part in enumerate(self._parts):
            ended, failed = part.finished_requests(0.0 if done else wait_s)
            now = self._failed_now.pop(group, set())
            ended, failed = set(ended) | now, set(failed) | now
            self._failed.update(failed)
            for req_id in ended:
                groups = self._waiting.get(req_id, set())
                groups.discard(group)
                if not groups:
                    self._waiting.pop(req_id, None)
                    done.add(req_id)
        failed_done = done & self._failed
        self._failed -= failed_done
        self._failed_done |= failed_done
        return done

    def take_failed(self) -> set[str]:
        """Requests reported finished whose load failed in some group, once."""
        out, self._failed_done = self._failed_done, set()
        return out
