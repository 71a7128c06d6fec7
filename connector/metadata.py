"""Scheduler -> worker metadata of one engine step.

Invariants:
    * A :class:`BlockTransfer` names consecutive blocks of one request's key
      chains, one chain per reader namespace (keys are rooted in their
      namespace, so TP ranks have distinct chains): ``keys[n][i]`` belongs
      in vLLM block ``block_ids[i]`` for namespace ``n``, and ``parents[n]``
      is the key just before ``keys[n][0]`` (None at the chain's start), so a
      save is a valid ``Store.put`` segment.
    * Loads of a step complete (or are reported failed) within that step;
      saves are copied out of the KV caches within that step.
    * Only plain values: vLLM ships this object to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to load or save this step."""

    req_id: str
    keys: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[int, ...]
    parents: tuple[bytes | None, ...] = ()

    def __post_init__(self) -> None:
        if any(len(chain) != len(self.block_ids) for chain in self.keys):
            raise ValueError(f"key chains do not match {len(self.block_ids)} block ids")


@dataclass
class UcmDbConnectorMetadata(KVConnectorMetadata):
    """All loads and saves of one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves
