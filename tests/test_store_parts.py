"""The Store holds its parts (issue 47 item 2): writes, reads, the change
feed and epochs, pins and presence queries are plain classes built on one
:class:`~ucm_db.store.state.StoreState`, not mixins over a shared base.

* Each part can be built and used alone, on a state opened by itself.
* No part inherits anything, and none touches the state's (or another
  part's) private members: the state's public members are the parts'
  whole interface.
* The Store's method of each part's operation is that operation as users
  know it: the same parameters, defaults and annotations, and the part's
  docstring (``help(ucm_db.Store.put)`` documents put).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.store.feed import StoreFeed
from ucm_db.store.opening import open_store
from ucm_db.store.pinning import StorePins
from ucm_db.store.presence import StorePresence
from ucm_db.store.reads import StoreReads
from ucm_db.store.state import StoreState
from ucm_db.store.writes import StoreWrites

PARTS = (StoreWrites, StoreReads, StoreFeed, StorePins, StorePresence)
STORE_DIR = Path(ucm_db.store.__file__).parent
NS = Namespace(model="test/store-parts", kv_dtype="bfloat16", block_size=4)


def _operations(part: type) -> list[str]:
    return [name for name, value in vars(part).items() if not name.startswith("_") and inspect.isfunction(value)]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_the_store_hands_each_operation_to_its_part_as_documented(part: type) -> None:
    assert _operations(part)
    for name in _operations(part):
        store_method = getattr(ucm_db.Store, name)
        assert inspect.signature(store_method) == inspect.signature(getattr(part, name)), name
        assert store_method.__doc__ == getattr(part, name).__doc__ and store_method.__doc__, name


def test_parts_and_store_inherit_nothing() -> None:
    for cls in (*PARTS, StoreState, ucm_db.Store):
        assert cls.__mro__ == (cls, object), cls


def test_parts_use_the_states_public_members_only() -> None:
    """No module of the store reaches into ``_``-members of anything but
    ``self`` (and its class): the state, the parts, the tier and the wing
    are used through their public members."""
    reached = []
    for path in sorted(STORE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                reached.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert reached == []


def test_a_part_is_built_and_used_on_a_state_alone(tmp_path: Path) -> None:
    state = StoreState(open_store(tmp_path / "s", {}))
    try:
        keys = NS.block_keys(list(range(12)))
        payloads = [bytes([i]) * 256 for i in range(3)]
        assert StoreWrites(state).put(NS, keys, payloads).stored == 3
        assert StoreReads(state).get(NS, keys) == payloads
        assert StorePresence(state).lookup_many(NS, [keys, keys[:1]]) == [3, 1]
        assert StoreFeed(state).epoch(NS) == 0
        assert StorePins(state).pin(NS, keys).chains == (3,)
    finally:
        state.close()
    with pytest.raises(ucm_db.ClosedError):
        StoreReads(state).get(NS, keys)
