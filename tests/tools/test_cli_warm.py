"""`ucm-db warm` pulls chains from a real file:// remote into an empty store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ucm_db

from cli_stores import NS_A, payload, invoke, invoke_json


def test_warm_from_remote_by_tokens(tmp_path: Path) -> None:
    pytest.importorskip("ucm_db.remote.warming", reason="the warming API (ucm_db/remote/warming.py) has not landed")
    url = f"file://{tmp_path / 'remote'}"
    prompts = [[(7 * p + i) % 30000 for i in range(NS_A.block_size * 4)] for p in range(3)]
    with ucm_db.open(tmp_path / "a", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as source:
        for p, tokens in enumerate(prompts):
            keys = NS_A.block_keys(tokens)
            source.put(NS_A, keys, [payload(f"w{p}", i) for i in range(len(keys))])
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text("\n".join(json.dumps(t) for t in prompts))
    ucm_db.open(tmp_path / "b", capacity_bytes=1 << 26).close()

    invoke_json("warm", tmp_path / "b", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file)
    with ucm_db.open(tmp_path / "b") as store:
        for p, tokens in enumerate(prompts):
            keys = NS_A.block_keys(tokens)
            assert store._tier.count_prefix(keys) == 4  # local now, no remote configured here
            assert store.get(NS_A, keys) == [bytearray(payload(f"w{p}", i)) for i in range(4)]


def test_warm_needs_tokens_or_keys(tmp_path: Path) -> None:
    result = invoke("warm", tmp_path, "--remote", "memory://x", "--namespace", "m", expect=2)
    assert "--tokens FILE or --keys FILE" in result.stderr


@pytest.mark.parametrize("under", ["", "sub"])
def test_warm_into_a_file_is_a_usage_error(tmp_path: Path, under: str) -> None:
    """Audit F14: a store path that is a file (or has one on its way) exited
    1 for warm alone; every other command exits 2."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    target = afile / under if under else afile
    url = f"file://{tmp_path / 'remote'}"
    tokens = list(range(NS_A.block_size * 2))
    with ucm_db.open(tmp_path / "a", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as source:
        source.put(NS_A, NS_A.block_keys(tokens), [payload("f", i) for i in range(2)])
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text(json.dumps(tokens))
    error = invoke_json("warm", target, "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file, expect=2)["error"]
    where = "it is a file" if not under else f"{afile} on its path is a file"
    assert error["type"] == "ConfigError" and error["message"] == f"cannot warm into {target}: {where}, not a directory"
    assert "a store is a directory" in error["hint"]
    assert afile.read_text() == "keep me"


def test_warm_takes_one_namespace(tmp_path: Path) -> None:
    """``--namespace`` given twice is refused (click kept the last one without a word), as for pin and lookup."""
    tokens = tmp_path / "t.jsonl"
    tokens.write_text("[1, 2, 3, 4]\n")
    result = invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path}/r", "--namespace", "a", "--namespace", "b",
                    "--tokens", tokens, expect=2)
    assert "one --namespace" in result.output
    assert not (tmp_path / "s").exists()
