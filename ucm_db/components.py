"""The store's parts, for code that measures them one by one.

The benchmarks time the codec, its thread pool, the remote link, the uploader and
the remote object format (and its MAC and encryption keys) apart from the :class:`~ucm_db.Store` that
normally drives them. This module is the one public door to those parts:
``ucm_db.tools`` imports them from here, never from the modules that
implement them (``tests/test_layering.py`` enforces it), and reaches a
store's own parts through :func:`local_tier` and :func:`remote_link` (the
store has no public handle on them). The names are re-exports; their
behaviour is documented where they are defined.
"""

from __future__ import annotations

from ucm_db import codec
from ucm_db.codec import pool as codec_pool
from ucm_db.auth import AuthKeys, mac as auth_mac
from ucm_db.remote.link import READ_THREADS, RemoteLink
from ucm_db.remote.uploader import LOCK_NAME as UPLOADER_LOCK_NAME, Uploader
from ucm_db.store import Store
from ucm_db.index.entries import BlockEntry
from ucm_db.index.local import LocalTier
from ucm_db.remote.tier import RemoteRoot, is_local_fs, pack_object, write_whole
from ucm_db.remote.sealing import SealingKeys

__all__ = ["READ_THREADS", "UPLOADER_LOCK_NAME", "AuthKeys", "auth_mac", "BlockEntry", "LocalTier", "RemoteLink", "RemoteRoot",
           "SealingKeys", "Uploader", "codec", "codec_pool", "is_local_fs", "local_tier", "pack_object", "remote_link", "write_whole"]


def local_tier(store: Store) -> LocalTier:
    """The local tier ``store`` serves from (to time or fill it directly)."""
    return store._tier


def remote_link(store: Store) -> RemoteLink | None:
    """The link to ``store``'s remote, or None without a ``remote``."""
    return None if store._wing is None else store._wing.link
