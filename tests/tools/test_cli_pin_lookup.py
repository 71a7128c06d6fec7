"""``ucm-db pin``, ``unpin`` and ``lookup`` through CliRunner: prompts keyed
at the namespace's epoch, whole-model units in a store of units, the
max_pinned_bytes refusal, pinned bytes in ``inspect``, and usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import ucm_db
from ucm_db import Namespace
from ucm_db.keys.units import UnitKeys
from ucm_db.store.presence import whole_model_units

from cli_stores import invoke, invoke_json

NS = Namespace(model="cli/pins", kv_dtype="bfloat16", block_size=16)
UNITS_NS = Namespace(model="cli/units", kv_dtype="bfloat16", block_size=16, layout=json.dumps(
    {"platform": "cpu", "spec": "FullAttentionSpec", "layers": 4, "kv_heads": 2, "head_size": 8, "cache_dtype": "auto"},
    sort_keys=True, separators=(",", ":")))
SYSTEM = list(range(1000, 1000 + 16 * 20))  # 20 blocks
OTHER_PROMPT = list(range(5000, 5000 + 16 * 6 + 7))  # 6 full blocks and a partial one


def write_prompts(path: Path, *prompts: list[int]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def make(path: Path, **options) -> None:
    with ucm_db.open(path, codec="none", capacity_bytes=4 << 20, **options) as store:
        epoch = store.epoch(NS)
        for tokens, blocks in ((SYSTEM, 20), (OTHER_PROMPT, 3)):
            keys = NS.block_keys(tokens, epoch=epoch)[:blocks]
            store.put(NS, keys, [bytes([i]) * 8192 for i in range(blocks)])


def test_pin_lookup_unpin_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM, OTHER_PROMPT, [1, 2, 3])
    found = invoke_json("lookup", path, "--namespace", "cli/pins", "--tokens", prompts)
    assert [(p["blocks"], p["stored_blocks"], p["stored_tokens"]) for p in found["prompts"]] == [(20, 20, 320), (6, 3, 48), (0, 0, 0)]
    assert found["units"] is None and found["epoch"] == 0
    pinned = invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", prompts)
    assert [p["pinned_blocks"] for p in pinned["prompts"]] == [20, 3, 0]
    assert pinned["changed_blocks"] == 23 == pinned["namespace_blocks"] and pinned["store_bytes"] > 23 * 8192
    report = invoke_json("inspect", path)
    assert report["pinned_bytes"] == pinned["store_bytes"] == report["namespaces"][0]["pinned_bytes"]
    assert "pinned" in invoke("inspect", path).stdout
    human = invoke("unpin", path, "--namespace", "cli/pins", "--tokens", write_prompts(tmp_path / "q.jsonl", OTHER_PROMPT)).stdout
    assert "unpinned 3 stored blocks" in human
    assert invoke_json("inspect", path)["namespaces"][0]["pinned_blocks"] == 20
    assert "prompt 2: 103 tokens, 6 blocks; stored 3 blocks (48 tokens)" in invoke(
        "lookup", path, "--namespace", "cli/pins", "--tokens", prompts).stdout


def test_a_pin_over_max_pinned_bytes_exits_1_naming_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    error = invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", prompts, "--max-pinned-bytes", "64KiB", expect=1)["error"]
    assert error["type"] == "StoreFullError" and "max_pinned_bytes=65536" in error["message"]
    assert invoke_json("inspect", path)["pinned_bytes"] == 0
    assert invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", prompts, "--max-pinned-bytes", "1MiB")["changed_blocks"] == 20


def test_invalidate_releases_pins_and_lookups_key_at_the_new_epoch(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", prompts)
    invoke_json("invalidate", path, "--namespace", "cli/pins")
    assert invoke_json("inspect", path)["pinned_bytes"] == 0
    found = invoke_json("lookup", path, "--namespace", "cli/pins", "--tokens", prompts)
    assert found["epoch"] == 1 and found["prompts"][0]["stored_blocks"] == 0


def test_a_store_of_units_answers_in_whole_model_units(tmp_path: Path) -> None:
    path = tmp_path / "s"
    grid, spans = whole_model_units(UNITS_NS)
    with ucm_db.open(path, codec="none", capacity_bytes=4 << 20) as store:
        keys = UNITS_NS.block_keys(SYSTEM, epoch=store.epoch(UNITS_NS))
        for head, span in enumerate(spans):
            stored = 20 if head == 0 else 12  # head 1 lags: a block counts only with both heads
            units = list(UnitKeys(keys, grid, span, 0, stored))
            store.put(UNITS_NS, ucm_db.BlockKeys(units, parent=None), [b"u" * 4096] * stored)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    found = invoke_json("lookup", path, "--namespace", "cli/units", "--tokens", prompts)
    assert found["units"] == {"kv_heads": 2, "layers": 4, "units_per_block": 2, "stages": [[0, 4]]}
    assert found["prompts"][0]["stored_blocks"] == 12
    assert invoke_json("lookup", path, "--namespace", "cli/units", "--tokens", prompts, "--layer-partition", "2,2")[
        "prompts"][0]["stored_blocks"] == 0  # units of two stages: none written so
    pinned = invoke_json("pin", path, "--namespace", "cli/units", "--tokens", prompts)
    assert pinned["prompts"][0]["pinned_blocks"] == 12 and pinned["changed_blocks"] == 32  # every head's units
    assert "units: 2 KV heads" in invoke("unpin", path, "--namespace", "cli/units", "--tokens", prompts).stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    assert "no namespace matches" in invoke("lookup", path, "--namespace", "nope", "--tokens", prompts, expect=2).stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[1, 2, "x"]\n')
    assert "line 1" in invoke("pin", path, "--namespace", "cli/pins", "--tokens", bad, expect=2).stderr
    assert invoke("lookup", path, "--namespace", "cli/pins", "--tokens", prompts, "--layer-partition", "a,b", expect=2)
    assert invoke("pin", tmp_path / "nothing", "--namespace", "x", "--tokens", prompts, expect=2)
    assert not (tmp_path / "nothing").exists()
