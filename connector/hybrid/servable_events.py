"""KV cache events of attention groups of different block sizes: what a hit
would serve, as vLLM publishes its own cache of it (docs/events.md).

vLLM hashes a request at the gcd of its groups' block sizes, keys a larger
group's block by the hash at the block's last token
(``BlockHashListWithBlockSize``) and publishes each group's blocks at that
group's block size (``BlockPool.cache_full_blocks``), up to a multiple of
the lcm. ucm-db's hit from the store is the prefix every group holds whole,
cut to the lcm (hybrid/groups.py ``claim_step``). Each group's own change
feed (:class:`~ucm_db.connector.events.FeedEvents`) says what that group
holds; :class:`ServablePrefix` passes on only the blocks such a hit covers.

Invariants:
    * A group's block is announced exactly while it lies in an lcm unit
      ``(B - lcm, B]`` whose boundary ``B`` every group holds *rooted* (the
      block at ``B`` and each block before it on its chain, parents
      followed by vLLM hash): what a lookup of that prefix hits. A block
      shared by several prefixes is announced while any of their units is
      servable (counted per unit).
    * Every change of a group's feed (a save, an eviction by any process, a
      resync's or epoch change's withdrawal and replay) is applied before
      the step's events are derived, and the events are the difference of
      the announced set: ``BlockRemoved`` of each block that stopped being
      servable (the removal of any group's block withdraws every unit on
      its chain from there, in every group), ``BlockStored`` of each that
      became servable, parents first. A block evicted and stored again
      within one step says nothing.
    * A block a group holds without vLLM's fields (``ucm-db warm``, an
      older ucm-db) is a gap in that group's chain: the units after it are
      never announced (under-reported, never over-claimed).
    * Held per group: each evented block's parent, its tokens' end when
      rooted, and what its ``BlockStored`` needs beyond the group's (token
      ids packed by msgpack, LoRA, extra keys), so a block can be announced
      again after a withdrawal: about 650 bytes a block at 32 tokens (the
      event objects would take 1.6 KB). An inventory replay of 180,000
      blocks of two groups took 2.2 s in its step on a loaded 2-core host,
      0.9 s of it making the events (as ``FeedEvents`` makes its
      own); a step with nothing new costs nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

import msgspec
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent

_TOKENS = msgspec.msgpack.Decoder(list[int])


class GroupFeed(Protocol):
    """One group's events (:class:`~ucm_db.connector.events.FeedEvents`)."""

    @property
    def block_size(self) -> int: ...

    def take(self) -> list[KVCacheEvent]: ...


