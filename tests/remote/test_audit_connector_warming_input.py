"""Bad input to the connector's warming is a ConfigError with a hint, before
anything runs or is stored (audit: ``import_kv`` took a block id of 1.5, or
True, as block 1 and stored that block's KV under the prompt's keys;
``warm_engine`` ran a dict without ``ids`` into a bare KeyError, and a
string's characters as token ids, after the prompts before it had run).

``warm_engine`` checks every prompt before its first request, so ``llm``
here is never reached (None: no engine is needed to see the refusal; the
real engine path is tests/vllm/test_connector_e2e.py). ``import_kv`` runs
on real CPU tensors and a real LMDB store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ucm_db  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.connector.warming import import_kv, warm_engine  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402
from ucm_db.keys import Namespace  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BLOCK = 32
NS = Namespace(model="audit-import", kv_dtype="bfloat16", block_size=BLOCK, layout="cpu:2x[8,2,32,128]")


@pytest.mark.parametrize("bad", [1.5, True, "1"])
def test_import_kv_refuses_a_block_id_that_is_not_an_int(tmp_path: Path, bad: Any) -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn((8, 2, BLOCK, 128)).to(torch.bfloat16) for i in range(2)}
    layout = detect_layout(caches, 8)
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        with pytest.raises(ConfigError, match="block ids must be ints") as caught:
            import_kv(store, NS, layout, list(range(BLOCK)), [bad])
        assert caught.value.hint
        assert store.stats().blocks == 0  # nothing imported (before: block 1's KV, one unit a KV head)


@pytest.mark.parametrize("prompts", [
    [[1, 2, 3], {"tokens": [1, 2, 3]}],
    [[1, 2, 3], "hello"],
    [[1, 2, 3], {"ids": [1, 2], "salt": "x"}],
    [[1, 2, 3], {"ids": [1, 2], "cache_salt": 7}],
    [[1, 2, 3], [1, -2]],
    [[1, 2, 3], []],
], ids=["no-ids", "string", "unknown-key", "salt-not-str", "negative", "empty"])
def test_warm_engine_refuses_a_malformed_prompt_before_running_any(prompts: list[Any]) -> None:
    with pytest.raises(ConfigError, match="warm_engine prompt 1") as caught:
        warm_engine(None, prompts)  # never reached: the check runs first
    assert "ids" in caught.value.hint
