"""The files vLLM loads a model's weights from: watched from before the load
until ucm-db keys them, and, for load formats that do not read the model's
fingerprinted files, keyed by content or refused (:func:`weights_elsewhere`).

vLLM 0.32 makes the KV connector after it loaded the weights: a worker's in
``initialize_from_config`` (after ``load_model`` and memory profiling), the
scheduler's once the KV cache is sized. So ucm-db hashes the files after
vLLM read them, and a checkpoint written in place in between (a trainer
saving while the server restarts: minutes for a large model) would name the
namespace while the engine computes with the old weights. What runs before
the load in every vLLM process is ucm-db's general plugin
(:mod:`ucm_db.connector.plugin`: ``worker_base.init_worker``,
``EngineCore.__init__``, ``EngineArgs``); it calls :func:`watch`, which
wraps ``load_model`` of vLLM's model loaders so that every load first
records the stat of the files ucm-db keys it by (:func:`watched_files`).
:func:`refuse_changed_since_load`, called where the files are hashed,
refuses a start where any differs.

Invariants:
    * The wrapper never fails or slows a load beyond a few ``stat`` calls:
      a snapshot that cannot be taken is not taken.
    * A file is unchanged since the snapshot while its ``(inode, size,
      mtime_ns, ctime_ns)`` hold: every write moves ``ctime``, which no user
      call sets back (as ``fingerprints.py`` trusts its cache). The digest
      is taken after the snapshot and checked against the files' stat
      before and after (``fingerprints._hash_changed``), so an equal stat at
      the check means the digest names the bytes vLLM loaded.
    * A check compares every snapshot taken since the last check (a model
      loaded twice, as an MTP draft loads the target's directory again,
      must have read the same files both times) and then forgets them: an
      engine started again in the same process is checked against its own
      load.
    * A file the load added is no change: vLLM downloads a hub model's
      weights inside ``load_model`` (its snapshot held only the configs
      before), and a checkpoint rewritten in place changes files that were
      there (the weights, their index, the config). Under ``npcache`` the
      load that converts a folder's ``*.bin`` files writes ``np/``, which
      ucm-db keys from then on: a ``*.bin`` file left out of the new
      selection is no change either (the arrays are what vLLM loaded,
      written from the bytes it read).
    * Snapshots belong to one engine (its ``VllmConfig``): a load by
      another engine of the process (one without ucm-db, one whose start
      failed before its check) drops the snapshots of the roots it loads.
    * In a process that loaded nothing (the scheduler's engine core beside
      workers) there is nothing to compare: its namespace is checked
      against the workers' (the namespace handshake).
    * The config vLLM parsed before any load is :mod:`ucm_db.connector.config_parses`'
      to watch; :func:`refuse_changed_since_read` checks both.
    * Without the connector's ``model_id``, weights read from outside the
      model's files are keyed by their content (a local tensorizer file, a
      local ``model_weights`` directory) or the start is refused: a remote
      URI, another process or server (:data:`NAMED_ONLY_FORMATS`), a loader
      ucm-db does not know. Another checkpoint serialized or uploaded under
      the same name never keeps a namespace.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from ucm_db.connector.config_files import QUANTIZATION_FILE
from ucm_db.connector.config_parses import refuse_changed_since_parse, watch_parses
from ucm_db.connector.weight_files import SUB_MODEL_FIELDS, Stats, load_format_of, selected_files, skipped_model_folders
from ucm_db.errors import ConfigError

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
#: Load formats that read the weights from the model's path (``model_weights`` where set): the fingerprinted
#: files where it is the model's local directory (a remote one fails to fingerprint).
MODEL_PATH_FORMATS = frozenset({"sharded_state", "runai_streamer", "runai_streamer_sharded"})
#: Load formats whose weights come from another process or server: keyed only by the connector's ``model_id``.
NAMED_ONLY_FORMATS = frozenset({"modelexpress", "ipc_cache"})
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SHARD_TEMPLATE = re.compile(r"%0\dd")
_WRAPPED = "__ucm_db_watched__"
_lock = threading.Lock()
#: Watched root (absolute) -> (id of the load's VllmConfig, its stats) at each load of one engine since the last check.
_snapshots: dict[str, list[tuple[int, Stats]]] = {}
_watching = False  # whether vLLM's loaders are wrapped in this process
_warned = False


def watch() -> None:
    """Wraps ``load_model`` of vLLM's model loaders, and ``ModelConfig``'s
    parse (:func:`~ucm_db.connector.config_parses.watch_parses`), once a
    process (idempotent)."""
    global _watching
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, BaseModelLoader

    for cls in {BaseModelLoader, *_LOAD_FORMAT_TO_MODEL_LOADER.values()}:
        original = cls.__dict__.get("load_model")
        if original is not None and not getattr(original, _WRAPPED, False):
            setattr(cls, "load_model", _watched(original))
    watch_parses()  # the configs vLLM parses, before it loads anything
    _watching = True


def _watched(load_model: Any) -> Any:
    @functools.wraps(load_model)
    def load_model_watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        note_load(vllm_config, model_config, getattr(self, "load_config", None))
        return load_model(self, *args, **kwargs)

    setattr(load_model_watched, _WRAPPED, True)
    return load_model_watched


def note_load(vllm_config: Any, model_config: Any, load_config: Any) -> None:
    """Records the stat of the files a load of ``model_config`` reads (never raises)."""
    try:
        found = watched_files(model_config, load_config, _tp_size(vllm_config))
    except Exception:  # noqa: BLE001 - the load goes on; the check then finds nothing to compare
        return
    engine = id(vllm_config)
    with _lock:
        for root, stats in found.items():
            taken = _snapshots.setdefault(root, [])
            if taken and taken[-1][0] != engine:  # another engine's load, never checked (no ucm-db, a failed start)
                taken.clear()
            taken.append((engine, stats))


def refuse_changed_since_load(vllm_config: Any, model_config: Any, load_config: Any) -> None:
    """Raises ConfigError where a file ucm-db keys ``model_config``'s weights
    by (under ``load_config``) changed since vLLM began loading it (module
    invariants)."""
    global _warned
    if not _watching and not _warned:
        _warned = True
        logger.warning("ucm-db: its vLLM plugin did not run in this process (VLLM_PLUGINS?), so weight files "
                       "rewritten while vLLM loaded them are not noticed: restart the engine after writing a checkpoint "
                       "in place")
    with _lock:
        if not _snapshots:
            return
    now = watched_files(model_config, load_config, _tp_size(vllm_config))
    with _lock:
        taken = {root: _snapshots.pop(root) for root in now if root in _snapshots}
    # npcache: the load that converts a folder writes np/ and ucm-db keys it instead of the *.bin files it read
    # (weight_files.py): files are compared where both snapshots hold them; the arrays vLLM wrote are what it loaded.
    converting = load_format_of(load_config) == "npcache"
    for root, snapshots in taken.items():
        changed = sorted({name for _, before in snapshots for name in before
                          if before[name] != now[root].get(name) and not (converting and name not in now[root])})
        if changed:
            raise ConfigError(
                f"the weights in {root} changed after vLLM began loading them ({', '.join(changed[:5]) or root}"
                f"{' ...' if len(changed) > 5 else ''}): the engine computes with the files as they were, and ucm-db "
                "would key its KV by the new ones",
                hint="restart the engine once the checkpoint is completely written (or write checkpoints to a new "
                     "directory and point the server at it)",
            )


def refuse_changed_since_read(vllm_config: Any, model_id: str | None, draft_load: Any = None) -> None:
    """Refuses a start where files its namespace keys changed since vLLM
    read them: the model's config since its parse (``config_parses.py``;
    under ``model_id`` only where ``hf_config_path`` is keyed) and its files
    since their load (without ``model_id``), and where ``draft_load`` (the
    load config of a draft keyed by its files) is given, the draft's alike.
    Called after every digest of them."""
    model_config = vllm_config.model_config
    if model_id is None or getattr(model_config, "hf_config_path", None):
        refuse_changed_since_parse(model_config)
    if model_id is None:
        refuse_changed_since_load(vllm_config, model_config, getattr(vllm_config, "load_config", None))
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    if draft_load is not None and draft is not None:
        refuse_changed_since_parse(draft, "speculative draft")
        refuse_changed_since_load(vllm_config, draft, draft_load)


def weights_elsewhere(vllm_config: Any, fmt: str, model_config: Any = None, load_config: Any = None,
                      parallel_config: Any = None, draft: bool = False) -> dict[str, Any]:
    """Without ``model_id``: the content of weights load format ``fmt``
    reads from outside the model's fingerprinted files, or a ConfigError
    where ucm-db cannot read them. Re-serializing or uploading other
    weights under the same name must never keep a namespace. The configs
    default to ``vllm_config``'s (a speculative draft passes its own, with
    ``draft``: no ``model_id`` names a draft, so the hint names local files)."""
    from ucm_db.connector.fingerprints import CONTENT_PREFIX, fingerprint

    model_config = model_config if model_config is not None else vllm_config.model_config
    load_config = load_config if load_config is not None else vllm_config.load_config
    parallel_config = parallel_config if parallel_config is not None else vllm_config.parallel_config
    if fmt == "dummy":
        raise ConfigError(
            "vLLM runs with load_format \"dummy\" (random weights): their KV must never be served to an engine with "
            "the real weights, and the model's files, which ucm-db keys by, do not name them",
            hint="serve without ucm-db, or set \"model_id\" in kv_connector_extra_config to a name of this run's weights "
                 "(e.g. \"dummy-profiling\"): ucm-db then keys by that name",
        )
    if fmt in MODEL_PATH_FORMATS:
        weights = str(getattr(model_config, "model_weights", "") or "")
        if not weights or weights == str(model_config.model):
            return {}  # the model's own files, fingerprinted
        if not is_remote(weights) and Path(weights).expanduser().is_dir():
            return {"model_weights_files": CONTENT_PREFIX + fingerprint(Path(weights).expanduser(), load_format=fmt,
                                                                         subfolders=True).digest}
        where = f"model_weights {weights!r}"
    elif fmt == "tensorizer":
        files = tensorizer_files(load_config, int(parallel_config.tensor_parallel_size))
        if files and all(not is_remote(f) and os.path.isfile(f) for f in files):
            return {"tensorizer_files": [CONTENT_PREFIX + fingerprint(f).digest for f in files]}
        where = f"tensorizer files {files or '(none named)'}"
    else:  # another process or server (NAMED_ONLY_FORMATS), or a loader ucm-db does not know
        where = f"load format {fmt!r}"
    raise ConfigError(
        f"vLLM loads {'the speculative draft' if draft else 'the weights'} from {where}, which ucm-db cannot read to "
        "key them: other weights served under the same name later would be served this engine's KV",
        hint="load the draft from local files (e.g. speculative_config draft_load_config {\"load_format\": \"auto\"}), or "
             "serve it without ucm-db" if draft else
             "set \"model_id\" in kv_connector_extra_config to an identity that changes whenever those weights do, "
             "or load the weights from local files",
    )


def watched_files(model_config: Any, load_config: Any, tp_size: int = 1) -> dict[str, Stats]:
    """The files ucm-db keys a load by, per root (a directory, or one file):
    the model's directory (a hub model's snapshot) and those of the
    sub-models its config names, selected as ``fingerprints.model_fingerprint``
    selects them, and a local ``model_weights`` directory that
    :func:`weights_elsewhere` keys, and a ``quantization_config_file`` that ``hf_overrides`` names
    (``config_files.quantization_file_inputs``); for ``tensorizer`` the local serialized files. A root that
    cannot be found (a hub model not downloaded yet) is left out."""
    fmt = load_format_of(load_config)
    if fmt == "tensorizer":
        return {file: selected_files(file) for file in tensorizer_files(load_config, tp_size) if os.path.isfile(file)}
    options: dict[str, Any] = {"load_format": fmt, "subfolders": True,
                               "skipped_folders": skipped_model_folders(getattr(load_config, "ignore_patterns", None))}
    download_dir = getattr(load_config, "download_dir", None)
    hf_config = getattr(model_config, "hf_config", None)
    sources = [(str(model_config.model), getattr(model_config, "revision", None))]
    sources += [(value, None) for field in SUB_MODEL_FIELDS
                if isinstance(value := getattr(hf_config, field, None), str) and value]
    weights = str(getattr(model_config, "model_weights", "") or "")
    if fmt in MODEL_PATH_FORMATS and weights and not is_remote(weights):  # weights_elsewhere keys it by its files
        sources.append((weights, None))
    overrides = getattr(model_config, "hf_overrides", None)  # a quantization config file read at load (config_files.py)
    if isinstance(overrides, dict) and isinstance(overrides.get(QUANTIZATION_FILE), str):
        sources.append((overrides[QUANTIZATION_FILE], None))
    out = {}
    for model, revision in sources:
        root = _root(model, revision, download_dir)
        if root is not None:
            out[root] = selected_files(root, **options)
    return out


def _tp_size(vllm_config: Any) -> int:
    try:
        return int(vllm_config.parallel_config.tensor_parallel_size)
    except (AttributeError, TypeError, ValueError):
        return 1


def _root(model: str, revision: str | None, download_dir: str | None) -> str | None:
    path = Path(model).expanduser()
    if path.exists():
        return os.path.abspath(path)
    from ucm_db.connector.fingerprints import hub_snapshot

    found = hub_snapshot(model, revision, download_dir)
    return os.path.abspath(found[1]) if found is not None else None


def tensorizer_files(load_config: Any, tp_size: int = 1) -> list[str]:
    """The serialized files vLLM's ``tensorizer`` loader reads, as given
    (``TensorizerConfig``: ``tensorizer_uri``, else ``tensorizer_dir``'s
    ``model.tensors``; a ``%0Nd`` template is one file per TP rank); empty
    where none is named. A local path is expanded; a URI (``s3://``,
    ``https://``) is kept as it is: :func:`is_remote`."""
    extra = getattr(load_config, "model_loader_extra_config", None)
    if isinstance(extra, dict):
        given = extra.get("tensorizer_config")
        nested: dict[str, Any] = given if isinstance(given, dict) else {}
        uri = nested.get("tensorizer_uri") or extra.get("tensorizer_uri")
        folder = nested.get("tensorizer_dir") or extra.get("tensorizer_dir")
    else:
        uri, folder = getattr(extra, "tensorizer_uri", None), getattr(extra, "tensorizer_dir", None)
    if not uri and folder:
        uri = f"{folder}/model.tensors"
    if not uri:
        return []
    uris = [str(uri) % rank for rank in range(tp_size)] if _SHARD_TEMPLATE.search(str(uri)) else [str(uri)]
    return [u if is_remote(u) else os.path.abspath(os.path.expanduser(u)) for u in uris]


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names no local file (``scheme://...``)."""
    return bool(_REMOTE.match(uri))
