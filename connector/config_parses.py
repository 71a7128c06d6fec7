"""The config vLLM parsed is the config ucm-db keys: a model's config files
rewritten after vLLM parsed them stop the start.

vLLM parses a model's config once, in the front end, when it builds its
``ModelConfig`` (``get_config``: ``config.json``, Mistral's ``params.json``,
a ``hf_config_path``, a GGUF file's header, and the configuration code an
``auto_map`` names), and hands that object to the engine core and the
workers. ucm-db keys the model by its files' content (``config.json`` among
them: hidden size, activation, norms, attention and MoE layout are keyed
nowhere else) when the connector starts, after vLLM loaded the weights.
A checkpoint written in place between the two (a trainer saving while the
server starts) would name the namespace by the new config while the engine
computes with the old one, and an engine started later on the new files
would share that namespace with other KV. The load's snapshot
(:mod:`ucm_db.connector.weight_loads`) covers the files from the load on;
this module covers the parse.

Invariants:
    * ucm-db's plugin wraps ``ModelConfig.__post_init__`` (:func:`watch_parses`,
      from ``weight_loads.watch``) in every vLLM process: each parse records,
      on the ``ModelConfig`` itself (:data:`PARSED_ATTRIBUTE`, a private
      attribute as vLLM's own ``_hf_config_revision``), the source it read
      and the digest of its config files. It travels wherever vLLM pickles
      the config (engine core, workers); a speculative draft's config is
      recorded by its own parse.
    * A local config is recorded before vLLM reads it: a rewrite between
      the record and the read shows as a change (the safe side). A hub
      config after the parse, at the commit vLLM resolved (a snapshot's
      files never change; the local cache's ``main`` may be older).
    * By content (``config_files.config_files_digest``), not stat: a
      checkpoint saved again with the same config (``save_pretrained``
      rewrites ``config.json`` alike) is no change. A single-file model
      (GGUF: config and weights in one) by its stat (hashing it whole would
      slow every parse; the load's snapshot takes over at the load).
    * Recording never fails a parse; nothing recorded (the plugin did not
      run, no config file found), nothing compared.
    * The check (:func:`refuse_changed_since_parse`) reads the files the
      parse read (the recorded source), and runs where the connector keys
      them: ``weight_loads.refuse_changed_since_read``, the start's check of
      every file a namespace keys, since its parse and since its load.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from ucm_db.connector.config_files import config_files_digest
from ucm_db.errors import ConfigError

#: Where a parse's record lives on vLLM's ``ModelConfig``: ``(source, digest)``.
PARSED_ATTRIBUTE = "_ucm_db_parsed_config"
_WRAPPED = "__ucm_db_watched__"


def watch_parses() -> None:
    """Wraps ``ModelConfig.__post_init__`` (once a process; idempotent; never raises)."""
    try:
        from vllm.config import ModelConfig
    except Exception:  # noqa: BLE001 - another vLLM: nothing recorded, nothing compared
        return
    original = ModelConfig.__dict__.get("__post_init__")
    if original is not None and not getattr(original, _WRAPPED, False):
        setattr(ModelConfig, "__post_init__", _watched(original))


def _watched(post_init: Any) -> Any:
    @functools.wraps(post_init)
    def post_init_watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        source = _source(self)
        local = source is not None and os.path.exists(os.path.expanduser(source))
        before = parsed_digest(self) if local else None
        result = post_init(self, *args, **kwargs)
        after = _source(self)
        record = (source, before) if before is not None and after == source else (after, parsed_digest(self))
        if record[1] is not None:
            try:
                setattr(self, PARSED_ATTRIBUTE, record)
            except Exception:  # noqa: BLE001 - a config that takes no attribute: nothing compared
                pass
        return result

    setattr(post_init_watched, _WRAPPED, True)
    return post_init_watched


def _source(model_config: Any) -> str | None:
    """Where vLLM reads ``model_config``'s config from (``hf_config_path``, else the model)."""
    source = getattr(model_config, "hf_config_path", None) or getattr(model_config, "model", None)
    return str(source) if source else None


def parsed_digest(model_config: Any, source: str | None = None) -> str | None:
    """The digest of the config files ``model_config`` is parsed from
    (``source``: where else it was; module invariants), None where there
    are none; never raises."""
    try:
        source = source or _source(model_config)
        if source is None:
            return None
        path = Path(source).expanduser()
        if path.is_file() and path.suffix != ".json":
            st = path.stat()
            return f"stat:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        revision = getattr(model_config, "_hf_config_revision", None) or getattr(model_config, "revision", None)
        return config_files_digest(source, revision, getattr(model_config, "code_revision", None))
    except Exception:  # noqa: BLE001 - unreadable now: compared as a change where a record exists
        return None


def refuse_changed_since_parse(model_config: Any, what: str = "model") -> None:
    """Raises ConfigError where the config files ``model_config`` was parsed
    from differ from those vLLM read (module invariants)."""
    recorded = getattr(model_config, PARSED_ATTRIBUTE, None)
    if not isinstance(recorded, tuple) or len(recorded) != 2:
        return
    source, digest = recorded
    if parsed_digest(model_config, source) != digest:
        raise ConfigError(
            f"the config of the {what} in {source} changed after vLLM parsed it: the engine computes with the config "
            "as it was, and ucm-db would key its KV by the files as they are now",
            hint="restart the engine once the checkpoint is completely written (or write checkpoints to a new "
                 "directory and point the server at it)",
        )
