"""A store filled by ``ucm-db warm`` is administered like any other (audit:
its namespace had no description, so ``lookup``, ``invalidate`` and
``export`` could not name it: "no namespace matches 'test/alpha' (... the
store has: none)", and its export wrote ``{}``, which import refused).
A real file:// remote, real LMDB stores, the CLI through CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import ucm_db

from cli_stores import NS_A, invoke, invoke_json, payload


def _warmed_store(tmp_path: Path) -> tuple[Path, list[int]]:
    url = f"file://{tmp_path / 'remote'}"
    tokens = [(11 * i + 3) % 30000 for i in range(NS_A.block_size * 4)]
    with ucm_db.open(tmp_path / "a", remote=url, remote_mode="write_through", capacity_bytes=1 << 26) as source:
        keys = NS_A.block_keys(tokens)
        source.put(NS_A, keys, [payload("warmed", i) for i in range(len(keys))])
    (tmp_path / "prompts.jsonl").write_text(json.dumps(tokens) + "\n")
    invoke_json("warm", tmp_path / "b", "--remote", url, "--namespace", "test/alpha", "--tokens", tmp_path / "prompts.jsonl")
    return tmp_path / "b", tokens


def test_a_warmed_namespace_is_looked_up_and_invalidated_by_model(tmp_path: Path) -> None:
    path, tokens = _warmed_store(tmp_path)
    looked = invoke_json("lookup", path, "--namespace", "test/alpha", "--tokens", tmp_path / "prompts.jsonl")
    assert looked["prompts"][0]["stored_blocks"] == 4
    # Through the remote it warmed from (the store shares the namespace with it): claimed there, the plain count.
    report = invoke_json("invalidate", path, "--namespace", "test/alpha", "--remote", f"file://{tmp_path / 'remote'}")
    assert report == {"invalidated": [{"namespace": NS_A.id.hex(), "model": "test/alpha", "epoch": 1, "remote": "claimed"}]}
    with ucm_db.open(path) as store:
        assert store.epoch(NS_A) == 1
        assert store.lookup(NS_A, NS_A.block_keys(tokens, epoch=1)) == 0


def test_a_warmed_store_exports_and_imports(tmp_path: Path) -> None:
    path, tokens = _warmed_store(tmp_path)
    invoke("export", path, tmp_path / "warmed.tar")
    invoke("import", tmp_path / "warmed.tar", tmp_path / "c")
    with ucm_db.open(tmp_path / "c") as store:
        assert store.get(NS_A, NS_A.block_keys(tokens)) == [bytearray(payload("warmed", i)) for i in range(4)]
        assert store.stats().namespaces[NS_A.id.hex()].description == NS_A.to_dict()
