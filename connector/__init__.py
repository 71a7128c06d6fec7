"""ucm-db's vLLM KV connector (installed as ``ucm_db.connector``).

The only package of ucm-db that imports vLLM and torch. Load it with
``kv_connector="UcmDbConnector"`` and ``kv_connector_module_path="ucm_db.connector"``;
see :mod:`ucm_db.connector.connector` for the full configuration.
"""

from ucm_db.connector.connector import UcmDbConnector

__all__ = ["UcmDbConnector"]
