"""Remote code that a config names from elsewhere, keyed by its content.

Under ``trust_remote_code`` a config's ``auto_map`` names classes that
transformers runs instead of its own: the config class builds the config
vLLM reads (so the RoPE, the layer shapes, the KV), and a model class runs
where vLLM serves through the Transformers backend. Most of that code is
keyed elsewhere: every ``*.py`` of the model's own directory is a
fingerprinted file (:mod:`ucm_db.connector.fingerprints`), and the modules
beside an ``hf_config_path`` are keyed with it
(:func:`ucm_db.connector.identity_guards.config_digest`). What is keyed
here (:func:`remote_code_inputs`) comes from another revision or repo:

* a class in another repo (``org/repo--module.Class``), which transformers
  fetches from that repo at ``code_revision`` (``main`` when none is given);
* a hub model's own modules when ``code_revision`` names another revision
  than the weights': transformers fetches them at ``code_revision``.

Either is named by a branch or tag at best, whose code moves on while the
name stays: two engines could run other code under one name. So each is
keyed by the digest of every ``*.py`` of the directory it loads from
(relative imports included): the repo's snapshot in the Hugging Face cache
(vLLM's ``download_dir`` first), or a local directory of that name.

Invariants:
    * Without ``trust_remote_code``, or without such a reference, nothing
      is added: those namespaces are what they were.
    * A digest depends on the files' names and contents only, never on
      where the cache is.
    * A reference whose code is not found where transformers would read it
      is keyed by the repo and revision it names (logged once, with the fix:
      ``model_id``): vLLM may never run it (a model class under vLLM's own
      implementation is never fetched).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from ucm_db.connector.fingerprints import hub_snapshot
from ucm_db.connector.identity_guards import auto_map_references

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_warned: set[str] = set()


def remote_code_inputs(model_config: Any, download_dir: str | None) -> dict[str, Any]:
    """``{"remote_code": {"repo@revision": digest}}`` for the code of the
    module docstring's two cases, or ``{}``."""
    if not getattr(model_config, "trust_remote_code", False):
        return {}
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    code_revision = getattr(model_config, "code_revision", None)
    wanted: set[tuple[str, str | None]] = set()
    for repo in _referenced_repos(_config_files(model, revision, download_dir)):
        if repo is not None:
            wanted.add((repo, code_revision))
        elif code_revision not in (None, revision) and not Path(model).expanduser().exists():
            wanted.add((model, code_revision))
    hf_config_path = getattr(model_config, "hf_config_path", None)
    if hf_config_path:  # its own modules are keyed with it (identity_guards.config_digest)
        wanted.update((repo, code_revision) for repo in _referenced_repos(_config_files(str(hf_config_path), revision, download_dir))
                      if repo is not None)
    return {"remote_code": {f"{repo}@{rev or 'main'}": _code_digest(repo, rev, download_dir)
                            for repo, rev in sorted(wanted, key=str)}} if wanted else {}


def _config_files(source: str, revision: str | None, download_dir: str | None) -> list[Path]:
    """The config.json of a local directory, a local file itself, or a hub id's snapshot at ``revision``."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path] if path.suffix == ".json" else []  # a GGUF model is one file: no config.json to read
    folder = path if path.exists() else _snapshot(source, revision, download_dir)
    return [folder / "config.json"] if folder is not None and folder.is_dir() else []


def _snapshot(repo: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The hub cache's snapshot of ``repo`` at ``revision``: vLLM's ``download_dir`` first, then the default cache."""
    found = (hub_snapshot(repo, revision, download_dir) if download_dir else None) or hub_snapshot(repo, revision)
    return found[1] if found else None


def _referenced_repos(config_files: list[Path]) -> list[str | None]:
    """The repo of every ``auto_map`` class (None: the config's own)."""
    return [repo for repo, _module in auto_map_references(config_files)]


def _code_digest(repo: str, revision: str | None, download_dir: str | None) -> str:
    local = Path(repo).expanduser()
    folder = local if local.is_dir() else _snapshot(repo, revision, download_dir)
    if folder is None:
        if repo not in _warned:
            _warned.add(repo)
            logger.warning("ucm-db: the config names code in %s (revision %s), which is not in the Hugging Face cache: "
                           "it is keyed by that name, not its content; set \"model_id\" in kv_connector_extra_config "
                           "to an identity that changes with that code", repo, revision or "main")
        return "unresolved"
    digest = hashlib.blake2b(digest_size=16, person=b"ucm-db/code")
    for file in sorted(folder.glob("*.py")):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return "blake2b:" + digest.hexdigest()
