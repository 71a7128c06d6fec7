"""Registers ``UcmDbConnector`` by name with vLLM's connector factory.

vLLM loads this as a general plugin (entry point group
``vllm.general_plugins`` in pyproject.toml) in every process it starts:
the front end, the engine core and the workers.

Why: under vLLM's ``MultiConnector`` the front end rebuilds each child's
stats from the dicts the engine core ships, looking the child up by class
name (``KVConnectorFactory.get_connector_class_by_name``); a connector
known only by ``kv_connector_module_path`` is not found there, and the
stats logger fails (``Connector 'UcmDbConnector' is not registered``).
Registered, ``"kv_connector": "UcmDbConnector"`` also works without
``kv_connector_module_path``.

Invariants:
    * :func:`register` is idempotent and never replaces a connector another
      package registered under the same name.
    * Importing this module imports nothing of vLLM; :func:`register`
      imports only vLLM's factory (the connector class loads lazily).
"""

from __future__ import annotations

NAME = "UcmDbConnector"
MODULE = "ucm_db.connector.connector"


def register() -> None:
    """Registers :data:`NAME` with vLLM's ``KVConnectorFactory`` (once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:
        pass  # already registered (this plugin ran before in this process)