class _GroupChains:
    """One group's evented blocks by vLLM hash, which are rooted, and which
    are announced; the rooted blocks that end at a multiple of ``step`` are
    the boundaries."""

    def __init__(self, block_size: int, step: int) -> None:
        self.block_size = block_size
        self._step = step
        self._parent: dict[Hashable, Hashable | None] = {}
        # A block's packed token ids, LoRA id and name and extra keys; the rest is the group's (_template).
        self._stored: dict[Hashable, tuple[bytes, int | None, str | None, Any]] = {}
        self._template: BlockStored | None = None  # the group's first event: medium, group, block size, spec
        # Present blocks by parent (present or not); tuples, which the garbage collector stops tracking.
        self._children: dict[Hashable, tuple[Hashable, ...]] = {}
        self.end: dict[Hashable, int] = {}  # rooted blocks -> tokens at their end
        self.held: dict[Hashable, int] = {}  # announced blocks -> servable units holding them

    @property
    def group_idx(self) -> int | None:
        return None if self._template is None else self._template.group_idx

    def add(self, event: BlockStored, touched: set[Hashable]) -> None:
        """Adds the event's blocks; the boundaries they root go to ``touched``."""
        if self._template is None:
            self._template = msgspec.structs.replace(event, token_ids=[], extra_keys=None)
        parent = event.parent_block_hash
        size = event.block_size
        for i, block in enumerate(event.block_hashes):
            extra = event.extra_keys[i] if event.extra_keys else None
            tokens = msgspec.msgpack.encode(event.token_ids[i * size:(i + 1) * size])
            self._stored[block] = tokens, event.lora_id, event.lora_name, extra
            if block not in self._parent:
                self._parent[block] = parent
                if parent is not None:
                    self._children[parent] = self._children.get(parent, ()) + (block,)
                base = 0 if parent is None else self.end.get(parent)
                if base is not None:
                    self._root(block, base + self.block_size, touched)
            parent = block

    def remove(self, blocks: Iterable[Hashable], touched: set[Hashable]) -> None:
        """Removes the blocks; the boundaries no longer rooted go to ``touched``."""
        for block in blocks:
            if block not in self._parent:
                continue
            parent = self._parent.pop(block)
            del self._stored[block]
            siblings = tuple(child for child in self._children.pop(parent, ()) if child != block)
            if siblings:
                self._children[parent] = siblings
            stack = [block]  # its rooted descendants lose their root with it (a cycle ends at a popped end)
            while stack:
                one = stack.pop()
                end = self.end.pop(one, None)
                if end is not None:
                    if end % self._step == 0:
                        touched.add(one)
                    stack.extend(self._children.get(one, ()))

    def _root(self, block: Hashable, end: int, touched: set[Hashable]) -> None:
        stack = [(block, end)]
        while stack:
            one, one_end = stack.pop()
            if one in self.end:
                continue
            self.end[one] = one_end
            if one_end % self._step == 0:
                touched.add(one)
            stack.extend((child, one_end + self.block_size) for child in self._children.get(one, ()))

    def unit(self, boundary: Hashable) -> list[Hashable]:
        """The blocks of the ``step`` tokens ending at the rooted ``boundary``."""
        out: list[Hashable] = []
        block: Hashable | None = boundary
        for _ in range(self._step // self.block_size):
            assert block is not None
            out.append(block)
            block = self._parent[block]
        return out

    def hold(self, block: Hashable, delta: int) -> None:
        count = self.held.get(block, 0) + delta
        if count:
            self.held[block] = count
        else:
            del self.held[block]

    def event(self, block: Hashable) -> BlockStored:
        assert self._template is not None
        tokens, lora_id, lora_name, extra = self._stored[block]
        return msgspec.structs.replace(
            self._template, block_hashes=[block], parent_block_hash=self._parent[block], token_ids=_TOKENS.decode(tokens),
            lora_id=lora_id, lora_name=lora_name, extra_keys=None if extra is None else [extra],
        )


class ServablePrefix:
    """The events of attention groups of different block sizes (module docstring)."""

    def __init__(self, sources: Sequence[GroupFeed]) -> None:
        """``sources``: each attention group's feed events, in group order."""
        self._sources = list(sources)
        self._step = math.lcm(*(s.block_size for s in sources))
        self._chains = [_GroupChains(s.block_size, self._step) for s in sources]
        # Servable boundary -> the blocks of its unit, each group's in group order (step // block size of each).
        self._units: dict[Hashable, tuple[Hashable, ...]] = {}
        self._unit_groups = [index for index, chains in enumerate(self._chains) for _ in range(self._step // chains.block_size)]

    def take(self) -> list[KVCacheEvent]:
        """The step's changes of the announced blocks (module invariants)."""
        touched: set[Hashable] = set()
        for source, chains in zip(self._sources, self._chains):
            for event in source.take():
                if isinstance(event, BlockStored):
                    chains.add(event, touched)
                elif isinstance(event, BlockRemoved):
                    chains.remove(event.block_hashes, touched)
        before: dict[tuple[int, Hashable], bool] = {}  # each block whose holders changed: was it announced
        for boundary in touched:
            servable = self._servable(boundary)
            if servable == (boundary in self._units):
                continue
            unit = (tuple(b for chains in self._chains for b in chains.unit(boundary)) if servable
                    else self._units.pop(boundary))
            if servable:
                self._units[boundary] = unit
            for index, block in zip(self._unit_groups, unit):
                chains = self._chains[index]
                before.setdefault((index, block), block in chains.held)
                chains.hold(block, 1 if servable else -1)
        return self._events(before)

    def _servable(self, boundary: Hashable) -> bool:
        ends = {chains.end.get(boundary) for chains in self._chains}
        end = ends.pop() if len(ends) == 1 else None  # one prefix, so one end in every group
        return end is not None and end % self._step == 0

    def _events(self, before: dict[tuple[int, Hashable], bool]) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        removed: dict[int, list[Any]] = {}
        stored: list[tuple[int, int, Hashable]] = []
        for (index, block), was in before.items():
            now = block in self._chains[index].held
            if was and not now:
                removed.setdefault(index, []).append(block)
            elif now and not was:
                stored.append((index, self._chains[index].end[block], block))
        for index in sorted(removed):
            events.append(BlockRemoved(block_hashes=sorted(removed[index], key=repr), medium=MEDIUM_STORAGE,
                                       group_idx=self._chains[index].group_idx))
        events.extend(self._chains[index].event(block) for index, _, block in sorted(stored, key=lambda s: s[:2]))
        return events
