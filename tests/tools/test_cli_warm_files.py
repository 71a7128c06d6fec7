"""`ucm-db warm --tokens/--keys` reads UTF-8 files and UTF-8/16/32 files with a
byte-order mark; any other bytes are a clear error naming the file (issue 26, item 13)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ucm_db

from cli_stores import NS_A, invoke, invoke_json, payload


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_warm_reads_a_tokens_file_with_a_byte_order_mark(tmp_path: Path, encoding: str) -> None:
    url = f"file://{tmp_path / 'remote'}"
    tokens = [(11 * i) % 30000 for i in range(NS_A.block_size * 3)]
    keys = NS_A.block_keys(tokens)
    with ucm_db.open(tmp_path / "a", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as source:
        source.put(NS_A, keys, [payload("bom", i) for i in range(3)])
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_bytes(json.dumps(tokens).encode(encoding))  # as PowerShell's `>` writes (UTF-16 LE + BOM)
    assert tokens_file.read_bytes()[:2] in (b"\xff\xfe", b"\xef\xbb")

    invoke_json("warm", tmp_path / "b", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file)
    with ucm_db.open(tmp_path / "b") as store:
        assert store.get(NS_A, keys) == [bytearray(payload("bom", i)) for i in range(3)]


@pytest.mark.parametrize("option", ["--tokens", "--keys"])
def test_warm_refuses_a_file_that_is_not_utf8_naming_it_and_the_fix(tmp_path: Path, option: str) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("[1, 2]\n# café\n".encode("latin-1"))
    result = invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "m", option, bad, expect=2)
    assert f"cannot read {bad}: it is not valid UTF-8 text (byte 12: invalid continuation byte)" in result.stderr
    assert "iconv" in result.stderr
    assert not (tmp_path / "s").exists()


def test_warm_refuses_broken_utf16_after_its_byte_order_mark(tmp_path: Path) -> None:
    bad = tmp_path / "odd.txt"
    bad.write_bytes(b"\xff\xfe[\x001\x00]")  # odd length: the last code unit is cut
    result = invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "m", "--tokens", bad, expect=2)
    assert "is not valid UTF-16 text" in result.stderr


def test_warm_names_the_file_and_line_of_a_short_key(tmp_path: Path) -> None:
    """Audit F11: "block keys are 32 bytes, got 2" named neither file nor line."""
    keys = tmp_path / "chains.txt"
    keys.write_text(f"{'ab' * 32}\n\n{'cd' * 32} 0102\n")
    result = invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "m", "--keys", keys, expect=2)
    assert f"cannot read {keys} line 3: key '0102' is 2 bytes; block keys are 32" in result.stderr
    assert "64 hex digits per key, one chain per line" in result.stderr
    assert not (tmp_path / "s").exists()


def test_warm_names_the_file_and_line_of_an_out_of_range_token(tmp_path: Path) -> None:
    tokens = tmp_path / "prompts.jsonl"
    tokens.write_text("[1, 2]\n\n[3, -4]\n")
    result = invoke("warm", tmp_path / "s", "--remote", f"file://{tmp_path / 'r'}", "--namespace", "m", "--tokens", tokens, expect=2)
    assert f"cannot read {tokens} line 3: token id -4 is out of range" in result.stderr
    assert not (tmp_path / "s").exists()
