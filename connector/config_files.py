"""The config files vLLM parses a model's config from, and the code they
name: what a config is keyed by where ucm-db keys it by its files (a
``hf_config_path``: :func:`config_digest`; the config vLLM parsed:
:mod:`ucm_db.connector.config_parses`; remote code:
:mod:`ucm_db.connector.remote_code`).

Invariants:
    * A config is its files, not the config object: model constructors may
      change the object in a worker after vLLM built it, and every role
      must derive one namespace.
    * Code that a config's ``auto_map`` names for its config and model
      classes (:data:`KV_AUTO_MAP_PREFIXES`: run under ``trust_remote_code``)
      counts with it, with the modules that code imports relatively (as
      transformers fetches them); tokenizer and processor classes do not
      (they change text, never KV of ids).
    * A quantization config vLLM reads from a file ``hf_overrides`` names
      (:data:`QUANTIZATION_FILE`) is keyed by its content
      (:func:`quantization_file_inputs`): the path, keyed with
      ``hf_overrides``, names no content. vLLM reads it while it loads the
      weights, so the load's snapshot covers it (``weight_loads.py``).
    * A hub id is read from the local Hugging Face cache only: nothing here
      downloads.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError

#: The files a config directory holds for vLLM's config parsers (HF, Mistral).
CONFIG_FILES = ("config.json", "params.json")
#: The ``hf_overrides`` key naming a file vLLM reads a quantization config from (``get_quant_config``: torchao's
#: ``from_config_file``, when it loads the weights).
QUANTIZATION_FILE = "quantization_config_file"


def config_files_digest(config_path: str, revision: str | None = None, code_revision: str | None = None) -> str | None:
    """The digest of the config files vLLM reads from ``config_path`` (a
    directory, a file, or a hub id at ``revision`` already in the local hub
    cache) and of the code their ``auto_map`` names (a hub config's at
    ``code_revision`` where one is given: transformers fetches it there);
    None where ``config_path`` names no readable config file."""
    path = Path(config_path).expanduser()
    files = [path] if path.is_file() else [path / name for name in CONFIG_FILES if (path / name).is_file()]
    hub = not files and not path.exists()
    if hub:
        files = hub_cached_files(config_path, CONFIG_FILES, revision)
    if not files:
        return None
    modules = sorted({module for repo, module in auto_map_references(files) if repo is None})
    where = config_path if hub else str(path if path.is_dir() else path.parent)
    code = module_files(modules, module_finder(where, code_revision or revision))
    # A module named but not found is named in config.json, which is keyed.
    return files_digest([(file.name, file) for file in files] + code, b"ucm-db/hfcfg")


def config_digest(config_path: str, hf_config: Any, revision: str | None = None, code_revision: str | None = None) -> str:
    """:func:`config_files_digest`; where ``config_path`` names no readable
    file, the JSON of ``hf_config`` (the object vLLM built) without the
    fields that name where and by which library it was read."""
    digest = config_files_digest(config_path, revision, code_revision)
    if digest is not None:
        return digest
    plain = {k: v for k, v in hf_config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    text = json.dumps(plain, sort_keys=True, default=str)
    return "json-blake2b:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def quantization_file_inputs(model_config: Any) -> dict[str, Any]:
    """The content of the quantization config file ``hf_overrides`` names
    (module invariants), where it names one; a ConfigError where it cannot
    be read (vLLM read it before the connector started: it was moved since)."""
    overrides = getattr(model_config, "hf_overrides", None)
    given = overrides.get(QUANTIZATION_FILE) if isinstance(overrides, dict) else None
    if not given:
        return {}
    try:
        return {QUANTIZATION_FILE: files_digest([(QUANTIZATION_FILE, Path(str(given)).expanduser())], b"ucm-db/quantcfg")}
    except OSError as exc:
        raise ConfigError(f"ucm-db cannot read the quantization config file {given!r} (hf_overrides): {exc}",
                          hint="restart the engine once the file is in place") from exc


#: ``auto_map`` entries whose classes can change the KV: the config class
#: builds the config vLLM reads, a model class runs where vLLM serves it
#: through the Transformers backend (the prefixes vLLM's model registry
#: resolves); tokenizer and processor classes change text, never KV of ids.
KV_AUTO_MAP_PREFIXES = ("AutoConfig", "AutoModel")


def auto_map_references(config_files: list[Path]) -> list[tuple[str | None, str]]:
    """(repo, module) of each config or model class a config's ``auto_map``
    names (:data:`KV_AUTO_MAP_PREFIXES`): repo None for a module beside the
    config, else the repo of ``repo--module.Class``
    (:mod:`ucm_db.connector.remote_code`). A module may lie in a subfolder
    (``sub/modeling``). Files that are not a JSON object name none."""
    found: list[tuple[str | None, str]] = []
    for file in config_files:
        try:
            auto_map = json.loads(file.read_text()).get("auto_map") or {}
        except (ValueError, AttributeError, OSError):  # absent, not JSON, or not an object: no code named
            continue
        for kind, ref in auto_map.items() if isinstance(auto_map, dict) else ():
            if not str(kind).startswith(KV_AUTO_MAP_PREFIXES):
                continue
            for one in ref if isinstance(ref, list) else [ref]:
                if isinstance(one, str) and "." in one:
                    repo, _, name = one.rpartition("--")
                    found.append((repo or None, name.rsplit(".", 1)[0]))
    return found


_RELATIVE_IMPORT = re.compile(r"^\s*(?:import\s+\.(\S+)\s*$|from\s+\.(\S+)\s+import)", re.MULTILINE)


def module_files(modules: Sequence[str], find: Callable[[str], Path | None]) -> list[tuple[str, Path]]:
    """(module, file) of ``modules`` and of the modules they import
    relatively, transitively (each once, sorted by module; an import is
    looked for beside the module that makes it, as transformers does: ``sub/a``
    importing ``.b`` names ``sub/b``); ``find`` gives a module's file, None
    where there is none (or it cannot be read)."""
    found: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in found or (file := find(module)) is None:
            continue
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:  # a dangling link (an interrupted download): transformers cannot run it either
            continue
        found[module] = file
        folder = module.rpartition("/")[0]
        todo.extend(f"{folder}/{a or b}" if folder else a or b for a, b in _RELATIVE_IMPORT.findall(text))
    return [(m, found[m]) for m in sorted(found)]


def module_finder(source: str, revision: str | None) -> Callable[[str], Path | None]:
    """``find`` for :func:`module_files`: a module's file in a local
    directory ``source``, else in hub id ``source``'s snapshot at
    ``revision`` in the local hub cache."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return lambda module: folder / f"{module}.py" if (folder / f"{module}.py").is_file() else None
    return lambda module: next(iter(hub_cached_files(source, [f"{module}.py"], revision)), None)


def files_digest(files: Sequence[tuple[str, Path]], person: bytes) -> str:
    """``blake2b:`` and the digest of named files' contents (the names as given)."""
    digest = hashlib.blake2b(digest_size=16, person=person)
    for name, file in files:
        digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return "blake2b:" + digest.hexdigest()


def hub_cached_files(repo_id: str, names: Sequence[str], revision: str | None) -> list[Path]:
    """The files ``names`` of a hub id at ``revision`` (None: main) in the
    local hub cache, where transformers reads configs and code (none where
    not cached, a dangling link, or huggingface_hub is absent)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return []
    found = []
    for name in names:
        try:
            cached = try_to_load_from_cache(repo_id, name, revision=revision)
        except Exception:  # noqa: BLE001 - a string that is no repo id: not cached
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            found.append(Path(cached))
    return found
