"""docs/api.md: namespaces never mix, ``get_into`` included. The
connector's loads go through ``ScatterSlabs``, which the store reads on a
native path (``ucm_db.codec.batch_loads``: ``_native.plan_units`` checks
each block's namespace in C, then ``load_units`` copies). A read under
another namespace of the same keys must load nothing: a bug there would put
another model's KV into the cache, wrong tensors rather than a miss. The
native calls are counted (instrumentation, not a stand-in) to prove the
path under test is the native one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import Framed, Namespace, ScatterSlabs
from ucm_db.codec import batch_loads, native

NS = Namespace(model="isolation", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="isolation-other", kv_dtype="bfloat16", block_size=4)
BLOCKS, FRAME_BYTES = 40, 2048


class _Counted:
    """The native extension, counting its batch calls."""

    def __init__(self, extension: Any, calls: dict[str, int]) -> None:
        self._extension, self._calls = extension, calls

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._extension, name)
        if name not in ("plan_units", "load_units"):
            return function

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            return function(*args, **kwargs)
        return counted


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_scatter_load_under_another_namespace_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              codec: str) -> None:
    extension = native.extension()
    assert extension is not None, "the native extension is not built (test_native.py says why)"
    calls = {"plan_units": 0, "load_units": 0}
    monkeypatch.setattr(batch_loads.native, "extension", lambda: _Counted(extension, calls))
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 1 << 16, 2 * FRAME_BYTES // 2, dtype=np.uint16).tobytes() for _ in range(BLOCKS)]
    keys = NS.block_keys(list(range(4 * BLOCKS)))
    layers = [np.zeros(FRAME_BYTES * BLOCKS, dtype=np.uint8) for _ in range(2)]
    slabs = ScatterSlabs([layer.data for layer in layers], [FRAME_BYTES, FRAME_BYTES], list(range(BLOCKS)))
    with ucm_db.open(tmp_path / "s", codec=codec) as store:
        store.put(NS, keys, [Framed(p, (FRAME_BYTES, FRAME_BYTES)) for p in payloads])
        assert sum(map(bool, store.get_into(NS, keys, slabs))) == BLOCKS  # learns the blocks' raw tables
        assert sum(map(bool, store.get_into(NS, keys, slabs))) == BLOCKS and calls["load_units"] > 0, calls
        assert all(bytes(layers[0][i * FRAME_BYTES:(i + 1) * FRAME_BYTES]) == payloads[i][:FRAME_BYTES] for i in range(BLOCKS))
        for layer in layers:
            layer[:] = 0
        planned = calls["plan_units"]
        found = store.get_into(OTHER, keys, slabs)
        assert calls["plan_units"] > planned, "the read under the other namespace took another path"
        assert not any(found), "blocks of another namespace were loaded"
        assert not any(layer.any() for layer in layers), "bytes of another namespace reached the slabs"
        assert store.lookup(OTHER, keys) == 0 and store.lookup(NS, keys) == BLOCKS
