"""Blocks of the storage generations before units, and their conversion.

The connector stores a block as units of one KV head (:mod:`ucm_db.keys.units`).
Two older generations may still sit in a store, and the connector no
longer reads either (``ucm-db migrate`` converts them; the connector
refuses a store holding them, pointing here):

* **whole blocks**: every KV head of a block in one entry under the block
  key, written at TP=1 and PP=1 into the namespace units use today. They
  are recognised by size: a namespace of ``H > 1`` KV heads whose
  description gives its layers and head size holds units of at most
  ``layers x block_size x 2 x head_size x dtype bytes`` raw bytes, and a
  whole block is ``H`` times that (:func:`whole_block_raw_bytes`).
  Only those written on a CPU platform (the record's ``platform`` starts
  with ``cpu``) are converted: :func:`split_whole` cuts one into its ``H``
  head units, byte for byte what the connector's layouts write (each
  layer's frame is the head's slice of the whole frame, head-major: the
  vLLM CPU cache ``[heads, block, 2*head]``, the one CPU arrangement).
  Elsewhere the record does not say which arrangement wrote the block, and
  two of one size are known on CUDA alone: vLLM before 0.32 handed
  FlashAttention's ``[2, blocks, block, heads, head]`` (a head's K then
  its V, head-minor in the frame), vLLM 0.32 hands every backend's
  ``[blocks, heads, block, K|V]`` (head-major, K and V side by side per
  token); a split by guess would load wrong KV. Those whole blocks are
  deleted (``dropped_blocks``): recomputed on demand, and saved as units.
* **per-rank blocks**: written at TP>1 or PP>1 under a namespace carrying
  the rank (``tp_size``/``pp_size`` in its description) and the connector's
  layout record (a JSON object naming ``kv_heads``). Their keys are
  rooted in the rank's namespace and the token ids needed for the
  TP-independent keys are not stored, so they cannot be re-keyed: no
  connector reads them, and the conversion deletes them (their KV is
  recomputed and saved as units on the next use of each prefix).

Invariants:
    * :func:`convert` writes each whole block's units (parents first: a
      unit's parent is the same head's unit of the block's parent) before
      it deletes any whole block, so a conversion cut short leaves whole
      blocks and complete unit chains, and running it again finishes it.
      A whole block it cannot split (corrupt, below one that is, or
      written off CPU) is deleted with the others: no connector reads it
      either way.
    * Only the store's public API writes (put, delete): the index, LRU and
      totals stay consistent; a unit already stored is not written twice.
    * It refuses (LockedError, naming them) while other processes have the
      store open, as ``ucm-db migrate`` does, and holds the store's lock
      exclusively from that check until it is done: a process opening the
      store meanwhile waits for it (the lock was let go before the
      conversion opened the store, and it ran beside whoever opened it then).
      The blocks it converts are listed again under that lock.
    * Nothing here knows tensors; the layout rules above are stated on the
      bytes, and tested against the connector's own layouts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db.errors import FormatVersionError, MissingAncestorError, StoreFullError
from ucm_db.index.local import LocalTier
from ucm_db.maintenance.inspection import BlockInfo, namespace_rows
from ucm_db.keys import Namespace
from ucm_db.migrations.access import refuse_if_held
from ucm_db.store import open as open_store
from ucm_db.store.view import StoreView, open_view
from ucm_db.storelock import StoreLock
from ucm_db.keys.units import KVGrid, unit_key

#: Bytes per element of the KV dtypes a namespace may name.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1}


def is_per_rank(description: Mapping[str, Any]) -> bool:
    """Whether a namespace's recorded description is a per-rank one of the
    connector (module docstring): a TP or PP size, and the connector's
    layout record (``kv_heads``). A namespace the Python API made with a
    rank and a layout of its own is not the connector's and is left alone."""
    ranked = int(description.get("tp_size", 1)) * int(description.get("pp_size", 1)) > 1
    return ranked and "kv_heads" in _layout(description)


