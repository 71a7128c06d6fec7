"""glibc's malloc told to keep the memory of LMDB's dirty pages across commits.

Invariant: tuned at most once per process, only on glibc Linux, and never
with ``UCM_DB_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20
_MALLOC_TRIM_THRESHOLD_BYTES = 128 << 20
_malloc_tuned = False


def keep_dirty_page_memory() -> None:
    """Lets glibc reuse the memory of LMDB's dirty pages across commits.

    Without ``writemap``, LMDB mallocs every value's overflow pages (a 2 MiB
    block is one 2 MiB+4 KiB allocation) and frees them at commit. glibc then
    trims the freed heap top (or unmaps the chunk), so the next commit
    page-faults all of it in again (with the encoded blobs, 1024 faults per
    2 MiB block: up to half of a large put's time, see ``ucm-db bench``).
    Fixed thresholds of 32 MiB (mmap, glibc's own ceiling for its dynamic
    threshold) and 128 MiB (trim: a 16 x 2 MiB commit peaks at 64 MiB of
    blobs plus dirty pages) keep that memory for reuse; the process keeps
    at most that much freed memory mapped.
    """
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("UCM_DB_MALLOC_TUNING", "1") == "0":
        return
    _malloc_tuned = True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _MALLOC_TRIM_THRESHOLD_BYTES)
