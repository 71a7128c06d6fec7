"""Which adapter files vLLM's worker computes a LoRA id with: seen as it loads them.

The scheduler keys a LoRA request's chain by its adapter's content
(:func:`ucm_db.connector.fingerprints.adapter_key`) when it first looks the
request up; vLLM's worker reads the adapter's files later, when it first
runs the id (``WorkerLoRAManager._load_adapter``), and again after its LRU
of adapters evicted it. Files rewritten in between, two adapters sent under
one id, or an adapter evicted, reloaded changed and then rolled back: the
KV was computed with other files than the key names, and stored under it, a
replica with the named files would be served it (a review:
``tests/connector/test_review_lora_key_race.py``).

So the plugin wraps vLLM's adapter load in every process (:func:`watch`),
and each load records, per ``lora_int_id``, the content key of the files it
read (``blake3:`` and the digest :func:`adapter_key` makes of the same
files, then the layout vLLM read them in: ``+3d`` for a request's
``is_3d_lora_weight``, which the loaded adapter keeps for its id), or none
where they changed while read or hashed. The worker saves a
LoRA request's blocks only where the id's recorded key is the one its chain
names (:func:`computed_with`): otherwise the save is dropped, counted in
``save_errors`` and logged.

Invariants:
    * A record is made after vLLM's load returned, from a hash of the files
      whose stat did not move from before the load to after the hash: the
      digest names the bytes vLLM read, or the record is empty (no save
      matches it until the id is loaded again).
    * Only content keys (``blake3:``) are checked: an adapter keyed by its
      labels (a hub id vLLM downloads itself: ``unhashed:``) is saved as
      before (adapter_key warns about it); ``unsettled:`` keys never save.
    * A worker that never saw the id load (vLLM's loader not wrapped: another
      vLLM) saves none of its blocks: a lost save, never a wrong one.
    * Per process: each tensor-parallel rank checks what it loaded itself.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from ucm_db.connector.fingerprints import CONTENT_PREFIX, adapter_layout, fingerprint, lora_int_id
from ucm_db.connector.weight_files import selected_files

_WRAPPED = "__ucm_db_lora_watched__"
_LOG_INTERVAL_S = 60.0
_loaded: dict[int, str] = {}  # lora_int_id -> the content key of the files vLLM read last ("" unknown)
_logged_s: dict[int, float] = {}  # lora_int_id -> when a refused save of it was last logged
_lock = threading.Lock()
logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def watch() -> None:
    """Wraps vLLM's ``WorkerLoRAManager._load_adapter`` (once a process)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager.__dict__.get("_load_adapter")
    if original is not None and not getattr(original, _WRAPPED, False):
        setattr(WorkerLoRAManager, "_load_adapter", _watched(original))


def _watched(load_adapter: Any) -> Any:
    @functools.wraps(load_adapter)
    def load_adapter_watched(self: Any, lora_request: Any) -> Any:
        path = _local_path(lora_request)
        before = _stats(path)
        model = load_adapter(self, lora_request)
        note_load(lora_int_id(lora_request), path, before, adapter_layout(lora_request))
        return model

    setattr(load_adapter_watched, _WRAPPED, True)
    return load_adapter_watched


def note_load(lora_int_id: int, path: str | None, before: dict[str, Any] | None, layout: str = "") -> None:
    """Records what a load of ``lora_int_id`` from ``path`` read, and how
    (``layout``: :func:`~ucm_db.connector.fingerprints.adapter_layout`);
    never raises."""
    key = ""
    try:
        if path is not None and before is not None:
            digest = fingerprint(path, adapter=True).digest
            if _stats(path) == before:
                key = CONTENT_PREFIX + digest + layout
    except Exception:  # noqa: BLE001 - changed while hashed, unreadable: nothing matches the record
        key = ""
    with _lock:
        _loaded[lora_int_id] = key


def computed_with(lora_int_id: int, key: str) -> bool:
    """Whether this process's last load of ``lora_int_id`` read the files
    ``key`` names (module invariants: only content keys are checked)."""
    if not key.startswith(CONTENT_PREFIX):
        return True
    with _lock:
        loaded = _loaded.get(lora_int_id)
        if loaded == key:
            return True
        now = time.monotonic()
        due = now - _logged_s.get(lora_int_id, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S
        if due:
            _logged_s[lora_int_id] = now
    if due:
        logger.warning("ucm-db: LoRA id %d: vLLM computes with adapter files (%s) other than the ones its request was "
                       "keyed by (%s): its blocks are not saved (counted in save_errors; logged at most once a minute "
                       "per id). Save a changed adapter to a new directory under a new id", lora_int_id,
                       loaded or "not seen loading", key)
    return False


def _local_path(lora_request: Any) -> str | None:
    try:
        from vllm.lora.utils import get_adapter_absolute_path

        return str(get_adapter_absolute_path(str(lora_request.lora_path)))
    except Exception:  # noqa: BLE001 - vLLM's load reports it
        return None


def _stats(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        return dict(selected_files(path, adapter=True))
    except OSError:
        return None
