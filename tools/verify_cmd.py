"""``ucm-db verify``: decode and checksum every stored block (or a sample).

The check pass is read-only (a :func:`store_view`, no reader activity). With
``--fix`` the corrupt blocks found are then quarantined through the store's
own mechanism (:meth:`LocalTier.quarantine`, which re-checks each block
inside its write transaction and takes its descendants with it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ucm_db import codec
from ucm_db.errors import CorruptBlockError, FormatVersionError
from ucm_db.tiers.base import Txn
from ucm_db.tiers.local import BlockMeta, body_of

from ucm_db.tools.cli_common import EXIT_OK, EXIT_PROBLEMS, emit, json_option, progress, store_view

#: Blocks checked per read transaction (keeps LMDB read snapshots short).
CHUNK_BLOCKS = 256


@dataclass
class VerifyReport:
    checked: int = 0
    raw_bytes: int = 0
    corrupt: dict[bytes, str] = field(default_factory=dict)
    index_problems: list[str] = field(default_factory=list)
    quarantined_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked, "raw_bytes": self.raw_bytes,
            "corrupt": [{"key": k.hex(), "reason": r} for k, r in sorted(self.corrupt.items())],
            "index_problems": self.index_problems, "quarantined_blocks": self.quarantined_blocks,
        }


def check_block(key: bytes, meta_data: Any, head_data: Any, stored: Any) -> tuple[int, str | None]:
    """(raw bytes, None) for a good block, (0, reason) for a bad one."""
    if meta_data is None:
        return 0, "metadata vanished"
    if stored is None:
        return 0, "payload missing"
    if head_data is None:
        return 0, "head missing"
    meta = BlockMeta.unpack(meta_data)
    head = memoryview(head_data)
    body = body_of(head, memoryview(stored))
    if len(head) + len(body) != meta.stored_bytes:
        return 0, f"block is {len(head) + len(body)} bytes, metadata says {meta.stored_bytes}"
    try:
        return len(codec.decode_parts(head, body, key)), None
    except CorruptBlockError as exc:
        return 0, str(exc)


def verify_view(view: Any, *, sample: int | None, seed: int, show_progress: bool) -> VerifyReport:
    """Checks the blocks of an open view (all, or ``sample`` at random)."""
    keys = view.engine.read(lambda txn: [k for k, _ in txn.scan("meta")])
    if sample is not None and sample < len(keys):
        keys = sorted(random.Random(seed).sample(keys, sample))
    report = VerifyReport()
    with progress(show_progress, len(keys), "verifying") as bar:
        for start in range(0, len(keys), CHUNK_BLOCKS):
            chunk = keys[start : start + CHUNK_BLOCKS]

            def run(txn: Txn, chunk: list[bytes] = chunk) -> list[tuple[int, str | None]]:
                return [check_block(k, txn.get("meta", k), txn.get("heads", k), txn.get("blocks", k)) for k in chunk]

            for key, (raw, reason) in zip(chunk, view.engine.read(run)):
                report.checked += 1
                report.raw_bytes += raw
                if reason is not None and reason != "metadata vanished":  # vanished: evicted meanwhile
                    report.corrupt[key] = reason
            bar.update(len(chunk))
    if sample is None:
        report.index_problems = view.tier.check()
    return report


def quarantine_corrupt(path: Path, corrupt: dict[bytes, str]) -> int:
    """Quarantines ``corrupt`` through the store; returns blocks removed."""
    import ucm_db

    def still_corrupt_for(key: bytes) -> Any:
        def check(head: memoryview, body: memoryview) -> bool:
            try:
                codec.verify_parts(head, body, key)
                return False
            except CorruptBlockError:
                return True
        return check

    with ucm_db.open(path) as store:
        before = store.tier.totals().blocks
        for key, reason in corrupt.items():
            store.tier.quarantine(key, f"ucm-db verify: {reason}", still_corrupt_for(key))
        return before - store.tier.totals().blocks


def render(r: dict[str, Any]) -> str:
    lines = [f"checked {r['checked']} blocks ({r['raw_bytes']} raw bytes): {len(r['corrupt'])} corrupt"]
    lines += [f"  corrupt {c['key']}: {c['reason']}" for c in r["corrupt"]]
    lines += [f"  index: {p}" for p in r["index_problems"]]
    if r["quarantined_blocks"]:
        lines.append(f"quarantined {r['quarantined_blocks']} blocks (corrupt ones and their descendants)")
    elif r["corrupt"]:
        lines.append("run again with --fix to quarantine them (they are served as misses meanwhile)")
    return "\n".join(lines)


@click.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--sample", type=click.IntRange(min=1), default=None, help="Check N blocks chosen at random instead of all.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed of --sample.")
@click.option("--fix", is_flag=True, help="Quarantine the corrupt blocks found (writes to the store).")
@json_option
def verify_command(path: Path, sample: int | None, seed: int, fix: bool, as_json: bool) -> None:
    """Decode and checksum every block (or a --sample) and report corrupt
    ones; exit status 1 if any. Read-only unless --fix.

    \b
    Example:
        ucm-db verify /var/cache/ucm-db
        ucm-db verify /var/cache/ucm-db --sample 1000 --fix
    """
    with store_view(path) as view:
        if fix and not view.current_format:
            raise FormatVersionError(f"store at {path} has format {view.format_version}", hint=f"run `ucm-db migrate {path}` before --fix")
        report = verify_view(view, sample=sample, seed=seed, show_progress=not as_json)
    if fix and report.corrupt:
        report.quarantined_blocks = quarantine_corrupt(path, report.corrupt)
    emit(as_json, report.to_dict(), render)
    # Found problems are reported by the exit status even when --fix handled them.
    raise SystemExit(EXIT_PROBLEMS if report.corrupt or report.index_problems else EXIT_OK)
