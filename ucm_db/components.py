"""The store's parts, for code that measures them one by one.

The benchmarks time the codec, its thread pool, the remote read-through, the uploader and
the remote object format (and its MAC keys) apart from the :class:`~ucm_db.Store` that
normally drives them. This module is the one public door to those parts:
``ucm_db.tools`` imports them from here, never from the modules that
implement them (``tests/test_layering.py`` enforces it). The names are
re-exports; their behaviour is documented where they are defined.
"""

from __future__ import annotations

from ucm_db import codec, codec_pool
from ucm_db.auth import AuthKeys, mac as auth_mac
from ucm_db.readthrough import READ_THREADS, RemoteLink
from ucm_db.tiers.index_types import BlockEntry
from ucm_db.tiers.remote import RemoteRoot, is_local_fs, pack_object, write_whole
from ucm_db.uploader import LOCK_NAME as UPLOADER_LOCK_NAME, Uploader

__all__ = ["READ_THREADS", "UPLOADER_LOCK_NAME", "AuthKeys", "auth_mac", "BlockEntry", "RemoteLink", "RemoteRoot", "Uploader", "codec", "codec_pool", "is_local_fs",
           "pack_object", "write_whole"]
