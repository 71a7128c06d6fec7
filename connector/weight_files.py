"""Which files a model or a LoRA adapter is loaded from: what
:mod:`ucm_db.connector.fingerprints` hashes into its identity.

Invariants:
    * One kind of weights per folder: the first of :data:`WEIGHT_KINDS` the
      folder holds (vLLM's order for load formats ``auto`` and ``hf``: a
      snapshot holding ``.safetensors`` and ``.bin`` loads the former), or
      the first a load format names that the folder holds
      (:data:`FORMAT_KINDS`: ``pt`` loads ``*.pt`` and ``npcache`` ``*.bin``,
      else ``*.pt``, whatever else lies beside them).
      Beside the weights: every ``*.json`` but tokenizer and generation
      files, the index of the loaded kind, ``*.py`` (remote model code) and
      ``*.gguf``.
    * ``npcache`` loads a folder's ``np/`` arrays, never its ``.bin`` files,
      once ``np/weight_names.json`` exists (vLLM's
      ``np_cache_weights_iterator`` converts them once, then trusts the
      arrays): there every file of ``np/`` counts instead of the weights.
    * A model's subfolders, one level down, count like its top level, each
      by its own rule: model classes load weights from them (Cosmos3's
      ``transformer/``, Kimi-Audio's ``whisper-large-v3/``). Not counted:
      hidden folders, exports for other runtimes (:data:`EXPORT_FOLDERS`),
      and ``original/`` while vLLM's default ``ignore_patterns`` skip it (a
      checkpoint's consolidated copy that vLLM never loads).
    * A model's task adapters (:data:`TASK_ADAPTERS`: ``adapters/<task>/``,
      two levels down) count each by the adapter rule below: a model class
      merges one into its weights at load (jina-embeddings-v5, by its
      ``jina_task``), reading it apart from the weight iterator
      (``get_hf_file_bytes``). Every task's, not only the one loaded: a
      change to another moves the namespace (over-keying, below).
    * Weights a model loads from another directory or hub repo that its
      config names (:data:`SUB_MODEL_FIELDS`: vLLM's ``secondary_weights``)
      are that directory's files, by these rules: :mod:`~ucm_db.connector.fingerprints`
      keys them with the model's.
    * An adapter is what vLLM's LoRA loader reads (``lora_model.py``,
      ``peft_helper.py``): ``adapter_config.json`` and the first of
      :data:`ADAPTER_WEIGHTS` that exists, nothing else: not its
      subfolders (a training run's ``checkpoint-N/``), nor other weight
      files beside it (an older PEFT's ``new_embeddings.safetensors``).
    * Over-keying is the safe side: a subfolder vLLM does not load costs its
      hashing once (digests are cached) and a namespace that moves when it
      changes, never a hit on KV of other weights.
"""

from __future__ import annotations

import os
import stat

