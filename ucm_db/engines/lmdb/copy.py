"""A copy of an LMDB environment, table by table, that leaves stuck
payloads behind: what ``compact``'s rewrite does when a quarantine left a
payload the engine could not free (:mod:`ucm_db.index.damage`).

LMDB's own compacting copy walks every page, so it would carry (or fail on)
the damaged page. This copy reads each table in key order and writes it into
a fresh environment with appends, skipping the stuck ``blocks`` entries and
their quarantine records (the rewrite drops them, so they are no longer
stuck). The damaged page is never read: a stuck entry's value is not
fetched.

Invariants:
    * Every other entry of every table is copied byte for byte.
    * The source is only read; the destination directory must be empty.
    * The destination gets no lock file (nothing else opens it), so a full
      disk is an ``lmdb.Error`` from a write, never a SIGBUS from a mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lmdb

#: Entries copied per write transaction of the destination.
COPY_CHUNK_ENTRIES = 4096


def stuck_keys(env: lmdb.Environment) -> set[bytes]:
    """Keys whose quarantine record says their payload is stuck."""
    found: set[bytes] = set()
    with env.begin() as txn:
        if txn.get(b"quarantine") is None:
            return found
        table = env.open_db(b"quarantine", txn=txn, create=False)
        for key, value in txn.cursor(db=table):
            try:
                if json.loads(value).get("payload_stuck"):
                    found.add(bytes(key))
            except (ValueError, UnicodeDecodeError, AttributeError):
                continue
    return found


def copy_leaving(env: lmdb.Environment, dest_dir: Path, stuck: set[bytes]) -> None:
    """Copies ``env`` into a new environment in ``dest_dir`` without the
    ``stuck`` keys' ``blocks`` entries and quarantine records."""
    with env.begin() as txn:
        names = [bytes(name) for name, _ in txn.cursor()]
    # No lock file: the copy is private to this process, and LMDB writes its
    # lock file through a shared mapping, so on a full disk the first touch of
    # a page the file system cannot back killed compact with SIGBUS.
    dest = lmdb.open(str(dest_dir), map_size=env.info()["map_size"], max_dbs=len(names) + 4, subdir=True,
                     sync=False, metasync=False, mode=0o600, lock=False)
    try:
        for name in names:
            _copy_table(env, dest, name, stuck if name in (b"blocks", b"quarantine") else set())
        dest.sync(True)
    finally:
        dest.close()


def _copy_table(env: lmdb.Environment, dest: lmdb.Environment, name: bytes, skip: set[bytes]) -> None:
    with env.begin(buffers=True) as txn:
        source = env.open_db(name, txn=txn, create=False)
        target = dest.open_db(name, create=True)
        cursor = txn.cursor(db=source)
        batch: list[tuple[bytes, Any]] = []
        more = cursor.first()
        while more:
            key = bytes(cursor.key())
            if key not in skip:
                batch.append((key, bytes(cursor.value())))
            if len(batch) >= COPY_CHUNK_ENTRIES:
                _append(dest, target, batch)
                batch = []
            more = cursor.next()
        _append(dest, target, batch)


def _append(dest: lmdb.Environment, target: Any, batch: list[tuple[bytes, Any]]) -> None:
    if batch:
        with dest.begin(write=True, db=target) as txn:
            txn.cursor(db=target).putmulti(batch, append=True)
