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


def test_a_model_name_that_is_also_an_id_prefix_invalidates_that_model_only(tmp_path: Path) -> None:
    """A model named like the start of another namespace's id (a commit SHA,
    a short tag) invalidated both: the other model lost its blocks and pins."""
    path = tmp_path / "s"
    other = ucm_db.Namespace(model="m2", kv_dtype="float16", block_size=4)
    named = ucm_db.Namespace(model=other.id.hex()[:2], kv_dtype="bfloat16", block_size=4)
    assert not named.id.hex().startswith(named.model)
    keys = {ns.model: ns.block_keys(list(range(16))) for ns in (other, named)}
    with ucm_db.open(path) as store:
        for ns in (other, named):
            store.put(ns, keys[ns.model], [b"q" * 1024] * 4)
    report = invoke_json("invalidate", path, "--namespace", named.model)
    assert [row["model"] for row in report["invalidated"]] == [named.model]
    with ucm_db.open(path) as store:
        assert store.epoch(other) == 0 and store.lookup(other, keys["m2"]) == 4
        assert store.epoch(named) == 1


def test_an_id_prefix_that_matches_several_namespaces_invalidates_none(tmp_path: Path) -> None:
    path = tmp_path / "s"
    by_digit: dict[str, ucm_db.Namespace] = {}
    for i in range(64):  # two namespaces whose ids start with the same hex digit (17 models always hold two)
        ns = ucm_db.Namespace(model=f"p{i}", kv_dtype="bfloat16", block_size=4)
        if ns.id.hex()[0] in by_digit:
            pair = [by_digit[ns.id.hex()[0]], ns]
            break
        by_digit[ns.id.hex()[0]] = ns
    with ucm_db.open(path) as store:
        for ns in pair:
            store.put(ns, ns.block_keys(list(range(16))), [b"q" * 1024] * 4)
    error = invoke_json("invalidate", path, "--namespace", pair[0].id.hex()[0], expect=2)["error"]
    assert "matches 2 namespaces" in error["message"] and "longer id prefix" in error["hint"]
    with ucm_db.open(path) as store:
        assert [store.epoch(ns) for ns in pair] == [0, 0]
