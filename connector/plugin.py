"""Registers ``UcmDbConnector`` by name with vLLM's connector factory, and
watches vLLM's weight loads (:mod:`ucm_db.connector.weight_loads`).

vLLM loads this as a general plugin (entry point group
``vllm.general_plugins`` in pyproject.toml) in every process it starts:
the front end, the engine core and the workers, each before it loads a
model (``worker_base.init_worker``, ``EngineCore.__init__``,
``EngineArgs``).

Why register: under vLLM's ``MultiConnector`` the front end rebuilds each child's
stats from the dicts the engine core ships, looking the child up by class
name (``KVConnectorFactory.get_connector_class_by_name``); a connector
known only by ``kv_connector_module_path`` is not found there, and the
stats logger fails (``Connector 'UcmDbConnector' is not registered``).
Registered, ``"kv_connector": "UcmDbConnector"`` also works without
``kv_connector_module_path``.

Why watch: vLLM makes the connector after it loaded the weights, so only
code that runs before the load can tell the files ucm-db hashes from the
files vLLM read (a checkpoint written in place meanwhile). The same for LoRA
adapters, which vLLM's worker reads after the scheduler keyed their requests
(:mod:`ucm_db.connector.lora_loads`).

Invariants:
    * :func:`register` is idempotent and never replaces a connector another
      package registered under the same name.
    * Importing this module imports nothing of vLLM; :func:`register`
      imports vLLM's factory and its model loaders (the connector class
      loads lazily).
    * Watching never fails a process: where vLLM's loaders cannot be
      wrapped, the connector warns when it starts (weight_loads.py).
"""

from __future__ import annotations

NAME = "UcmDbConnector"
MODULE = "ucm_db.connector.connector"


def register() -> None:
    """Registers :data:`NAME` with vLLM's ``KVConnectorFactory`` (once), and
    wraps vLLM's model loaders to snapshot the weight files before each load."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:
        pass  # already registered (this plugin ran before in this process)
    try:
        from ucm_db.connector.weight_loads import watch

        watch()
    except Exception:  # noqa: BLE001 - another vLLM's loaders: the start warns instead (weight_loads.py)
        pass
    try:
        from ucm_db.connector import lora_loads

        lora_loads.watch()  # what adapter files vLLM's worker reads (a LoRA request's saves are checked against it)
    except Exception:  # noqa: BLE001 - another vLLM: LoRA requests' saves are then dropped (lora_loads.py)
        pass
