"""A ``--tokens`` file without a prompt is refused by every command that
reads one (``pin``, ``unpin``, ``lookup``, ``warm``): each would otherwise
do nothing and exit 0, hiding a failed step that wrote the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import ucm_db
from cli_stores import invoke


@pytest.mark.parametrize("command", ["pin", "unpin", "lookup", "warm"])
@pytest.mark.parametrize("content", ["", "\n\n", "[]\n"])
def test_a_tokens_file_without_prompts_is_refused(tmp_path: Path, command: str, content: str) -> None:
    store = tmp_path / "store"
    namespace = ucm_db.Namespace(model="empty/files", kv_dtype="bfloat16", block_size=16)
    with ucm_db.open(store, codec="none", capacity_bytes=4 << 20) as s:
        s.put(namespace, namespace.block_keys(list(range(16)), epoch=s.epoch(namespace)), [b"x" * 64])
    tokens = tmp_path / "p.jsonl"
    tokens.write_text(content)
    args = [command, str(store), "--namespace", "empty/files", "--tokens", str(tokens)]
    if command == "warm":
        remote = tmp_path / "remote"
        remote.mkdir()
        args += ["--remote", f"file://{remote}"]
    result = invoke(*args, expect=2)
    assert "holds no prompts" in result.stderr
