"""Which codec the remote tier's objects use: fixed, or chosen from
measured speeds (``remote_codec="auto"``).

The local tier's codec (``codec``) is what puts write locally; the uploader
re-encodes a block for the remote when ``remote_codec`` differs
(:func:`ucm_db.codec.transcode`). Read-through promotes remote objects into
the local tier as they are: a block's head names its codec, so a local tier
may hold both.

``auto`` compresses when the link, not the CPU, limits the upload. With
``C`` the measured zstd speed of the upload threads together (raw bytes/s;
one thread's speed times the threads that can run at once, at most the
cores),
``L`` the measured link speed (bytes on the wire/s) and ``r`` the measured
compression ratio, uploading raw moves ``L`` raw bytes/s and uploading
compressed ``min(C, r * L)``; zstd is chosen when that is at least
``AUTO_MARGIN`` times ``L``.

Invariants:
    * The choice never changes what a reader gets: every object carries its
      own codec in its sealed header.
    * Until both speeds are measured, ``auto`` compresses (a remote is
      assumed slower than the CPU until shown otherwise), and every
      ``PROBE_EVERY``-th upload uses the other codec so both estimates stay
      current.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from ucm_db import codec

#: zstd must promise this much more raw throughput than none to be chosen.
AUTO_MARGIN = 1.05
#: One upload in this many measures the codec not chosen.
PROBE_EVERY = 16
#: Shortest busy time of the link that one link-speed measurement spans.
LINK_WINDOW_S = 0.05
#: Longest busy stretch measured as one window while uploads keep overlapping.
LINK_BUSY_WINDOW_S = 1.0
#: Weight of a new measurement in the moving averages.
_EWMA = 0.2


@dataclass(frozen=True, slots=True)
class CodecChoice:
    """The remote codec in force and why (for stats and ``ucm-db inspect``)."""

    codec: str
    setting: str
    compress_bytes_per_s: float | None
    link_bytes_per_s: float | None
    ratio: float | None


class RemoteCodec:
    """Picks and applies the remote codec for one store's uploads; safe
    for the uploader's threads."""

    def __init__(self, setting: str, *, local_codec: str, level: int, threads: int) -> None:
        self.setting = setting
        self._fixed = local_codec if setting == "same" else setting
        self._level = level
        self._threads = max(1, threads)
        self._lock = threading.Lock()
        self._compress_bps: float | None = None
        self._link_bps: float | None = None
        self._ratio: float | None = None
        self._uploads = 0
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._window_bytes = 0
        #: Compressions that really run at once: the upload threads, up to the cores.
        self._parallel = max(1, min(self._threads, os.cpu_count() or 1))

    def next_codec(self) -> str:
        """The codec for the next upload."""
        if self._fixed != "auto":
            return self._fixed
        with self._lock:
            self._uploads += 1
            chosen = self._auto_choice()
            if self._uploads % PROBE_EVERY == 0:
                return "none" if chosen == "zstd" else "zstd"
            return chosen

    def encode(self, blob: bytes, key: bytes, element_bytes: int) -> tuple[bytes, str]:
        """``blob`` in the codec for its upload, and that codec; measures
        the compression speed and ratio on the way."""
        wanted = self.next_codec()
        started = time.perf_counter()
        out = codec.transcode(blob, key, codec=wanted, element_bytes=element_bytes, level=self._level)
        if wanted == "zstd" and codec.codec_of_head(blob) != "zstd":
            elapsed = time.perf_counter() - started
            raw = codec.read_header(blob).raw_len
            if elapsed > 0 and len(out):
                self._observe(compress_bps=raw / elapsed, ratio=raw / len(out))
        return bytes(out), wanted

    def send_started(self) -> None:
        """An upload began sending (pair with :meth:`send_finished`)."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def send_finished(self, sent_bytes: int) -> None:
        """An upload of ``sent_bytes`` finished (or failed: pass 0).

        The link speed is the bytes sent over the time at least one upload
        was in flight, measured over windows of at least :data:`LINK_WINDOW_S`: right
        whatever number of uploads share the link, unlike a per-upload speed
        scaled by the thread count (which overstates a link that one upload
        at a time already fills); see :data:`LINK_BUSY_WINDOW_S`."""
        with self._lock:
            now = time.perf_counter()
            self._busy_s += now - self._busy_since  # the link was busy since the last start or finish
            self._busy_since = now
            self._in_flight -= 1
            self._window_bytes += sent_bytes
            # Measure when the link goes idle (every byte of the window has
            # arrived), or after a long busy stretch (bytes still in flight
            # then are a small part of the window).
            idle = self._in_flight == 0 and self._busy_s >= LINK_WINDOW_S
            if (idle or self._busy_s >= LINK_BUSY_WINDOW_S) and self._window_bytes:
                self._link_bps = _mix(self._link_bps, self._window_bytes / self._busy_s)
                self._window_bytes, self._busy_s = 0, 0.0

    def choice(self) -> CodecChoice:
        with self._lock:
            current = self._auto_choice() if self._fixed == "auto" else self._fixed
            return CodecChoice(current, self.setting, self._compress_bps, self._link_bps, self._ratio)

    def _auto_choice(self) -> str:
        if self._compress_bps is None or self._link_bps is None or self._ratio is None:
            return "zstd"
        compress_total = self._compress_bps * self._parallel
        return "zstd" if min(compress_total, self._ratio * self._link_bps) >= AUTO_MARGIN * self._link_bps else "none"

    def _observe(self, *, compress_bps: float | None = None, link_bps: float | None = None, ratio: float | None = None) -> None:
        with self._lock:
            if compress_bps is not None:
                self._compress_bps = _mix(self._compress_bps, compress_bps)
            if link_bps is not None:
                self._link_bps = _mix(self._link_bps, link_bps)
            if ratio is not None:
                self._ratio = _mix(self._ratio, ratio)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EWMA) * old + _EWMA * new
