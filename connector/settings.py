"""Connector settings: ``kv_connector_extra_config`` parsed into one frozen value.

The extra config accepts, by name:

* every :class:`ucm_db.config.StoreConfig` option (``capacity_bytes``,
  ``codec``, ``durability``, ``remote`` ...), validated by the core's own
  parser, so the connector, the CLI and the Python API agree;
* ``path``: the store directory. Default: ``$UCM_DB_PATH`` if set, else
  ``$XDG_CACHE_HOME/ucm-db`` (``~/.cache/ucm-db``);
* ``config_file``: a YAML or JSON file holding any of these keys (keys given
  directly in the extra config win over the file);
* connector options: ``load_mode`` (``"block"``: load every block before the
  forward; ``"layer"``: load in a background thread and let each attention
  layer wait only for its own layer; ``"async"``: a request's hit loads in a
  background thread while the engine runs other requests, and the request
  is scheduled once it is in place), ``model_id`` (explicit model identity
  for the namespace instead of the config+weights fingerprint),
  ``max_pending_save_bytes`` (bound on KV bytes queued for the background
  writer; saves beyond it are dropped and counted, never blocking the
  forward pass); ``publish`` (``"local"`` or ``"remote"``: where a
  ``kv_producer`` publishes), ``publish_codec`` (codec of a producer's
  in-step commit: ``"none"``, the default, keeps compression off the
  step's critical path; ``"zstd"``; ``"store"``: the store's ``codec``)
  and ``load_deadline_s`` (longest a consumer waits for a producer's
  published blocks), see :mod:`ucm_db.connector.roles`;
  ``load_policy`` (``"auto"``: claim a hit only where loading it is expected
  faster than recomputing it; ``"always"``: load every hit, for debugging),
  see :mod:`ucm_db.connector.scheduler.cost_model`; ``remote_lookup`` (``"inline"``:
  the scheduler's lookup fetches a remote hit into the local tier before it
  answers vLLM; ``"background"``: the fetch runs on a connector thread while
  vLLM schedules other requests, and the request is claimed once its blocks
  are local), see :mod:`ucm_db.connector.scheduler.remote_lookups`; admission of
  computed blocks: ``save_decode`` (``true``, the default: every full block
  is stored, generated tokens' too; ``false``: only blocks made wholly of
  prompt tokens) and ``admit_after`` (``N``, default 1: a chain's blocks are
  stored from its Nth sighting, so one-shot prompts are never written;
  ``"auto"``: 2 while under 5% of the blocks computed were seen before, else
  1, :mod:`ucm_db.connector.auto_admission`), see
  :mod:`ucm_db.connector.admission`; ``save_process`` (``true``: the
  background writer hands each round to a child process that opens the same
  store and commits from shared staging memory, so the commit's Python
  never holds the model thread's GIL, see :mod:`ucm_db.committer`; if the
  child cannot start or dies, the writer commits in the worker again and
  logs why; ``false``: the writer commits in the worker process;
  ``"auto"``, the default: ``true`` where a vLLM-CPU worker's model thread is
  bound and the connector named spare cores for its threads
  (:mod:`ucm_db.cpu_placement`), the case it was measured in, else
  ``false``); ``load_threads`` (threads that read a staged load's units
  from the store: ``"auto"``, the default, reads on one thread where the KV
  caches are in host memory or units are under 64 KiB, else on 2 (units
  under 128 KiB) or 4, at most a quarter of the host's CPUs; or ``N``), see
  :mod:`ucm_db.connector.worker.split_reads`.

Invariants:
    * An unknown key anywhere (extra config or file) raises
      :class:`~ucm_db.errors.ConfigError` listing every valid key.
    * Parsing touches no store and no tensor: both the scheduler and the
      worker processes parse the same dict to the same value.
    * Every refusal is one short ConfigError line: a ``path`` or
      ``config_file`` no file system takes (empty, not a string, a NUL
      character, an unknown user's ``~user``) is refused here, and a bad
      value is described by :func:`ucm_db.config.brief_value`, never printed whole.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db.config import StoreConfig, brief_value, redacted_options
from ucm_db import load_config_file
from ucm_db.connector.scheduler.cost_model import check_load_policy
from ucm_db.connector.admission import check_admission
from ucm_db.connector.roles import check_publish_options
from ucm_db.errors import ConfigError

LOAD_MODES = ("block", "layer", "async")
REMOTE_LOOKUPS = ("inline", "background")
#: Environment variable naming the default store path.
PATH_ENV = "UCM_DB_PATH"
_CONNECTOR_KEYS = ("path", "config_file", "load_mode", "model_id", "max_pending_save_bytes", "publish", "publish_codec", "load_deadline_s",
                   "load_policy", "remote_lookup", "save_decode", "admit_after", "save_process", "load_threads",
                   "store_foreign_loads")


def default_store_path() -> Path:
    """The embedded default store path (see the module docstring)."""
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return _path_option(PATH_ENV, explicit, expand=True)  # an unknown user's "~" named, not pathlib's error
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ucm-db"


def valid_keys() -> tuple[str, ...]:
    """Every key the extra config accepts."""
    return _CONNECTOR_KEYS + StoreConfig.field_names()


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector needs from its extra config.

    Attributes:
        path: store directory.
        store_options: options passed to :func:`ucm_db.open` (validated).
        load_mode: ``"block"``, ``"layer"`` or ``"async"``.
        model_id: explicit model identity, or None to fingerprint the model.
        max_pending_save_bytes: bound on bytes waiting for the writer.
        publish: where a ``kv_producer`` publishes (``"local"``, ``"remote"``).
        publish_codec: codec of a ``kv_producer``'s blocks (``"none"``,
            ``"zstd"``, or ``"store"`` for the store's ``codec``).
        load_deadline_s: longest a consumer waits for published blocks.
        load_policy: ``"auto"`` (claim a hit only where loading is expected
            faster than recomputing, see cost_model.py) or ``"always"``.
        remote_lookup: ``"inline"`` or ``"background"`` (remote_lookups.py).
        save_decode: store the blocks completed during decode (holding
            generated tokens) too (admission.py).
        admit_after: store a chain's blocks from its Nth sighting (1: always),
            or ``"auto"`` (2 while little of the engine's work is reused, else 1).
        save_process: commit saves in a child process: True, False, or
            ``"auto"`` (where the model thread is bound and cores are named
            for background work, :mod:`ucm_db.cpu_placement`; module docstring).
        load_threads: threads reading a staged load (an int >= 1, or ``"auto"``).
        store_foreign_loads: save requests that another kind of connector
            loaded under MultiConnector (composition.py; default False).
    """

    path: Path
    store_options: Mapping[str, Any] = field(default_factory=dict)
    load_mode: str = "block"
    model_id: str | None = None
    max_pending_save_bytes: int = 1 << 30
    publish: str = "local"
    publish_codec: str = "none"
    load_deadline_s: float = 5.0
    load_policy: str = "auto"
    remote_lookup: str = "inline"
    save_decode: bool = True
    admit_after: int | str = 1
    save_process: bool | str = "auto"
    load_threads: int | str = "auto"
    store_foreign_loads: bool = False

    def __repr__(self) -> str:
        """The fields, the store options' ``remote_options`` redacted (they may hold credentials)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["store_options"] = redacted_options(self.store_options)
        return f"ConnectorSettings({', '.join(f'{name}={value!r}' for name, value in fields.items())})"

    def __post_init__(self) -> None:
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode must be one of {', '.join(LOAD_MODES)}, got {brief_value(self.load_mode)}", hint="use load_mode='block'")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError("model_id must be a non-empty string", hint="omit it to fingerprint the model's config and weights")
        limit = self.max_pending_save_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1 << 20:
            raise ConfigError(f"max_pending_save_bytes must be an integer >= 1 MiB, got {brief_value(limit)}", hint="use e.g. 1073741824")
        StoreConfig.from_dict(self.store_options)
        check_publish_options(self.publish, self.load_deadline_s, self.publish_codec)
        check_load_policy(self.load_policy)
        if self.remote_lookup not in REMOTE_LOOKUPS:
            raise ConfigError(
                f"remote_lookup must be one of {', '.join(REMOTE_LOOKUPS)}, got {brief_value(self.remote_lookup)}",
                hint="use remote_lookup='inline' (fetch while the scheduler waits) or 'background'",
            )
        check_admission(self.save_decode, self.admit_after)
        if not isinstance(self.store_foreign_loads, bool):
            raise ConfigError(f"store_foreign_loads must be true or false, got {brief_value(self.store_foreign_loads)}",
                              hint="use store_foreign_loads=true only where the other connector checks the model's files")
        if not isinstance(self.save_process, bool) and self.save_process != "auto":
            raise ConfigError(f"save_process must be true, false or \"auto\", got {brief_value(self.save_process)}",
                              hint="use save_process=true to commit saves in a child process")
        threads = self.load_threads
        if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64):
            raise ConfigError(f"load_threads must be \"auto\" or an integer from 1 to 64, got {brief_value(threads)}",
                              hint="use load_threads=\"auto\" (one thread on a CPU host, up to 4 beside an accelerator)")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parses ``kv_connector_extra_config`` (see the module docstring)."""
        given = dict(extra or {})
        _reject_unknown(given, "kv_connector_extra_config")
        merged: dict[str, Any] = {}
        config_file = given.pop("config_file", None)
        if config_file is not None:
            config_file = _path_option("config_file", config_file, expand=False)
            from_file = load_config_file(config_file)
            if "config_file" in from_file:
                raise ConfigError(f"{config_file}: config_file may not name another config file", hint="merge the files")
            _reject_unknown(from_file, str(config_file))
            merged.update(from_file)
        merged.update(given)
        store_options = {k: v for k, v in merged.items() if k not in _CONNECTOR_KEYS}
        path = merged.get("path")
        kwargs: dict[str, Any] = {k: merged[k] for k in _CONNECTOR_KEYS if k in merged and k not in ("path", "config_file")}
        return cls(
            path=_path_option("path", path, expand=True) if path is not None else default_store_path(),
            store_options=store_options, **kwargs,
        )


def _path_option(name: str, value: Any, *, expand: bool) -> Path:
    """The path option ``name`` as a Path (``~``, ``~user`` expanded if
    ``expand``): a ConfigError now for what no file system takes (empty, a
    NUL character, an unknown user's ``~``), never a raw ValueError or
    RuntimeError from ``pathlib`` at start-up."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError(f"{name} must be a non-empty path without NUL characters, got {brief_value(value)}",
                          hint=f"pass {name}='/var/cache/ucm-db'" if name in ("path", PATH_ENV) else "name a YAML or JSON file")
    try:
        return Path(text).expanduser() if expand else Path(text)
    except RuntimeError as exc:  # "~user" of no user this host knows
        raise ConfigError(f"{name} {brief_value(text)} starts with the home of an unknown user", hint="write the path out in full") from exc


def _reject_unknown(options: Mapping[str, Any], where: str) -> None:
    unknown = sorted(key[:40] if isinstance(key, str) else brief_value(key) for key in set(options) - set(valid_keys()))
    if unknown:
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise ConfigError(
            f"unknown ucm-db connector option(s) in {where}: {', '.join(unknown[:10])}{more}",
            hint=f"valid keys are: {', '.join(valid_keys())}",
        )
