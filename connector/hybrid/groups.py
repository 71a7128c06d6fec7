"""KV cache groups of a hybrid model (vLLM's hybrid KV cache manager).

What each group is, and the namespace its blocks are stored under; the
connector serves each group apart (hybrid.py).

Invariants:
    * Each group's namespace names its layer set and its spec (full
      attention; sliding window with its window; SSM state with its state
      shapes, dtypes and kind), so a group never reads another group's
      blocks, nor another model's group of the same shape.
    * An SSM/Mamba group (``MambaSpec``) is stored (ssm_state.py) only in
      vLLM's ``mamba_cache_mode="align"`` (prefix caching on), the one mode
      that keeps its state at block boundaries; otherwise it is refused
      with the fix, and so is a model with no attention group.
    * A model with one group keeps the namespace ucm-db gave it before
      (:func:`group_namespace` returns the deployment's namespace), and any
      attention spec it was served with before (MLA ...): stores stay valid.
    * Each group is stored at its own block size (its spec's: vLLM's
      ``unify_kv_cache_spec_page_size`` enlarges the block size of the
      groups whose page is smaller, so every page holds the same bytes). A
      group whose block size is not the deployment's has it in its
      namespace's ``block_size`` (a key chain at that size), so engines
      whose groups have other block sizes never read each other's blocks;
      a group of the deployment's block size keeps the namespace it had.
      A hit ends at a multiple of every group's block size
      (:func:`claim_step`, vLLM's hybrid coordinator's lcm), so no group is
      claimed a token it does not load whole blocks for.
    * Specs ucm-db cannot store in a model of several groups (chunked
      local attention, cross attention ...), and a lone
      group that is not attention, are refused with a ConfigError naming
      the spec and the fix, when the groups are first known: the worker's
      connector is made before vLLM allocates the KV cache. So is a group
      whose layers' pages differ (vLLM's ``UniformTypeKVCacheSpecs``: some
      layers kept in the model dtype by ``kv_cache_dtype_skip_layers``, or
      layers of other head sizes, a draft's): the namespace names one head
      size and KV dtype for all of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace

#: vLLM spec class name -> the kind stored in the namespace.
_STORABLE = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window"}


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its index, kind, window and layers (vLLM's order)."""

    index: int
    kind: str
    sliding_window: int | None
    layer_names: tuple[str, ...]
    state: str | None = None  # an SSM group's state spec (shapes, dtypes, kind); None for attention
    block_size: int = 0  # tokens per block of this group (its spec's); 0: the deployment's

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.kind, "window": self.sliding_window, "layers": list(self.layer_names)}
        if self.state is not None:
            out["state"] = self.state
        return out


def kv_groups(kv_cache_config: Any, skip_layers: Any = None) -> list[KVGroup]:
    """The groups of vLLM's ``KVCacheConfig``; refuses specs ucm-db cannot
    store (``skip_layers``: the cache config's ``kv_cache_dtype_skip_layers``,
    named where a group's pages differ)."""
    groups = []
    specs = kv_cache_config.kv_cache_groups
    for index, group in enumerate(specs):
        spec_name = type(group.kv_cache_spec).__name__
        if spec_name == "UniformTypeKVCacheSpecs":
            raise _mixed_pages(index, group, skip_layers)
        kind = _STORABLE.get(spec_name)
        if kind is None and len(specs) == 1 and _is_attention(group.kv_cache_spec):
            kind = spec_name  # one group: any attention spec, as ucm-db stored it before groups (MLA ...)
        state = None
        if kind is None and spec_name == "MambaSpec" and len(specs) > 1:
            kind, state = "ssm_state", _state_spec(index, group)
        if kind is None:
            raise ConfigError(
                f"KV cache group {index} ({len(group.layer_names)} layers) has a {spec_name}, which ucm-db cannot store yet",
                hint="serve this model without ucm-db, or with full or sliding-window attention only",
            )
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        block_size = int(getattr(group.kv_cache_spec, "block_size", 0) or 0)
        groups.append(KVGroup(index, kind, int(window) if window is not None else None, tuple(group.layer_names), state,
                              block_size))
    if all(g.kind == "ssm_state" for g in groups):
        raise ConfigError(
            f"ucm-db stores SSM state beside attention only; this model has {len(groups)} SSM state groups and no attention group",
            hint="serve this model without ucm-db",
        )
    return groups