#: In vLLM's order of preference (module invariants).
WEIGHT_KINDS = ((".safetensors",), (".bin",), (".pt", ".pth"))
#: Load formats that load one kind whatever else a folder holds: the first of theirs it holds (vLLM's allow patterns).
FORMAT_KINDS = {"pt": ((".pt", ".pth"),), "npcache": ((".bin",), (".pt", ".pth"))}
#: Where ``npcache`` keeps a folder's converted arrays, and the file that says they are complete.
NPCACHE_FOLDER = "np"
NPCACHE_NAMES = "weight_names.json"
#: An adapter's config and, in vLLM's order, the weight files it loads the first of.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
#: Config fields naming another model (a local directory or hub id) whose weights vLLM loads with the model's
#: (Ultravox's language model and audio tower; vLLM's ``secondary_weights``, at the repo's ``main``).
SUB_MODEL_FIELDS = ("audio_model_id", "text_model_id")
#: The subfolder whose own subfolders are task adapters a model merges at load (vLLM's ``jina.py``: ``adapters/<task>/``).
TASK_ADAPTERS = "adapters"
#: vLLM's default ``LoadConfig.ignore_patterns`` (a checkpoint's ``original/`` copy).
DEFAULT_IGNORE_PATTERNS = ("original/**/*",)
#: Subfolders of a full hub snapshot that hold the model for other runtimes: vLLM never loads them.
EXPORT_FOLDERS = frozenset({"onnx", "openvino", "metal", "coreml", "mlx", "tflite", "flax"})
#: Training state vLLM skips (its ``filter_files_not_needed_for_inference``).
_TRAINING_FILES = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
#: JSON files that change token ids or sampling, never the KV of given ids.
_IGNORED_JSON = frozenset({"generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "added_tokens.json", "vocab.json", "chat_template.json"})

#: name (relative to the model's folder, ``/``-separated) -> (inode, size, mtime_ns, ctime_ns)
Stats = dict[str, tuple[int, int, int, int]]


def selected_files(path: str | os.PathLike[str], *, load_format: str = "auto", subfolders: bool = False,
                   skipped_folders: frozenset[str] = frozenset(), adapter: bool = False) -> Stats:
    """The files a model (``adapter``: a LoRA adapter) at ``path`` is loaded
    from, with their stats (module invariants); with ``subfolders``, those
    of its subfolders too but ``skipped_folders``. ``path`` may be one file
    (a GGUF)."""
    if os.path.isfile(path):
        st = os.stat(path)
        return {"": (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)}
    if adapter:
        return _adapter_files(os.fspath(path))
    found, folders = _select(os.fspath(path), "", load_format)
    if subfolders:
        for folder in sorted(folders - skipped_folders - EXPORT_FOLDERS):
            selected, inner = _select(os.path.join(path, folder), folder + "/", load_format)
            found.update(selected)
            for task in sorted(inner) if folder == TASK_ADAPTERS else ():
                files = _adapter_files(os.path.join(path, folder, task))
                found.update({f"{folder}/{task}/{name}": st for name, st in files.items()})
    return found


def load_format_of(load_config: object) -> str:
    """vLLM's ``LoadConfig.load_format`` as a string (an enum's value; ``auto`` where none is given)."""
    fmt = getattr(load_config, "load_format", "auto")
    return str(getattr(fmt, "value", fmt))


def skipped_model_folders(ignore_patterns: object) -> frozenset[str]:
    """The subfolders a model's identity leaves out under vLLM's
    ``ignore_patterns`` (None: vLLM's default)."""
    if ignore_patterns is None:
        return frozenset({"original"})
    patterns = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns)  # type: ignore[call-overload]
    return frozenset({"original"}) if DEFAULT_IGNORE_PATTERNS[0] in patterns else frozenset()


def _select(folder: str, prefix: str, load_format: str) -> tuple[Stats, set[str]]:
    """(the files of one folder, named with ``prefix``; its visible subfolders)."""
    with os.scandir(folder) as listing:
        entries = {entry.name: entry for entry in listing if entry.name not in _TRAINING_FILES}
    kinds = FORMAT_KINDS.get(load_format, WEIGHT_KINDS)
    weights = next((kind for kind in kinds if any(name.endswith(kind) for name in entries)), ())
    found: Stats = {}
    folders: set[str] = set()
    arrays = os.path.join(folder, NPCACHE_FOLDER)
    if load_format == "npcache" and os.path.isfile(os.path.join(arrays, NPCACHE_NAMES)):
        weights = ()  # converted: vLLM loads the arrays, never these files again (module invariants)
        found.update(_regular_files(arrays, f"{prefix}{NPCACHE_FOLDER}/"))
        entries.pop(NPCACHE_FOLDER, None)
    for name, entry in entries.items():
        if not _wanted(name, weights):
            if not name.startswith(".") and entry.is_dir():
                folders.add(name)
            continue  # not even stat'ed
        try:
            st = entry.stat()  # follows links: a hub snapshot's files link to blobs
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            found[prefix + name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found, folders


def _regular_files(folder: str, prefix: str) -> Stats:
    """Every regular file of ``folder`` (links followed), named with ``prefix``."""
    found: Stats = {}
    with os.scandir(folder) as listing:
        for entry in listing:
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[prefix + entry.name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found


def _adapter_files(folder: str) -> Stats:
    """An adapter's config and the one weight file vLLM loads (module invariants)."""
    found: Stats = {}
    for names in ((ADAPTER_CONFIG,), ADAPTER_WEIGHTS):
        for name in names:
            try:
                st = os.stat(os.path.join(folder, name))  # vLLM's os.path.isfile: links followed
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISREG(st.st_mode):
                found[name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                break
    return found


def _wanted(name: str, weights: tuple[str, ...]) -> bool:
    if name.endswith(".json"):
        if name.endswith(".index.json"):  # a weight index: that of the loaded kind only
            return bool(weights) and name.removesuffix(".index.json").endswith(weights)
        return name not in _IGNORED_JSON
    return name.endswith(".gguf") or name.endswith(".py") or bool(weights) and name.endswith(weights)
