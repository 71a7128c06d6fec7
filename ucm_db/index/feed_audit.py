"""The change feed's check and repair, for ``verify`` and ``verify --fix``
(the feed itself: :mod:`ucm_db.index.changefeed`, whose layout and
damaged-head rules this module reads through its helpers).

Invariants:
    * :func:`problems` reads one snapshot and changes nothing; each line
      starts ``change feed:``.
    * :func:`repair` runs in one write transaction: a damaged or missing
      head alone is rebuilt as an append would; where records are dropped,
      every record goes and a new sequence starts above everything handed
      out, so every reader resyncs once to the corrected inventory. A
      damaged feed id, or a sequence started again at 0, gets a new id.
"""

from __future__ import annotations

from ucm_db.engines.base import Buffer, Txn
from ucm_db.events import BlockEventFields
from ucm_db.errors import CorruptBlockError
from ucm_db.index import epoch_moves, records
from ucm_db.index.changefeed import (
    _DEPTH, _HEAD, _ID_BYTES, _KEY_END, _KINDS, _NS_BYTES, FEED_PREFIX, FIELDS_PREFIX, HEAD_KEY, ID_KEY, INFO, MAX_SPAN, SEQ_LIMIT,
    _checked_head, _derived, _head, _held, _name, _rebuilt, _seq_of, head_problem, logger, renew_identity,
)

_NAMED_AT_MOST = 20


def problems(txn: Txn) -> list[str]:
    """What ``verify`` names of the feed (empty when it is sound), each
    line starting ``change feed:``: a damaged or missing head, records
    outside its range or under stray names, malformed records, records
    saying a block is stored that is not (with no removal after them), and
    event fields of blocks not stored."""
    damaged_id = _id_problem(txn)
    found = _findings(txn)[0] + ([] if damaged_id is None else [damaged_id]) + epoch_moves.problems(txn)
    return [f"change feed: {line}" for line in found]


def _id_problem(txn: Txn) -> str | None:
    """Why the feed id is damaged; None if it is sound or absent (a store of
    ucm-db before feed ids: its next writable open draws one)."""
    try:
        records.get_checked(txn, ID_KEY, size=_ID_BYTES)
    except records.DamagedRecord as exc:
        return f"feed id is damaged ({exc.reason}): readers resync once to a new one, drawn by the next writable open"
    return None


def _findings(txn: Txn) -> tuple[list[str], list[bytes], list[bytes], bool]:
    """(problem lines, bad ``feed/`` names, bad ``evf/`` names, whether
    the head is damaged or missing) from one snapshot."""
    head, reason = _checked_head(txn)
    lines: list[str] = []
    bad_records: list[bytes] = []
    held: list[int] = []
    newest: dict[bytes, tuple[int, int, bytes]] = {}  # key -> (seq, kind, name) of its newest whole record
    malformed: list[str] = []
    for name, value in txn.scan(INFO, FEED_PREFIX):
        name, seq = bytes(name), _seq_of(name)
        if seq is None:
            bad_records.append(name)
            continue
        held.append(seq)
        why = _malformed(value)
        if why is not None:
            bad_records.append(name)
            malformed.append(f"record {seq} is malformed ({why})")
        else:
            newest[bytes(value[1 + _NS_BYTES:_KEY_END])] = (seq, value[0], name)
    head_bad = reason is not None or (head is None and bool(held or bad_records))
    if reason is not None:
        lines.append(f"head is damaged ({reason}): readers resync, the next append rebuilds it")
    elif head is None and (held or bad_records):
        lines.append(f"head is missing while the feed holds {len(held)} records")
    if head is not None:
        outside = [seq for seq in held if not head[1] <= seq < head[0]]
        if outside:
            lines.append(f"{len(outside)} records outside the head's range [{head[1]}, {head[0]}), seq {outside[0]} first")
            bad_records += [_name(seq) for seq in outside]
    strays = [n for n in bad_records if _seq_of(n) is None]
    if strays:
        lines.append(f"{len(strays)} records under names that are no seq (first {strays[0].hex()})")
    lines += _capped(malformed)
    phantoms = [(seq, key, name) for key, (seq, kind, name) in newest.items()
                if _KINDS[kind] == "stored" and txn.get("meta", key) is None]
    lines += _capped([f"record {seq} says block {key.hex()[:16]} is stored; it is not, and no removal follows"
                      for seq, key, _ in sorted(phantoms)])
    bad_records += [name for _, _, name in phantoms]
    bad_fields, field_lines = _bad_fields(txn)
    return lines + field_lines, bad_records, bad_fields, head_bad


