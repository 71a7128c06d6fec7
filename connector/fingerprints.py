"""Fingerprints: content digests of the files a model or a LoRA adapter is
loaded from, computed once and reused while those files are unchanged
(issue 48).

Owns the model's identity in the namespace (:func:`model_fingerprint`) and a
LoRA adapter's in the keys (:func:`adapter_key`): which files name a model
or adapter (:mod:`ucm_db.connector.weight_files`), the digest over them
(:func:`fingerprint`), its caches (in this process; for checkpoints
of :data:`PERSIST_MIN_BYTES` or more also in a private file:
:mod:`ucm_db.connector.fingerprint_cache`), and finding the snapshot of a
hub model in the local Hugging Face cache (:func:`hub_snapshot`).

Invariants:
    * A digest depends only on the selected files' names (relative to their
      directory) and contents: never on the directory's path, inode numbers
      or times. A copied or moved model keeps its digest, and so does the
      same adapter under another name or path (content-addressed).
    * A cached digest is reused only while the set of selected files and
      each one's ``(inode, size, mtime_ns, ctime_ns)`` (of the file a link
      points to: a hub snapshot links to blobs) are what they were when it
      was hashed. Every write moves ``ctime``, which no user call can set
      back, so a checkpoint retrained and saved in place is always rehashed;
      only the files whose stat changed are. Where timestamps are coarse (one
      timer tick before Linux 6.13, a second or two on some file systems) a
      write in the tick of the hash could leave the stat as it was: a file
      changed within :data:`RACY_WINDOW_NS` of its hash is hashed again at
      the next start (git's "racy clean" rule).
    * Files are hashed whole with BLAKE3 (cryptographic: a crafted file
      cannot take another model's namespace). On the development VM a warm
      file hashed at 3.4 GB/s (one thread, mmap); blake2b managed 0.57 GB/s,
      xxh3_128 2.3 GB/s but is not collision resistant.
    * The processes of one engine starting together (scheduler, workers)
      hash a checkpoint once: the cache file is read, the files hashed and
      the result written under one ``flock``.
    * A model is every directory vLLM loads its weights from: its own, and
      each other model its config names (Ultravox's ``text_model_id`` and
      ``audio_model_id``: :data:`~ucm_db.connector.weight_files.SUB_MODEL_FIELDS`),
      each resolved as vLLM resolves it (a hub id at ``main``) and keyed by
      content; one that cannot be resolved stops the start. A model naming
      none keeps its directory's digest alone, as before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3  # a dependency of vLLM, the only user of this module

from ucm_db.connector.fingerprint_cache import cache_file, cache_path  # noqa: F401 - cache_path: where it lives
from ucm_db.connector.weight_files import (SUB_MODEL_FIELDS, Stats, load_format_of, selected_files,
                                           skipped_model_folders)
from ucm_db.errors import ConfigError

#: Smaller sets hash in well under the 0.2 s start budget: kept in memory only.
PERSIST_MIN_BYTES = 64 << 20
#: A file changed this recently when hashed keeps a digest that is never reused (module invariants).
RACY_WINDOW_NS = 2_000_000_000
_COMMIT = re.compile(r"[0-9a-f]{40}")
_DIGEST = re.compile(r"[0-9a-f]{64}")

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it
_warned: set[tuple[str, ...]] = set()
_adapters: dict[tuple[str, str], str] = {}  # (name, path) -> the digest vLLM loaded from there (first seen)
_adapter_ids: dict[int, str] = {}  # lora_int_id -> the digest vLLM loaded under it (first seen)
_resettled: set[tuple[str, str]] = set()  # (name, path) of adapters vLLM reloaded with other files (adapter_resettled)
_named: dict[str, str] = {}  # adapter name -> the digest first keyed under it, any path (adapter_resettled)
_renamed: set[str] = set()  # names keyed with other files since, any path

@dataclass(frozen=True)
class Fingerprint:
    """A content digest and what computing it took."""

    digest: str         # 64 hex characters
    files: int
    has_weights: bool   # False: only configs and code (weights elsewhere, or none)
    total_bytes: int
    hashed_bytes: int   # 0 when every file's digest came from a cache
    seconds: float


#: absolute path -> (entries, as in the cache file; their combined digest)
_memo: dict[str, tuple[dict[str, list[Any]], str]] = {}
_memo_lock = threading.Lock()


def fingerprint(path: str | Path, *, load_format: str = "auto", subfolders: bool = False,
                skipped_folders: frozenset[str] = frozenset(), adapter: bool = False) -> Fingerprint:
    """The digest of :func:`~ucm_db.connector.weight_files.selected_files`
    of ``path`` (see invariants; the keywords are that function's)."""
    began = time.perf_counter()
    key = os.path.abspath(path)
    stats = selected_files(key, load_format=load_format, subfolders=subfolders, skipped_folders=skipped_folders,
                           adapter=adapter)
    total = sum(st[1] for st in stats.values())
    with _memo_lock:
        known, digest = _memo.get(key, ({}, ""))
    hashed = 0
    if not _covers(known, stats):
        if total >= PERSIST_MIN_BYTES:
            with cache_file() as cache:
                known, hashed = _hash_changed(Path(key), stats, cache.get(key, {}))
                cache[key] = known
        else:
            known, hashed = _hash_changed(Path(key), stats, known)
        digest = _combine(known)
        with _memo_lock:
            _memo[key] = (known, digest)
    weights = any(not name.endswith((".json", ".py")) for name in stats)
    return Fingerprint(digest, len(stats), weights, total, hashed, time.perf_counter() - began)


def _covers(entries: dict[str, list[Any]], stats: Stats) -> bool:
    return entries.keys() == stats.keys() and all(_reusable(entries[n], st) for n, st in stats.items())


def _hash_changed(root: Path, stats: Stats, known: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], int]:
    """Entries ``name -> [ino, size, mtime_ns, ctime_ns, hex digest]``: each
    file whose stat matches ``known`` keeps its digest, the others are hashed."""
    entries: dict[str, list[Any]] = {}
    hashed = 0
    for name, st in sorted(stats.items()):
        old = known.get(name)
        if old is not None and _reusable(old, st):
            entries[name] = list(old)
            continue
        file = root / name if name else root
        digest = _file_digest(file, st[1])
        after = file.stat()
        if (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) != st:
            # Written while hashed: the digest names no version of it.
            raise ConfigError(f"{file} changed while ucm-db hashed it", hint="start the engine again once the files are written")
        # Racy (git's word): written within RACY_WINDOW_NS of the hash, a later
        # write in the same timestamp tick (coarse on kernels before 6.13) would
        # leave the stat as it is: such a digest is used now, never reused.
        racy = time.time_ns() - max(st[2], st[3]) < RACY_WINDOW_NS
        entries[name] = [*st, digest, "racy"] if racy else [*st, digest]
        hashed += st[1]
    return entries, hashed


