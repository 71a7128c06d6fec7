"""ucm-db's connector with every vLLM hook timed (``ucm-db bench hooks``).

Measuring code, never a product part: :class:`TimedUcmDbConnector` is
:class:`ucm_db.connector.UcmDbConnector` with each hook vLLM calls wrapped
in a wall-clock timer (:data:`HOOKS`), and :class:`TimedNoopConnector` the
same over the no-op connector (vLLM's plumbing alone). Each process of the
engine (the engine core holds the scheduler half, each worker its half)
writes its totals to ``$UCM_DB_HOOK_TIMES_DIR/hooks-PID.json`` every
:data:`WRITE_EVERY` calls and at shutdown.

Invariants:
    * A hook's result and exceptions pass through unchanged; only the time
      spent inside it and the number of calls are recorded.
    * The scheduler half counts its steps (``build_connector_meta`` calls)
      and the largest step's loads and saves.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ucm_db.connector import UcmDbConnector
from ucm_db.tools.bench.noop_connector import NoopConnector

#: The hooks timed: the scheduler's, then the worker's (vLLM calls the last
#: ones once per step, the layer hooks once per layer).
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "take_events", "get_kv_connector_stats",
    "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta",
)
WRITE_EVERY = 500
_lock = threading.Lock()
_totals: dict[str, list[float]] = {}  # hook -> [calls, seconds]
_steps = 0  # build_connector_meta calls
_max_blocks = 0  # the most blocks one step loads and saves
_calls = 0


def _record(name: str, elapsed_s: float) -> None:
    global _calls
    with _lock:
        entry = _totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += elapsed_s
        _calls += 1
        if _calls % WRITE_EVERY == 0:
            _write()


def _write() -> None:
    out = os.environ.get("UCM_DB_HOOK_TIMES_DIR")
    if not out:
        return
    body = {"pid": os.getpid(), "hooks": {k: {"calls": int(v[0]), "s": v[1]} for k, v in _totals.items()},
            "meta": {"steps": _steps, "max_blocks": _max_blocks}}
    path = Path(out) / f"hooks-{os.getpid()}.json"
    path.with_suffix(".tmp").write_text(json.dumps(body))
    path.with_suffix(".tmp").rename(path)


def _timed(name: str, method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _record(name, time.perf_counter() - started)
    return wrapper


def _timing(cls: type) -> type:
    for name in HOOKS:
        method = getattr(cls, name, None)
        if method is not None:
            setattr(cls, name, _timed(name, method))
    original_meta = cls.build_connector_meta

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        global _steps, _max_blocks
        meta = original_meta(self, scheduler_output)
        blocks = sum(len(t.block_ids) for t in (*getattr(meta, "loads", ()), *getattr(meta, "saves", ())))
        with _lock:
            _steps += 1
            _max_blocks = max(_max_blocks, blocks)
        return meta

    cls.build_connector_meta = build_connector_meta
    original_shutdown = getattr(cls, "shutdown", None)

    def shutdown(self: Any) -> None:
        with _lock:
            _write()
        if original_shutdown is not None:
            original_shutdown(self)

    cls.shutdown = shutdown
    return cls


@_timing
class TimedUcmDbConnector(UcmDbConnector):
    """ucm-db's connector, hooks timed (module docstring)."""


@_timing
class TimedNoopConnector(NoopConnector):
    """The no-op connector, hooks timed (module docstring)."""