def group_namespace(base: Namespace, groups: list[KVGroup], group: KVGroup) -> Namespace:
    """The namespace ``group``'s blocks are stored under (module invariants)."""
    if len(groups) == 1:
        return base
    described = json.dumps(group.describe(), sort_keys=True, separators=(",", ":"))
    fields = {**base.to_dict(), "extra": group_extra(base.extra, described)}
    if group.block_size and group.block_size != base.block_size:
        fields["block_size"] = group.block_size  # its keys chain blocks of this size (module invariants)
    return Namespace.from_dict(fields)


def claim_step(groups: list[KVGroup], block_size: int) -> int:
    """Tokens a hit is a multiple of: the lcm of the groups' block sizes
    (``block_size``, the deployment's, for a group that does not say)."""
    return math.lcm(*(g.block_size or block_size for g in groups))


def group_extra(inputs: str, described: str) -> str:
    """A group namespace's ``extra``: the model's namespace inputs, then the group's description."""
    return (inputs + "|" if inputs else "") + described


def group_described(extra: str, inputs: str) -> str | None:
    """The group description in a namespace's ``extra`` built on ``inputs``
    (:func:`group_extra`), or None for a model's own namespace."""
    if extra == inputs:
        return None
    return extra.removeprefix(inputs + "|") if inputs else extra


def _state_spec(index: int, group: Any) -> str:
    """An SSM group's state spec, for its namespace; refuses a mode whose
    state is not kept at block boundaries (module invariants)."""
    spec = group.kv_cache_spec
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise ConfigError(
            f"KV cache group {index} ({len(group.layer_names)} layers) has a MambaSpec in mamba_cache_mode {mode!r}: "
            "ucm-db stores SSM state only where vLLM keeps it at block boundaries (mode \"align\")",
            hint="turn prefix caching on (--enable-prefix-caching; vLLM then picks mamba_cache_mode \"align\"), "
                 "or serve this model without ucm-db",
        )
    dtypes = [str(d).removeprefix("torch.") for d in spec.dtypes]
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    return f"{kind}:{[list(s) for s in spec.shapes]}:{dtypes}"


def _mixed_pages(index: int, group: Any, skip_layers: Any) -> ConfigError:
    """The refusal of a group whose layers' KV specs differ (module invariants), naming what differs."""
    kinds: dict[str, list[str]] = {}
    dtypes = set()
    for name, spec in group.kv_cache_spec.kv_cache_specs.items():
        dtypes.add(dtype := str(getattr(spec, "dtype", "?")).removeprefix("torch."))
        what = f"head size {getattr(spec, 'head_size', '?')}, {dtype}, {getattr(spec, 'page_size_bytes', '?')} bytes a page"
        kinds.setdefault(what, []).append(name)
    listed = "; ".join(names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "") + f": {what}"
                       for what, names in kinds.items())
    skip_layers = skip_layers if len(dtypes) > 1 else None  # the setting is the cause only where KV dtypes differ
    cause = (f": vLLM keeps the KV of the layers kv_cache_dtype_skip_layers={list(skip_layers)!r} names (set by hand, or "
             "by a turboquant/ultraquant KV cache dtype for its boundary layers) in the model dtype, beside quantized "
             "ones" if skip_layers else "")
    return ConfigError(
        f"KV cache group {index} ({len(group.layer_names)} layers) holds layers whose KV pages differ in size or kind ({listed}){cause}; "
        "ucm-db cannot store a group of mixed pages (it stores one KV layout per group)",
        hint="serve this model without ucm-db" + (", or without kv_cache_dtype_skip_layers (one KV cache dtype for every "
                                                 "layer)" if skip_layers else ""),
    )


def _is_attention(spec: Any) -> bool:
    """Whether ``spec`` is one of vLLM's attention specs (paged KV of
    tokens, not an SSM's state)."""
    return any(cls.__name__ == "AttentionSpec" for cls in type(spec).__mro__)
