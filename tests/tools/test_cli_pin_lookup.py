"""``ucm-db pin``, ``unpin`` and ``lookup`` through CliRunner: prompts keyed
at the namespace's epoch, whole-model units in a store of units, the
max_pinned_bytes refusal, pinned bytes in ``inspect``, and usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.keys.units import UnitKeys
from ucm_db.store.presence import whole_model_units
from ucm_db.tools.remote_cmds import parse_size_bytes

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


def stored_state(path: Path) -> tuple[int, int, int]:
    """(blocks, stored bytes, pinned bytes): what a refused command must leave as it was."""
    report = invoke_json("inspect", path)
    return report["blocks"], report["stored_bytes"], report["pinned_bytes"]


@pytest.mark.parametrize(("text", "expected"), [
    ('[0, 1, 2, 3]\n\n["a"]\n', "line 3: not a JSON list of integers"),  # a blank line counted, as an editor does
    ("[1, 2]\n\n\n[x]\n", "line 4: column 2: Expecting value"),  # each line parsed on its own
    ("[0, 1, 2, 3]\n[-1, 2, 3, 4]\n", "line 2: token id -1 is out of range"),
    ("[4294967296]\n", "line 1: token id 4294967296 is out of range"),
])
@pytest.mark.parametrize("command", ["pin", "lookup"])
def test_a_bad_tokens_line_is_named_by_file_and_real_line_number(tmp_path: Path, command: str, text: str, expected: str) -> None:
    """Audit F11: blank lines were not counted, a JSON error gave the position
    in the joined text, and an out-of-range id named neither file nor line."""
    path = tmp_path / "s"
    make(path)
    before = stored_state(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    error = invoke_json(command, path, "--namespace", "cli/pins", "--tokens", bad, expect=2)["error"]
    assert error["type"] == "ConfigError" and error["message"].startswith(f"cannot read {bad} {expected}"), error
    assert error["hint"]
    assert stored_state(path) == before


@pytest.mark.parametrize("command", ["pin", "unpin", "lookup"])
def test_namespace_given_twice_is_refused_not_the_last_kept(tmp_path: Path, command: str) -> None:
    """Audit F12: `pin --namespace a --namespace b` pinned in b alone, silently."""
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    before = stored_state(path)
    result = invoke(command, path, "--namespace", "nope", "--namespace", "cli/pins", "--tokens", prompts, expect=2)
    assert f"{command} takes one --namespace, got 2: 'nope', 'cli/pins'" in result.stderr
    assert f"run `ucm-db {command}` once per namespace" in result.stderr
    assert stored_state(path) == before


@pytest.mark.parametrize("partition", ["-1,5", "0", "14,,14", "x"])
def test_a_bad_layer_partition_is_refused_for_a_namespace_of_whole_blocks_too(tmp_path: Path, partition: str) -> None:
    """Audit F16: it was checked only in a namespace of units, and ignored elsewhere."""
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    result = invoke("lookup", path, "--namespace", "cli/pins", "--tokens", prompts, "--layer-partition", partition, expect=2)
    assert f"--layer-partition '{partition}'" in result.stderr and "e.g. --layer-partition 14,14" in result.stderr


def test_max_pinned_bytes_is_read_exactly_and_a_fraction_of_a_byte_refused(tmp_path: Path) -> None:
    """Audit F16: `--max-pinned-bytes 0.5` became a cap of 0, and sizes went
    through a float (9007199254740993 read as ...992)."""
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM)
    result = invoke("pin", path, "--namespace", "cli/pins", "--tokens", prompts, "--max-pinned-bytes", "0.5", expect=2)
    assert "size '0.5' is less than one byte" in result.stderr and "10GiB" in result.stderr
    assert stored_state(path)[2] == 0
    assert parse_size_bytes("9007199254740993") == 9007199254740993 == 2**53 + 1
    assert parse_size_bytes("1.5KiB") == 1536 and parse_size_bytes("0") == 0


@pytest.mark.parametrize("text", ["", "\n\n", "[]\n", "[]\n\n[]\n"])
def test_pin_with_no_prompts_exits_2(tmp_path: Path, text: str) -> None:
    """Audit F17: an empty file (a failed generator step) pinned nothing, exit 0."""
    path = tmp_path / "s"
    make(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    error = invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", empty, expect=2)["error"]
    assert error["message"] == f"{empty} holds no prompts: no line with a token id" and "one JSON list" in error["hint"]
    assert stored_state(path)[2] == 0


def test_pin_warns_of_a_prompt_shorter_than_one_block(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make(path)
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM, [1, 2, 3])
    result = invoke("pin", path, "--namespace", "cli/pins", "--tokens", prompts)
    assert f"warning: prompt 2 of {prompts} has 3 tokens, less than one block of 16" in result.stderr
    assert "pinned 20 stored blocks" in result.stdout


def test_unpin_of_a_prompt_held_by_another_pin_warns(tmp_path: Path) -> None:
    """A pin is taken back only by the prompt that made it: unpinning a
    shorter prompt under a pinned one releases nothing, and the CLI says why
    on stderr instead of a silent exit 0 that left the blocks pinned."""
    path = tmp_path / "s"
    make(path)
    invoke_json("pin", path, "--namespace", "cli/pins", "--tokens", write_prompts(tmp_path / "p.jsonl", SYSTEM))
    result = invoke("unpin", path, "--namespace", "cli/pins", "--tokens", write_prompts(tmp_path / "q.jsonl", SYSTEM[:16 * 8]))
    assert "stays pinned (8 blocks)" in result.stderr and "given as it was pinned" in result.stderr
    assert invoke_json("inspect", path)["namespaces"][0]["pinned_blocks"] == 20
