"""The ucm-db connector with its start-up timed, for ``ucm-db bench restart``.

vLLM builds the connector inside its engine-core process, where the bench
cannot reach it; this subclass writes what each start-up step of the real
:class:`~ucm_db.connector.connector.UcmDbConnector` took to a JSON-lines file
named by :data:`TIMINGS_ENV`, one line per step:
``{"pid": ..., "step": ..., "role": ..., "s": ..., "end": ...}`` (``end``: wall
clock, ``time.time()``, when the step ended). Steps: ``import``
(this module's import of the connector, once per process), ``layout_check``
(``get_required_kvcache_layout``: settings checked and the store opened and
closed), ``init`` (the constructor: store acquired, identity, role half),
``register_kv_caches`` (worker).

Invariants:
    * Nothing is changed but timed: every step calls the real method.
    * Without :data:`TIMINGS_ENV` nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

_IMPORT_STARTED = time.perf_counter()
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402 - timed: the import is a start-up step

_IMPORT_S = time.perf_counter() - _IMPORT_STARTED

#: Environment variable naming the JSON-lines file the steps are appended to
#: (``restart.TIMINGS_ENV``, spelled there too: the bench never imports this module).
TIMINGS_ENV = "UCM_DB_BENCH_CONNECTOR_TIMINGS"


def _record(step: str, seconds: float, role: str = "") -> None:
    path = os.environ.get(TIMINGS_ENV)
    if path:
        with open(path, "a") as out:  # one short line per write: appends from several processes stay whole
            out.write(json.dumps({"pid": os.getpid(), "step": step, "role": role, "s": seconds, "end": time.time()}) + "\n")


_record("import", _IMPORT_S)


class TimedUcmDbConnector(UcmDbConnector):
    """:class:`UcmDbConnector`, its start-up steps timed (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        started = time.perf_counter()
        super().__init__(vllm_config, role, kv_cache_config)
        _record("init", time.perf_counter() - started, getattr(role, "name", str(role)).lower())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        started = time.perf_counter()
        layout = super().get_required_kvcache_layout(vllm_config)
        _record("layout_check", time.perf_counter() - started)
        return layout

    def register_kv_caches(self, kv_caches: Any) -> None:
        started = time.perf_counter()
        super().register_kv_caches(kv_caches)
        _record("register_kv_caches", time.perf_counter() - started, "worker")
