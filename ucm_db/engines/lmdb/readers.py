"""Who keeps a store's file growing: LMDB's reader table, read for a warning.

LMDB reuses no page freed after the oldest snapshot a reader slot holds. A
process stopped (SIGSTOP, Ctrl-Z, a debugger) while it holds a read
transaction (a group writer's snapshot pin, or a long read) thus makes every
other writer's commits append to the file until it resumes or dies. Nothing
can end another process's transaction; this module names it, so that an
operator can (``ucm_db.store.background`` warns once the file grows past
its bound).

Invariants:
    * Reading costs one ``env.readers()`` (LMDB formats its reader table as
      text) and one ``env.info()``: no transaction, no lock a writer waits on.
    * Only other processes' slots are named; a slot whose process is gone
      is named as such (the next open or recorded sync clears it).
"""

from __future__ import annotations

import os

import lmdb

from ucm_db.engines.lmdb.recovery import pid_alive

#: A slot this many transactions behind the newest is named.
LAG_TXNS = 64
#: Slots named at most.
MAX_NAMED = 3


def lagging_readers(env: lmdb.Environment, *, lag_txns: int = LAG_TXNS) -> list[tuple[int, int, str]]:
    """Other processes' reader slots at least ``lag_txns`` transactions
    behind the newest commit, most behind first: (pid, the slot's
    snapshot, one phrase naming them)."""
    newest = env.info()["last_txnid"]
    slots: list[tuple[int, int]] = []
    for line in env.readers().splitlines()[1:]:
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
            continue  # the header, "(no active readers)", or a slot between transactions ("-")
        pid, txnid = int(parts[0]), int(parts[2])
        if pid != os.getpid() and newest - txnid >= lag_txns:
            slots.append((txnid, pid))
    slots.sort()
    return [(pid, txnid, f"pid {pid} ({'running or stopped' if pid_alive(pid) else 'gone'}) holds a snapshot "
             f"{newest - txnid} transactions old") for txnid, pid in slots[:MAX_NAMED]]