def _reusable(entry: Any, st: tuple[int, int, int, int]) -> bool:
    """Whether a cached entry (maybe from a damaged file) holds a digest of
    the file with stat ``st``."""
    return (isinstance(entry, list) and len(entry) == 5 and tuple(entry[:4]) == st and isinstance(entry[4], str)
            and _DIGEST.fullmatch(entry[4]) is not None)


def _file_digest(file: Path, size: int) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if size == 0:
        return str(hasher.hexdigest())
    try:
        hasher.update_mmap(str(file))  # no copy out of the page cache
    except OSError:  # a file system that cannot map it
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        buffer = bytearray(16 << 20)
        view = memoryview(buffer)
        with file.open("rb", buffering=0) as handle:
            while n := handle.readinto(buffer):
                hasher.update(view[:n])
    return str(hasher.hexdigest())


def _combine(entries: dict[str, list[Any]]) -> str:
    hasher = blake3.blake3(b"ucm-db/files/1\0")
    for name in sorted(entries):
        entry = entries[name]  # [ino, size, mtime, ctime, digest], "racy" after it for a digest never reused
        hasher.update(name.encode() + b"\0" + int(entry[1]).to_bytes(8, "little") + bytes.fromhex(entry[4]))
    return str(hasher.hexdigest())


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None = None) -> tuple[str, Path] | None:
    """(commit, snapshot directory) of ``repo_id`` at ``revision`` (a branch,
    tag or commit; None: ``main``) in the hub cache (``cache_dir``: vLLM's
    ``download_dir``), or None where it holds no such snapshot."""
    repo = (Path(cache_dir).expanduser() if cache_dir else hf_hub_cache()) / ("models--" + repo_id.replace("/", "--"))
    wanted = revision or "main"
    commit = wanted if _COMMIT.fullmatch(wanted) else None
    if commit is None:
        try:
            commit = (repo / "refs" / wanted).read_text().strip()
        except OSError:
            return None
    snapshot = repo / "snapshots" / commit
    return (commit, snapshot) if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


