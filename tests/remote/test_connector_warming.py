"""Importing KV computed elsewhere through the connector's layout code, then
sharing it through the remote tier (torch on CPU; no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ucm_db  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.connector.warming import import_kv  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402
from ucm_db.keys.units import KVGrid, UnitKeys  # noqa: E402

pytestmark = pytest.mark.timeout(60)
BLOCK = 32
NUM_BLOCKS = 8


def _cpu_caches(seed: int, fill: bool = True) -> dict[str, torch.Tensor]:
    """Two layers in the vLLM CPU layout [blocks, kv_heads, block, 2*head]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, 2, BLOCK, 128)
    make = (lambda: torch.randn(shape, generator=gen).to(torch.bfloat16)) if fill else (lambda: torch.zeros(shape, dtype=torch.bfloat16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(2)}


def test_imported_kv_loads_back_into_another_cache_through_the_remote(tmp_path: Path) -> None:
    namespace = Namespace(model="import-test", kv_dtype="bfloat16", block_size=BLOCK, layout="cpu:2x[8,2,32,128]")
    source = _cpu_caches(seed=1)
    layout = detect_layout(source, NUM_BLOCKS)
    tokens = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks and a partial one
    remote = f"file://{tmp_path}/shared"
    with ucm_db.open(tmp_path / "importer", capacity_bytes=64 << 20, remote=remote) as importer:
        result = import_kv(importer, namespace, layout, tokens, [5, 2, 7], extras={"cache_salt": "t1"})
        assert result.stored == 3 * 2  # units: one per KV head of each block
        with pytest.raises(ConfigError, match="block ids"):
            import_kv(importer, namespace, layout, tokens, [1, 2])
        importer.flush(upload_timeout_s=30)

    with ucm_db.open(tmp_path / "node-b", capacity_bytes=64 << 20, remote=remote) as node_b:
        assert node_b.warm(namespace, token_sequences=[tokens]).missing == 3  # other extras: other keys
        keys = namespace.block_keys(tokens, {"cache_salt": "t1"})
        grid = KVGrid(2, 2)
        payloads = []
        for span in grid.head_spans():  # each head's units: a chain of their own
            unit_keys = list(UnitKeys(keys, grid, span))
            report = node_b.warm(namespace, keys=unit_keys)
            assert (report.fetched, report.missing) == (3, 0)
            payloads.append(node_b.get(namespace, unit_keys))
    target = _cpu_caches(seed=0, fill=False)
    target_layout = detect_layout(target, NUM_BLOCKS)
    staging = target_layout.new_unit_staging(3)
    for head, units in enumerate(payloads):
        for i, payload in enumerate(units):
            assert payload is not None
            staging[i, head].copy_(torch.frombuffer(payload, dtype=torch.uint8))
    target_layout.scatter_units([0, 1, 4], staging)
    for name in source:
        for src_block, dst_block in ((5, 0), (2, 1), (7, 4)):
            assert torch.equal(source[name][src_block], target[name][dst_block])
        assert not target[name][2].any()  # untouched blocks stay zero
