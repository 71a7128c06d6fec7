"""The request counters of a remote root (:class:`ucm_db.remote.tier.RemoteRoot`),
re-exported by :mod:`ucm_db.remote.tier`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RemoteStats:
    """Request counters of one :class:`~ucm_db.remote.tier.RemoteRoot` (this process)."""

    requests: int = 0
    gets: int = 0
    puts: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    not_regular: int = 0
    #: Objects refused: stating more than ``max_object_bytes``, or a block of more raw bytes than that.
    too_large: int = 0
    unauthenticated: int = 0
    mac_mismatch: int = 0
    #: Encrypted objects no configured encryption key opens (or any, without one).
    undecryptable: int = 0
    #: Plaintext objects met while an encryption key is set.
    unencrypted: int = 0