def _bad_fields(txn: Txn) -> tuple[list[bytes], list[str]]:
    """``evf/`` names of blocks not stored or with malformed fields, and the lines naming them."""
    names: list[bytes] = []
    lines: list[str] = []
    for name, value in txn.scan(INFO, FIELDS_PREFIX):
        key = bytes(name[len(FIELDS_PREFIX):])
        if txn.get("meta", key) is None:
            lines.append(f"event fields of block {key.hex()[:16]}, which is not stored (the inventory would announce it)")
        elif (why := _malformed_fields(value)) is not None:
            lines.append(f"event fields of block {key.hex()[:16]} are malformed ({why})")
        else:
            continue
        names.append(bytes(name))
    return names, _capped(lines)


def _malformed(value: Buffer) -> str | None:
    """Why a ``feed/`` record cannot be read; None for a whole one."""
    if len(value) < _KEY_END + _DEPTH.size:
        return f"{len(value)} bytes"
    if value[0] not in _KINDS:
        return f"unknown kind {value[0]}"
    return _malformed_fields(bytes(value[1:1 + _NS_BYTES]) + bytes(value[_KEY_END:]))


def _malformed_fields(value: Buffer) -> str | None:
    """Why an ``evf/`` value (namespace id | depth | fields) cannot be read."""
    if len(value) < _NS_BYTES + _DEPTH.size:
        return f"{len(value)} bytes"
    try:
        BlockEventFields.unpack(bytes(value[_NS_BYTES + _DEPTH.size:]))
    except CorruptBlockError as exc:
        return str(exc)
    return None


def _capped(lines: list[str]) -> list[str]:
    if len(lines) <= _NAMED_AT_MOST:
        return lines
    return lines[:_NAMED_AT_MOST] + [f"... and {len(lines) - _NAMED_AT_MOST} more like these"]


def repair(txn: Txn, max_records: int) -> int:
    """Repairs what :func:`problems` names, in one write transaction;
    returns how many records it rebuilt or dropped (0: nothing to do).

    A damaged or missing head alone is rebuilt as an append would (readers
    at the end read on). Where records are dropped, every record goes and a
    new sequence starts above everything handed out (module docstring)."""
    _, bad_records, bad_fields, head_bad = _findings(txn)
    moves = epoch_moves.repair(txn)  # recorded at the head as it is: a follower resumed before it resyncs once
    renewed = int(_id_problem(txn) is not None)
    if renewed:
        renew_identity(txn)
    renewed += moves
    if not bad_records and not bad_fields:
        if not head_bad:
            return renewed
        keep = min(max(1, max_records), MAX_SPAN)
        records.put_checked(txn, HEAD_KEY, _HEAD.pack(*_rebuilt(txn, keep, head_problem(txn))))
        return 1 + renewed
    head = _head(txn)
    seqs, strays = _held(txn)
    handed_out = max(head[0] if head is not None else 0, _derived(seqs))
    for name in strays + [_name(seq) for seq in seqs] + bad_fields:
        txn.delete(INFO, name)
    start = handed_out + 1 if handed_out + 1 < SEQ_LIMIT else 0
    if start == 0:  # seqs handed out before come again
        renew_identity(txn)
    records.put_checked(txn, HEAD_KEY, _HEAD.pack(start, start))
    logger.warning("ucm-db: change feed repaired: %d records dropped, %d event fields records dropped; "
                   "a new sequence starts at %d (every reader resyncs)", len(set(bad_records)), len(bad_fields), start)
    return len(set(bad_records)) + len(bad_fields) + int(head_bad) + renewed
