"""ucm-db's vLLM KV connector (installed as ``ucm_db.connector``).

The only package of ucm-db that imports vLLM and torch. Load it with
``kv_connector="UcmDbConnector"`` and ``kv_connector_module_path="ucm_db.connector"``;
see :mod:`ucm_db.connector.connector` for the full configuration.

``UcmDbConnector`` is resolved lazily, so the torch-only modules (layouts,
settings) import without loading vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UcmDbConnector"]


def __getattr__(name: str) -> Any:
    if name == "UcmDbConnector":
        from ucm_db.connector.connector import UcmDbConnector

        return UcmDbConnector
    raise AttributeError(f"module 'ucm_db.connector' has no attribute {name!r}")
