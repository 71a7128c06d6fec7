"""Remote code that a config names from elsewhere, keyed by its content.

Under ``trust_remote_code`` a config's ``auto_map`` names classes that
transformers runs instead of its own: the config class builds the config
vLLM reads (so the RoPE, the layer shapes, the KV), and a model class runs
where vLLM serves through the Transformers backend. Most of that code is
keyed elsewhere: every ``*.py`` of the model's own directory or snapshot is
a fingerprinted file (:mod:`ucm_db.connector.fingerprints`), and the
modules beside an ``hf_config_path`` are keyed with it
(:func:`ucm_db.connector.identity_guards.config_digest`). What is keyed
here (:func:`remote_code_inputs`) comes from another revision or repo:

* a class in another repo (``org/repo--module.Class``), which transformers
  fetches from that repo at ``code_revision`` (``main`` when none is given);
* a hub model's own classes when ``code_revision`` names another revision
  than the weights': transformers fetches them at ``code_revision``.

Either is named by a branch or tag at best, whose code moves on while the
name stays: two engines could run other code under one name. So each is
keyed by the content of the modules the config names and of those they
import relatively (:func:`~ucm_db.connector.identity_guards.module_files`),
as the Hugging Face cache holds them, where transformers reads them (or a
local directory of that name).

Invariants:
    * Without ``trust_remote_code``, or without such a reference (to a
      config or model class: :data:`~ucm_db.connector.identity_guards.KV_AUTO_MAP_PREFIXES`),
      nothing is added: those namespaces are what they were.
    * A digest depends on the modules' names and contents only: not on
      where the cache is, nor on other files a snapshot gains later.
    * A reference none of whose modules is in the cache is keyed as
      unresolved, by the repo and revision it names (logged once with the
      fix: a ``code_revision`` that is a commit names immutable code): vLLM
      may never run it (a model class under vLLM's own implementation is
      never fetched), and once it is fetched the namespace moves to its content.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ucm_db.connector.identity_guards import auto_map_references, files_digest, hub_cached_files, module_finder, module_files

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_warned: set[tuple[str, str]] = set()
_COMMIT = re.compile(r"[0-9a-f]{40}")


def remote_code_inputs(model_config: Any) -> dict[str, Any]:
    """``{"remote_code": {"repo@revision": digest}}`` for the code of the
    module docstring's two cases, or ``{}``."""
    if not getattr(model_config, "trust_remote_code", False):
        return {}
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    code_revision = getattr(model_config, "code_revision", None)
    hf_config_path = getattr(model_config, "hf_config_path", None)
    # The config vLLM read: hf_config_path's where given (its own modules are keyed with it), else the model's.
    source = str(hf_config_path) if hf_config_path else model
    source_revision = (getattr(model_config, "_hf_config_revision", None) or revision) if hf_config_path else revision
    wanted: dict[tuple[str, str | None], set[str]] = defaultdict(set)
    for repo, module in auto_map_references(_config_files(source, source_revision)):
        if repo is not None:
            wanted[(repo, code_revision)].add(module)
        elif code_revision not in (None, revision) and not Path(model).expanduser().exists():
            wanted[(model, code_revision)].add(module)  # vLLM's model registry fetches own classes from the model
    return {"remote_code": {f"{repo}@{rev or 'main'}": _code_digest(repo, rev, sorted(modules))
                            for (repo, rev), modules in sorted(wanted.items(), key=str)}} if wanted else {}


def _config_files(source: str, revision: str | None) -> list[Path]:
    """The config.json of a local directory, a local JSON file, or a hub id at ``revision`` in the cache."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path] if path.suffix == ".json" else []  # a GGUF model is one file: no config.json to read
    if path.is_dir():
        return [path / "config.json"]
    return hub_cached_files(source, ["config.json"], revision)


def _code_digest(repo: str, revision: str | None, modules: list[str]) -> str:
    found = module_files(modules, module_finder(repo, revision))
    if found:
        return files_digest(found, b"ucm-db/code")
    if (repo, str(revision)) not in _warned:
        _warned.add((repo, str(revision)))
        logger.warning(
            "ucm-db: the config names code %s in %s (revision %s), which is not in the Hugging Face cache: it is keyed "
            "by that name, not its content%s", ", ".join(modules), repo, revision or "main",
            "" if revision and _COMMIT.fullmatch(revision) else
            "; if vLLM runs it, pin code_revision to a commit so that name stays that code")
    return "unresolved"