def _layout(description: Mapping[str, Any]) -> dict[str, Any]:
    try:
        parts = json.loads(str(description.get("layout", "")))
    except ValueError:
        return {}
    return parts if isinstance(parts, dict) else {}


def whole_block_raw_bytes(description: Mapping[str, Any]) -> int | None:
    """Raw bytes of a whole block of the namespace, or None where it can
    hold none (one KV head, per-rank, or a description that does not say)."""
    parts = _layout(description)
    try:
        heads, layers, head_size = int(parts["kv_heads"]), int(parts["layers"]), int(parts["head_size"])
        elem = _DTYPE_BYTES[str(description["kv_dtype"])]
        block_size = int(description["block_size"])
    except (KeyError, TypeError, ValueError):
        return None
    ranked = int(description.get("tp_size", 1)) * int(description.get("pp_size", 1)) > 1
    if heads <= 1 or ranked or head_size <= 0:
        return None
    return heads * layers * block_size * 2 * head_size * elem


def holds_whole_blocks(description: Mapping[str, Any], blocks: int, raw_bytes: int) -> bool:
    """Whether a namespace with these totals holds at least one whole block:
    every unit is at most a whole block's ``1/heads``, so totals above
    ``blocks`` such units need one."""
    whole = whole_block_raw_bytes(description)
    if whole is None or blocks <= 0:
        return False
    heads = int(_layout(description)["kv_heads"])
    return raw_bytes > blocks * (whole // heads)


def pre_unit_namespaces(namespaces: Mapping[str, Any], model: str | None = None,
                        unit_bytes: Mapping[str, int] | None = None) -> dict[str, str]:
    """Namespace id -> what it holds of an older generation (``"per-rank
    blocks"``, ``"whole blocks"``), among ``namespaces`` (``StoreStats.namespaces``)
    of ``model`` (all models if None).

    ``unit_bytes`` (namespace id -> one head's unit over every layer, in raw
    bytes, as the caller's KV cache spec gives it): whole blocks are then
    looked for in those namespaces only, and only where the namespace record
    gives the same unit size (what :func:`convert` can split; a model whose
    V heads differ from its K heads, or whose pages are padded, is not
    judged by a size its record cannot give)."""
    found: dict[str, str] = {}
    for ns_id, stats in namespaces.items():
        description = stats.description
        if model is not None and description.get("model") != model:
            continue
        if is_per_rank(description):
            found[ns_id] = "per-rank blocks"
            continue
        if unit_bytes is not None:
            whole = whole_block_raw_bytes(description)
            heads = int(_layout(description).get("kv_heads", 1) or 1)
            if ns_id not in unit_bytes or whole is None or whole != heads * unit_bytes[ns_id]:
                continue
        if holds_whole_blocks(description, stats.blocks, stats.raw_bytes):
            found[ns_id] = "whole blocks"
    return found


def refusal(path: str | Path, found: Mapping[str, str]) -> FormatVersionError:
    """The error a connector raises on a store holding older generations."""
    listed = ", ".join(f"{ns_id[:12]} ({kind})" for ns_id, kind in sorted(found.items()))
    return FormatVersionError(
        f"the store {path} holds blocks of a storage generation before units, which the connector no longer reads: {listed}",
        hint=f"stop the engines using it and run `ucm-db migrate {path}` (it splits whole blocks into units and drops "
             "per-rank blocks, which cannot be re-keyed), then start again",
    )


def convertible(description: Mapping[str, Any]) -> bool:
    """Whether the namespace's whole blocks are provably in the arrangement
    :func:`split_whole` reads: written on a CPU platform (module docstring)."""
    return str(_layout(description).get("platform", "")).startswith("cpu")


def split_whole(payload: bytes | bytearray | memoryview, description: Mapping[str, Any]) -> list[list[bytes]]:
    """A whole block's ``heads`` units, each a list of per-layer frames
    (module docstring). Raises FormatVersionError for a block written off
    CPU, whose arrangement its record does not give."""
    if not convertible(description):
        raise FormatVersionError(
            f"a whole block written on platform {_layout(description).get('platform')!r} cannot be split: its record "
            "does not say which KV layout wrote it",
            hint="`ucm-db migrate` drops such blocks; their KV is recomputed on demand",
        )
    parts = _layout(description)
    heads, layers = int(parts["kv_heads"]), int(parts["layers"])
    data = memoryview(payload).cast("B")
    frame_bytes = len(data) // layers
    share = frame_bytes // heads
    units: list[list[bytes]] = [[] for _ in range(heads)]
    for layer in range(layers):
        frame = data[layer * frame_bytes : (layer + 1) * frame_bytes]
        for h in range(heads):
            units[h].append(bytes(frame[h * share : (h + 1) * share]))
    return units


@dataclass
class ConversionReport:
    """What :func:`convert` did (or, dry, would do)."""

    whole_blocks: int = 0      # whole blocks converted (deleted once their units were stored)
    units_written: int = 0
    per_rank_blocks: int = 0   # per-rank blocks deleted
    skipped_blocks: int = 0    # whole blocks that could not be split (unreadable, or their parent was not): deleted too
    dropped_blocks: int = 0    # whole blocks written off CPU (not convertible: module docstring): deleted
    namespaces: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"whole_blocks": self.whole_blocks, "units_written": self.units_written, "per_rank_blocks": self.per_rank_blocks,
                "skipped_blocks": self.skipped_blocks, "dropped_blocks": self.dropped_blocks, "namespaces": dict(self.namespaces)}


