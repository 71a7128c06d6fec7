"""The KV view a worker's registered caches show, against the one its
namespace names: a worker refuses to start where they differ.

The namespace (:mod:`ucm_db.connector.identity`) keys the view the layout
adapter is handed, computed from vLLM's KV cache spec with vLLM's allocator
arithmetic (:func:`~ucm_db.connector.engine_facts.kv_view`), on the
scheduler and on every worker alike (the namespace handshake makes them
one). The worker sees the real thing: the tensors vLLM registers
(:func:`~ucm_db.connector.layouts.detect_layout`). A backend that allocates
otherwise than the arithmetic says, a vLLM version that changes it, a
platform plug-in: units would then be stored and loaded under a namespace
that describes another byte arrangement, wrong KV for every other engine on
the store. :func:`refuse_other_view` stops such a start.

A view (:class:`KVView`) is what a unit's bytes are a function of: the
layout kind, one head slot's share of a vLLM block as ``[tokens, content
bytes]`` (kernel blocks inside a vLLM block counted as its tokens; K and V
segments side by side counted as content), and the head slots a rank holds.

Invariants:
    * The view a namespace names (:func:`named_view`): its ``kv_view``; none
      in a CPU namespace is the default CPU layout (kind ``cpu``, a block of
      ``block_size`` tokens of a head's K then V, one slot per KV head),
      which is checked as strictly. No view is checked where the namespace
      names none that the arithmetic gives: a ``runner`` view (the package
      that lays the KV out is keyed instead), a layout record that is not
      the connector's JSON (test stand-ins), a platform other than CPU
      without a view (no platform known).
    * Of a hybrid model's attention group only the kind
      and the head slots are compared: the namespace's view is the first
      attention group's spec, and other groups may have other head sizes
      and block sizes (vLLM unifies their page sizes). An SSM state group
      is not checked (its state is no KV view).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ucm_db.connector.hybrid.groups import group_described
from ucm_db.connector.identity import KVShape
from ucm_db.connector.layouts import KVLayout, LayerSegments
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace


@dataclass(frozen=True)
class KVView:
    """A layout kind, one head slot's block ``[tokens, content bytes]``, and the rank's head slots."""

    kind: str
    block: tuple[int, int] | None  # None: not known (then not compared)
    head_slots: int
    default: bool = False  # the default CPU layout, which a namespace names by naming no view

    def describe(self) -> str:
        block = "" if self.block is None else f", \"block\": [{self.block[0]}, {self.block[1]}]"
        return f"{{\"kind\": \"{self.kind}\"{block}, \"head_slots\": {self.head_slots}}}"


def layer_view(kind: str, layer: LayerSegments) -> KVView:
    """The view one registered layer shows (module docstring): a head's
    slice of each segment for one block, heads' axis removed."""
    tokens: set[int] = set()
    content_bytes = 0
    for seg in layer.segments:
        dims = list(seg.shape[1:])
        if layer.head_axis is not None:
            del dims[layer.head_axis]
        per_token = 1
        for dim in dims[:-1]:
            per_token *= int(dim)
        tokens.add(per_token)
        content_bytes += int(dims[-1]) * seg.element_size() if dims else seg.element_size()
    block = (tokens.pop(), content_bytes) if len(tokens) == 1 else None
    return KVView(kind, block, layer.heads)


def named_view(shape: KVShape, ns: Namespace, rank_heads: int) -> KVView | None:
    """The view the namespace ``ns`` (of ``shape``, or of one of its hybrid
    groups) names for a rank of ``rank_heads`` KV heads (1 for MLA), or None
    where it names none to check (module invariants)."""
    try:
        record = json.loads(ns.layout)
    except ValueError:
        return None
    if not isinstance(record, dict) or "platform" not in record:
        return None
    described = group_described(ns.extra, shape.extra)  # None: the model's own namespace
    if described is not None and json.loads(described).get("group") == "ssm_state":
        return None
    view = record.get("kv_view")
    if view is None:
        if not str(record["platform"]).startswith("cpu"):
            return None
        block = _default_block(record, shape.block_size, shape.kv_dtype, shape.layers, shape.unit_bytes)
        return KVView("cpu", block if described is None else None, rank_heads, default=True)
    if view.get("kind") == "runner":
        return None
    block = (int(view["block"][0]), int(view["block"][1])) if view.get("block") and described is None else None
    return KVView(str(view.get("kind")), block, int(view.get("head_slots", rank_heads)))


def _default_block(record: dict[str, Any], block_size: int, kv_dtype: str, layers: int, unit_bytes: int) -> tuple[int, int] | None:
    """The default CPU layout's block: ``block_size`` tokens of a head's K
    then V (``unit_bytes`` over ``layers`` and tokens: the spec's V head
    size may differ from K's), MLA's latent alone (``head_size`` elements)."""
    if unit_bytes > 0 and layers > 0 and unit_bytes % (layers * block_size) == 0:
        return block_size, unit_bytes // (layers * block_size)
    dtype = getattr(torch, kv_dtype, None)
    if str(record.get("spec", "")).startswith("MLA") and isinstance(dtype, torch.dtype):
        return block_size, int(record.get("head_size", 0)) * dtype.itemsize
    return None


def refuse_other_view(layout: KVLayout, expected: KVView | None, where: str) -> None:
    """Raises ConfigError where a layer of ``layout`` does not show
    ``expected`` (its block compared where ``expected`` gives one: module
    invariants). ``where`` names the worker in the message."""
    if expected is None:
        return
    for layer in layout.layers:
        seen = layer_view(layout.kind, layer)
        same = seen.kind == expected.kind and seen.head_slots == expected.head_slots
        if expected.block is not None:
            same = same and seen.block == expected.block
        if not same:
            raise ConfigError(
                f"{where} registered KV caches laid out as {seen.describe()} (layer {layer.name}: {layout.describe()}), "
                f"but the namespace its blocks are stored under names the view {expected.describe()}"
                + (" (the default CPU layout: its layout record has no kv_view)" if expected.default else "") + ": units stored "
                "and loaded under it would be another byte arrangement than the namespace describes, wrong KV for "
                "every engine sharing the store",
                hint="report this to ucm-db as a bug, with both views and the vLLM version, platform and attention "
                     "backend; serve without ucm-db meanwhile",
            )