def model_fingerprint(model_config: Any, download_dir: str | None = None, load_config: Any = None) -> str:
    """Model identity: ``blake3:`` and the digest of the files vLLM loads the
    model from (:func:`fingerprint`, subfolders included, as vLLM's
    ``load_config`` selects them: its load format and ignore patterns): of a
    local directory (or GGUF file) as given, or of a hub model's snapshot in
    the local Hugging Face cache (``download_dir``, else the load config's, if
    vLLM was given one) at the commit its revision resolves to: never a branch
    name, never the path. Where the config names sub-models
    (:data:`~ucm_db.connector.weight_files.SUB_MODEL_FIELDS`), their files
    are keyed with the model's (module invariants)."""
    download_dir = download_dir or getattr(load_config, "download_dir", None)
    options: dict[str, Any] = {"load_format": load_format_of(load_config), "subfolders": True,
                               "skipped_folders": skipped_model_folders(getattr(load_config, "ignore_patterns", None))}
    model = str(model_config.model)
    path, loaded = _source(model, getattr(model_config, "revision", None), download_dir, options, f"model {model!r}")
    hf_config = getattr(model_config, "hf_config", None)
    named = {field: value for field in SUB_MODEL_FIELDS
             if isinstance(value := getattr(hf_config, field, None), str) and value}
    # vLLM loads a sub-model at its repo's main (secondary_weights' revision None), whatever the model's revision.
    subs = {field: _source(value, None, download_dir, options, f"sub-model {value!r} (config.{field})")[1]
            for field, value in named.items()}
    digest = loaded.digest
    if subs:
        hasher = blake3.blake3(b"ucm-db/sub-models/1\0" + bytes.fromhex(loaded.digest))
        for field in sorted(subs):
            hasher.update(field.encode() + b"\0" + bytes.fromhex(subs[field].digest))
        digest = str(hasher.hexdigest())
    if not loaded.has_weights and not any(sub.has_weights for sub in subs.values()):
        _warn_once(("weights", str(path)),
                   "ucm-db: %s holds no weight files (*.safetensors, *.bin, *.pt, *.gguf): the model is keyed by its "
                   "config files only; set \"model_id\" in kv_connector_extra_config if its weights live elsewhere", path)
    parts = [loaded, *subs.values()]
    logger.info("ucm-db: model %s is blake3:%s (%d files, %.1f GB; %.1f GB hashed in %.2f s%s)", model, digest[:16],
                sum(p.files for p in parts), sum(p.total_bytes for p in parts) / 1e9,
                sum(p.hashed_bytes for p in parts) / 1e9, sum(p.seconds for p in parts),
                "".join(f"; {field} {named[field]}" for field in sorted(subs)))
    return CONTENT_PREFIX + digest


def _source(model: str, revision: str | None, download_dir: str | None, options: dict[str, Any],
            what: str) -> tuple[Path, Fingerprint]:
    """(the directory or file vLLM loads ``model`` from, its :func:`fingerprint`
    under ``options``); ``what`` names it in errors."""
    path = Path(model).expanduser()
    if not path.exists():
        if uses_modelscope():  # vLLM downloads from ModelScope, not the Hugging Face cache this would read
            raise ConfigError(
                f"ucm-db cannot key {what} by its files: VLLM_USE_MODELSCOPE is on, so vLLM loads a ModelScope "
                "snapshot, which ucm-db does not resolve (the Hugging Face cache may hold other files under that id)",
                hint="serve the model (or the speculative draft) from its local directory (ModelScope's snapshot path), "
                     "or set \"model_id\" in kv_connector_extra_config to an identity that changes whenever the weights do",
            )
        found = hub_snapshot(model, revision, download_dir)
        if found is None:
            raise ConfigError(
                f"ucm-db cannot find the files of {what} at revision {revision or 'main'}: no local path, and "
                "no snapshot in the Hugging Face cache; blocks are keyed by the loaded files' content",
                hint="serve the model from a local directory, or set \"model_id\" in kv_connector_extra_config to an "
                     "identity that changes whenever the weights do",
            )
        path = found[1]
    try:
        return path, fingerprint(path, **options)
    except OSError as exc:
        raise ConfigError(f"ucm-db cannot read the model files in {path}: {exc}",
                          hint="check the model directory's permissions, or set \"model_id\" in kv_connector_extra_config") from exc


#: An adapter key no other request shares (:func:`adapter_key`): its requests are neither saved nor loaded.
UNSETTLED_PREFIX = "unsettled:"
#: What names files by content: a digest of :func:`fingerprint` follows.
CONTENT_PREFIX = "blake3:"
#: Ends the key of an adapter vLLM reads in the fused 3D MoE layout (``LoRARequest.is_3d_lora_weight``).
LAYOUT_3D_SUFFIX = "+3d"


def lora_int_id(lora_request: Any) -> int:
    """The id vLLM loads ``lora_request``'s adapter under (0 where it names none)."""
    return int(getattr(lora_request, "lora_int_id", 0) or 0)


def adapter_layout(lora_request: Any) -> str:
    """How vLLM reads the adapter's files: :data:`LAYOUT_3D_SUFFIX` where the
    request declares the fused 3D MoE layout (with
    ``enable_mixed_moe_lora_format`` vLLM splits such weights otherwise than
    2D ones, so the same files compute other KV), else ``""``."""
    return LAYOUT_3D_SUFFIX if getattr(lora_request, "is_3d_lora_weight", False) else ""