_ACTION = "convert the blocks from before units of"
_Wanted = Mapping[bytes, tuple[str, Mapping[str, Any]]]


def convert(path: str | Path, *, dry_run: bool = False) -> ConversionReport:
    """Converts the older generations in the store at ``path`` (module docstring)."""
    report = ConversionReport()
    with open_view(path) as view:
        wanted = _wanted(view)
        whole, ranks = _older_blocks(view.tier, wanted)
    if dry_run or not (whole or ranks):
        _note_namespaces(report, whole, ranks, wanted)
        report.whole_blocks, report.per_rank_blocks = len(_convertible(whole, wanted)), len(ranks)
        report.dropped_blocks = len(whole) - report.whole_blocks
        return report
    lock = StoreLock(path)  # refused at once, naming the holders, before the store is opened
    refuse_if_held(Path(path), lock, _ACTION)
    lock.release()
    with open_store(path) as store:
        # From here until the store closes no other process has it open: its own lock is made
        # exclusive (releasing it to open the store let one in, and the conversion ran beside it).
        refuse_if_held(Path(path), store._state._dir_lock, _ACTION)
        whole, ranks = _older_blocks(store._tier, wanted)  # again, alone with the store
        _note_namespaces(report, whole, ranks, wanted)
        splittable = _convertible(whole, wanted)
        report.dropped_blocks = len(whole) - len(splittable)
        _refuse_eviction(store, splittable, wanted, Path(path))
        converted = _write_units(store, splittable, wanted, report)
        report.whole_blocks = len(converted)
        for ns_id, keys in _by_namespace(whole).items():  # none is read any more: the unsplittable ones go too
            store.delete(Namespace.from_dict(wanted[ns_id][1]), keys)
        for ns_id, keys in _by_namespace(ranks).items():
            report.per_rank_blocks += store.delete(Namespace.from_dict(wanted[ns_id][1]), keys)
    return report


def _wanted(view: StoreView) -> dict[bytes, tuple[str, Mapping[str, Any]]]:
    """The namespaces that may hold an older generation, with what and their descriptions."""
    wanted: dict[bytes, tuple[str, Mapping[str, Any]]] = {}
    for row in namespace_rows(view, None, time.time_ns()):
        description = row.get("description") or {}
        if is_per_rank(description):
            wanted[bytes.fromhex(row["id"])] = ("per-rank blocks", description)
        elif whole_block_raw_bytes(description) is not None:
            wanted[bytes.fromhex(row["id"])] = ("whole blocks", description)
    return wanted


