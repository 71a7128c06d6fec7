"""``ucm-db invalidate``: an operator's invalidation after a weight update."""

from __future__ import annotations

from pathlib import Path

import ucm_db

from cli_stores import NS_A, NS_B, chain_keys, invoke, invoke_json, make_store


def test_invalidate_moves_the_epoch_on_and_old_blocks_stop_matching(tmp_path: Path) -> None:
    path = tmp_path / "s"
    chains = make_store(path)
    report = invoke_json("invalidate", path, "--namespace", "test/alpha")
    assert report == {"invalidated": [{"namespace": NS_A.digest[:16].hex(), "model": "test/alpha", "epoch": 1}]}
    with ucm_db.open(path) as store:
        assert store.epoch(NS_A) == 1 and store.epoch(NS_B) == 0
        assert store.lookup(NS_A, chain_keys(NS_A, "a0", 5)) == 5  # still stored (never deleted) ...
        base = sum(b"a0") * 7919
        tokens = [(base + i) % 50000 for i in range(5 * NS_A.block_size)]
        assert store.lookup(NS_A, NS_A.block_keys(tokens, epoch=store.epoch(NS_A))) == 0  # ... but never found
        assert store.lookup(NS_B, chains["b0"]) == 3
    human = invoke("invalidate", path, "--namespace", NS_A.digest[:3].hex()).stdout
    assert "epoch 2" in human and "test/alpha" in human


def test_invalidate_needs_a_known_namespace(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path)
    assert "Missing option" in invoke("invalidate", path, expect=2).stderr
    error = invoke_json("invalidate", path, "--namespace", "no/such-model", expect=2)["error"]
    assert "no namespace matches" in error["message"] and "test/alpha" in error["hint"]
    missing = invoke("invalidate", tmp_path / "nothing", "--namespace", "x", expect=2)
    assert "no ucm-db store" in missing.stderr and not (tmp_path / "nothing").exists()
