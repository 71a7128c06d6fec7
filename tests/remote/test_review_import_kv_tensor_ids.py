"""Review of c19c877 (warm_engine/import_kv check their input):
reproduction, fixed.

``import_kv`` now refuses block ids that are not ``numbers.Integral``; the
elements of a torch tensor of block ids (how vLLM holds block tables) are
0-d tensors, not Integral, so ``import_kv(..., torch.tensor([2, 0]))``, which the
code before c19c877 stored (2 blocks, 4 units), is now a ConfigError "block ids must be
ints >= 0, got [tensor(2), tensor(0)]". Real CPU tensors, a real LMDB store,
as test_audit_connector_warming_input.py.

Suggested fix (connector/warming.py, _is_token_id): accept what
``operator.index`` accepts (numpy and 0-d integer torch scalars; 1.5 and
float tensors still raise), bools and bool tensors still refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ucm_db  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.connector.warming import import_kv  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BLOCK = 32
NS = Namespace(model="review-import-tensor", kv_dtype="bfloat16", block_size=BLOCK, layout="cpu:2x[8,2,32,128]")


def test_import_kv_takes_block_ids_as_a_tensor(tmp_path: Path) -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn((8, 2, BLOCK, 128)).to(torch.bfloat16) for i in range(2)}
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        result = import_kv(store, NS, detect_layout(caches, 8), list(range(2 * BLOCK)), torch.tensor([2, 0]))
        assert result.stored == 2 * 2  # two blocks, one unit per KV head


def test_import_kv_takes_numpy_block_ids(tmp_path: Path) -> None:
    import numpy as np

    caches = {f"model.layers.{i}.self_attn.attn": torch.randn((8, 2, BLOCK, 128)).to(torch.bfloat16) for i in range(2)}
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        result = import_kv(store, NS, detect_layout(caches, 8), list(range(2 * BLOCK)), np.array([5, 1], dtype=np.int32))
        assert result.stored == 2 * 2
        assert store.stats().blocks == 4  # stored: 2 blocks x 2 heads


@pytest.mark.parametrize("bad", ["float", "bool", "negative"])
def test_import_kv_still_refuses_float_bool_and_negative_tensor_ids(tmp_path: Path, bad: str) -> None:
    ids = {"float": torch.tensor([2.0, 0.0]), "bool": torch.tensor([True, False]), "negative": torch.tensor([2, -1])}[bad]
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn((8, 2, BLOCK, 128)).to(torch.bfloat16) for i in range(2)}
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        with pytest.raises(ConfigError, match="block ids must be ints"):
            import_kv(store, NS, detect_layout(caches, 8), list(range(2 * BLOCK)), ids)
        assert store.stats().blocks == 0  # nothing imported
