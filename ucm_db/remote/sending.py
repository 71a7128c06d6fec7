"""One block's upload: what every upload of the uploader (its batches, a
write-through put's, an ancestor's re-upload: :mod:`ucm_db.remote.uploader`,
:mod:`ucm_db.remote.ancestry`) runs on the upload pool, in the remote codec
in force (:mod:`ucm_db.remote.codec_choice`).

Invariants:
    * A failure is returned as its text (the block's row stays queued),
      never raised.
    * A damaged block is never sent: a blob read for a batch was verified
      (:func:`ucm_db.remote.upload_plan.read_items`), and one the remote
      codec cannot re-encode (:class:`CorruptBlockError`) is quarantined
      locally (its queue row goes with it) and its upload fails.
    * The keys whose upload runs now are known (:attr:`ObjectSender.sending`):
      a store's close logs the uploads it abandons.
    * ``info/remote_codec`` (:data:`REMOTE_CODEC_RECORD`, what ``ucm-db
      inspect`` shows) follows the codec in force (:meth:`ObjectSender.record_choice`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

from ucm_db import codec
from ucm_db.errors import CorruptBlockError
from ucm_db.index.local import LocalTier
from ucm_db.remote.codec_choice import RemoteCodec
from ucm_db.remote.tier import RemoteRoot, RemoteTier
from ucm_db.remote.upload_plan import Item, quarantine

#: ``info`` record of the remote codec in force, for ``ucm-db inspect``.
REMOTE_CODEC_RECORD = b"remote_codec"


class ObjectSender:
    """Uploads single blocks of ``local`` to ``remote`` (module invariants).

    Args:
        local: the local tier (namespace descriptions, the codec record).
        remote: where objects go.
        remote_codec: the codec uploads are re-encoded in; None: as stored.
    """

    def __init__(self, local: LocalTier, remote: RemoteRoot, remote_codec: RemoteCodec | None) -> None:
        self.local, self.remote, self.codec = local, remote, remote_codec
        self._recorded_codec: str | None = None
        self._element_bytes: dict[bytes, int] = {}
        self._sending: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def sending(self) -> int:
        """Block uploads running now."""
        with self._lock:
            return len(self._sending)

    def send(self, item: Item, tier: RemoteTier | None = None) -> str | None:
        """Uploads ``item`` through ``tier`` (default: a plain tier of its
        namespace); its error's text, None on success."""
        key, parent, namespace_id, _depth, blob = item
        try:
            sent = self._encode(key, namespace_id, blob)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the row queued
            return f"{type(exc).__name__}: {exc}"
        sent_bytes = 0
        if self.codec is not None:
            self.codec.send_started()
        with self._lock:
            self._sending.add(key)
        try:
            (tier or self.remote.tier(namespace_id)).store(key, parent, sent)
            sent_bytes = len(sent)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the row queued
            return f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._sending.discard(key)
            if self.codec is not None:
                self.codec.send_finished(sent_bytes)
        return None

    def _encode(self, key: bytes, namespace_id: bytes, blob: bytes) -> bytes:
        """The object to upload: ``blob`` in the remote codec (module invariants)."""
        if self.codec is None:
            return blob
        element_bytes = self._element_bytes.get(namespace_id)
        if element_bytes is None:
            kv_dtype = self.local.namespace_descriptions().get(namespace_id, {}).get("kv_dtype", "")
            element_bytes = self._element_bytes.setdefault(namespace_id, codec.element_bytes_for(str(kv_dtype)))
        try:
            return self.codec.encode(blob, key, element_bytes)[0]
        except CorruptBlockError as exc:
            quarantine(self.local, key, f"its re-encode for the remote failed: {exc}")
            raise

    def record_choice(self) -> None:
        """Keeps ``info/remote_codec`` up to date when the codec in force changes."""
        if self.codec is None:
            return
        choice = self.codec.choice()
        if choice.codec == self._recorded_codec:
            return
        record = {**asdict(choice), "time_ns": time.time_ns()}
        self.local.info_put(REMOTE_CODEC_RECORD, json.dumps(record, sort_keys=True).encode())
        self._recorded_codec = choice.codec