def adapter_key(lora_request: Any) -> str:
    """A LoRA adapter's identity: the digest of its directory's files
    (:func:`fingerprint`: computed once, reused while their stats hold), so the
    same files under another name or path share blocks, and an adapter
    retrained and saved at the same path and name does not. Name and path
    are labels, keyed only where the path is no readable local directory: a
    hub id (warned once), unless the hub is offline (``HF_HUB_OFFLINE``):
    vLLM then loads the cached snapshot at ``main``, and its files key it.
    Online, vLLM's worker downloads ``main`` when it first loads the adapter,
    after the scheduler keyed the request: the cached snapshot may be the
    old one, so it keys nothing.

    vLLM computes with the adapter it loaded first under a ``lora_int_id``
    (unless the request asks ``load_inplace``): where the files at the same
    name and path, or under the same id, have changed since this process
    first keyed them, the key is ``unsettled:`` and random (nothing is
    served to or from it) until the engine restarts, loads in place, or
    loads the name and path under a new id (vLLM's reload after an update).
    The worker checks its saves against what vLLM read (lora_loads.py):
    files changed between this keying and vLLM's load store nothing."""
    name, where = str(lora_request.lora_name), str(lora_request.lora_path)
    path = os.path.expanduser(where)
    if not os.path.isdir(path) and not os.path.isabs(path) and _hub_offline():
        found = hub_snapshot(where, None)  # a hub id vLLM cannot download: it loads the cached snapshot at main
        path = str(found[1]) if found is not None else path
    if os.path.isdir(path):
        try:
            digest = fingerprint(path, adapter=True).digest
            int_id = lora_int_id(lora_request)
            # vLLM loads these files: in place, or under an id it has not loaded (its reload after an update),
            # when it first runs the id's request (files changed before that are not seen: docstring).
            if _named.setdefault(name, digest) != digest:
                _renamed.add(name)  # vLLM's encoder cache keys a tower adapter by name alone: adapter_resettled
            if getattr(lora_request, "load_inplace", False) or int_id not in _adapter_ids:
                if _adapters.get((name, where), digest) != digest:
                    _resettled.add((name, where))  # vLLM's own prefix cache may hold the old files' KV: adapter_resettled
                _adapters[(name, where)] = _adapter_ids[int_id] = digest
            first = (_adapters.setdefault((name, where), digest), _adapter_ids.setdefault(int_id, digest))
            if first != (digest, digest):
                _warn_once(("lora changed", name, where, digest),
                           "ucm-db: LoRA adapter %r (id %d) at %r is not the adapter this engine first loaded under that "
                           "name, path or id: vLLM may still compute with the old one, so its requests are neither saved "
                           "nor loaded until a restart; save a retrained adapter to a new directory under a new id, or "
                           "send it with load_inplace=True", name, int_id, where)
                return UNSETTLED_PREFIX + os.urandom(16).hex()
            return CONTENT_PREFIX + digest + adapter_layout(lora_request)
        except ConfigError:  # written while hashed: a key no other request has, so no stale KV is served
            return UNSETTLED_PREFIX + os.urandom(16).hex()
        except OSError:
            pass  # an unreadable directory: keyed by its labels below
    _warn_once(("lora", name, where),
               "ucm-db: LoRA adapter %r has no readable local directory at %r (a hub id?): its blocks are keyed by its "
               "name and path, not its files, so an adapter updated under both would be served the old one's KV; give "
               "vLLM the adapter's local directory (or set HF_HUB_OFFLINE=1 once it is cached) to key it by content", name, where)
    return "unhashed:" + json.dumps([name, where]) + adapter_layout(lora_request)


def adapter_resettled(lora_request: Any, *, multimodal: bool = False) -> bool:
    """Whether this process keyed ``lora_request``'s name and path with
    other files before (:func:`adapter_key`: vLLM reloaded an updated
    adapter in place or under a new id); with ``multimodal``, its name with
    other files under any path. vLLM's own prefix cache hashes an adapter
    by name and path, its encoder cache a tower adapter by name alone, not
    by their files, so they may still hold what the old files computed: a
    request of such an adapter must not save KV computed over a hit from
    them."""
    if lora_request is None:
        return False
    name = str(lora_request.lora_name)
    return (name, str(lora_request.lora_path)) in _resettled or (multimodal and name in _renamed)


def _hub_offline() -> bool:
    """Whether huggingface_hub may not download (vLLM loads what is cached)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") and not uses_modelscope()


def uses_modelscope() -> bool:
    """Whether vLLM loads hub ids from ModelScope (``VLLM_USE_MODELSCOPE``, read as vLLM reads it)."""
    return os.environ.get("VLLM_USE_MODELSCOPE", "False").strip().lower() in ("1", "true")


def _warn_once(what: tuple[str, ...], message: str, *args: Any) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message, *args)