def _older_blocks(tier: LocalTier, wanted: _Wanted) -> tuple[list[BlockInfo], list[BlockInfo]]:
    """The whole blocks and the per-rank blocks stored (one snapshot)."""
    blocks = [BlockInfo.of(key, meta) for key, meta in sorted(tier.scan_metas(set(wanted)).items())]
    whole = [b for b in blocks if wanted[b.namespace_id][0] == "whole blocks" and b.raw_bytes == whole_block_raw_bytes(wanted[b.namespace_id][1])]
    ranks = [b for b in blocks if wanted[b.namespace_id][0] == "per-rank blocks"]
    return whole, ranks


def _convertible(whole: list[BlockInfo], wanted: _Wanted) -> list[BlockInfo]:
    """The whole blocks :func:`split_whole` can split (:func:`convertible`)."""
    return [b for b in whole if convertible(wanted[b.namespace_id][1])]


def _note_namespaces(report: ConversionReport, whole: list[BlockInfo], ranks: list[BlockInfo], wanted: _Wanted) -> None:
    for b in (*whole, *ranks):
        report.namespaces[b.namespace_id.hex()] = wanted[b.namespace_id][0]


#: Room a unit takes beyond its share of the whole block's stored bytes
#: (its header, frame table and index records), counted generously.
_UNIT_OVERHEAD_BYTES = 512


def _refuse_eviction(store: Any, whole: list[Any], wanted: Mapping[bytes, tuple[str, Mapping[str, Any]]], path: Path) -> None:
    """StoreFullError, before anything is converted, when the units of the
    whole blocks would not fit beside them: the whole blocks are deleted
    only once all their units are stored, so a put that evicts would take
    unconverted blocks (issue 46: a 2 MiB store near capacity lost 82 of
    162 blocks). Units take about their whole block's stored bytes."""
    units_per_block = {ns_id: int(_layout(description)["kv_heads"]) for ns_id, (_kind, description) in wanted.items()
                       if whole_block_raw_bytes(description) is not None}
    needed_bytes = sum(b.stored_bytes + _UNIT_OVERHEAD_BYTES * units_per_block[b.namespace_id] for b in whole)
    stats = store.stats()
    free_bytes = max(0, stats.capacity_bytes - stats.stored_bytes)
    if needed_bytes > free_bytes:
        raise StoreFullError(
            f"converting {len(whole)} whole blocks needs about {needed_bytes} bytes beside them and the store at {path} "
            f"has {free_bytes} of {stats.capacity_bytes} bytes free; nothing was converted",
            hint=f"free about {needed_bytes - free_bytes} bytes first (ucm-db compact {path} --target-bytes N), "
            "or export the namespaces and import them into a new store created with a larger capacity_bytes",
        )


def _by_namespace(blocks: Iterable[Any]) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for b in blocks:
        out.setdefault(b.namespace_id, []).append(b.key)
    return out


def _write_units(store: Any, whole: list[Any], wanted: Mapping[bytes, tuple[str, Mapping[str, Any]]], report: ConversionReport) -> list[Any]:
    """Stores every whole block's units, parents first; returns the blocks converted."""
    converted: list[Any] = []
    done: set[bytes] = set()
    for b in sorted(whole, key=lambda b: b.depth):
        description = wanted[b.namespace_id][1]
        namespace = Namespace.from_dict(description)
        parts = _layout(description)
        grid = KVGrid(int(parts["kv_heads"]), int(parts["layers"]))
        if b.parent is not None and b.parent not in done:
            report.skipped_blocks += 1  # its parent was not converted: its units would have no parent
            continue
        (payload,) = store.get(namespace, [b.key])
        if payload is None:
            report.skipped_blocks += 1  # corrupt (now quarantined) or gone
            continue
        try:
            for span, frames in zip(grid.head_spans(), split_whole(payload, description)):
                parent = None if b.parent is None else unit_key(b.parent, span, grid)
                result = store.put(namespace, [unit_key(b.key, span, grid)], [frames], parent=parent)
                report.units_written += result.stored
        except MissingAncestorError:
            report.skipped_blocks += 1
            continue
        done.add(b.key)
        converted.append(b)
    return converted
