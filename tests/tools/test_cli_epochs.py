"""The CLI and the invalidation epoch (issue 48, item 6): export/import
carry it, inspect reports a namespace whose epoch cannot be established
(exit 1), warm keys prompts at it, and an empty ``--namespace`` is a usage
error (exit 2) in every command taking one, never "every namespace"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from tests import epoch_reads

from cli_stores import NS_A, NS_B, invoke, invoke_json, make_store, payload

TOKENS = [(3 * i + 1) % 30000 for i in range(NS_A.block_size * 4)]
V1 = [payload("v1", i) for i in range(4)]
V2 = [payload("v2", i) for i in range(4)]


def invalidated(path: Path, **options: object) -> None:
    """NS_A: v1 stored, `ucm-db invalidate`, v2 of the same tokens stored."""
    with ucm_db.open(path, capacity_bytes=1 << 26, **options) as store:
        store.put(NS_A, NS_A.block_keys(TOKENS), V1)
        store.put(NS_B, NS_B.block_keys(TOKENS[:16]), V1[:2])
    through = ("--remote", str(options["remote"])) if "remote" in options else ()  # claimed there: the plain count
    assert invoke_json("invalidate", path, "--namespace", "test/alpha", *through)["invalidated"][0]["epoch"] == 1
    with ucm_db.open(path, **options) as store:
        store.put(NS_A, NS_A.block_keys(TOKENS, epoch=store.epoch(NS_A)), V2)


def served(path: Path) -> list[bytes]:
    with ucm_db.open(path) as store:
        return epoch_reads.served(store, NS_A, TOKENS, unreadable_epoch_is_miss=False)


def test_export_import_carries_the_epoch(tmp_path: Path) -> None:
    invalidated(tmp_path / "a")
    exported = invoke("export", tmp_path / "a", tmp_path / "x.tar").stdout
    report = invoke_json("import", tmp_path / "x.tar", tmp_path / "b")
    assert served(tmp_path / "b") == V2  # 0 stale: v1 is in the archive but never served
    assert "with their epochs" in exported and f"{NS_A.digest[:8].hex()}: 1" in exported
    assert report["epochs"][NS_A.digest[:16].hex()] == {"carried": 1, "epoch": 1, "note": None}
    human = invoke("import", tmp_path / "x.tar", tmp_path / "c").stdout
    assert f"namespace {NS_A.digest[:8].hex()}: epoch 1 (the archive's: 1)" in human


def test_inspect_reports_an_epoch_that_cannot_be_established(tmp_path: Path) -> None:
    path = tmp_path / "s"
    invalidated(path)
    name = b"epoch:" + NS_A.digest[:16]
    with ucm_db.open(path) as store:
        store._engine.write(lambda txn: (txn.delete("info", name), txn.delete("info", b"sum:" + name)))  # lost
    report = invoke_json("inspect", path, expect=1)
    assert {row["model"]: row["epoch"] for row in report["namespaces"]} == {"test/alpha": None, "test/beta": 0}
    [problem] = report["epoch_problems"]
    assert NS_A.digest[:16].hex() in problem and "lost" in problem and "ucm-db invalidate" in problem
    human = invoke("inspect", path, expect=1).stdout
    assert "not served" in human and "unknown" in human
    export = invoke("export", path, tmp_path / "x.tar", expect=1)
    assert "cannot export" in export.stderr and not (tmp_path / "x.tar").exists()
    epoch = invoke_json("invalidate", path, "--namespace", "test/alpha")["invalidated"][0]["epoch"]
    assert epoch >= 1 << 40  # fresh, never the reused 1
    assert invoke_json("inspect", path)["epoch_problems"] == []
    assert served(path) == []


def test_warm_by_tokens_keys_at_the_namespace_epoch(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    invalidated(tmp_path / "a", remote=url, remote_mode="write_through")
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text(json.dumps(TOKENS) + "\n")
    report = invoke_json("warm", tmp_path / "b", "--remote", url, "--namespace", "test/alpha", "--tokens", tokens_file)
    assert report["fetched"] == 4
    with ucm_db.open(tmp_path / "b") as store:
        assert store.epoch(NS_A) == 1  # adopted from the remote's manifest
        assert store.lookup(NS_A, NS_A.block_keys(TOKENS)) == 0  # v1 never pulled
    assert served(tmp_path / "b") == V2


@pytest.mark.parametrize("selector", ["", "  "])
def test_an_empty_namespace_is_a_usage_error_in_every_command(tmp_path: Path, selector: str) -> None:
    path = tmp_path / "s"
    make_store(path)
    tokens_file = tmp_path / "t.jsonl"
    tokens_file.write_text("[1, 2, 3, 4]\n")
    commands = [
        ("invalidate", path, "--namespace", selector),
        ("invalidate", path, "--namespace", "test/alpha", "--namespace", selector),
        ("inspect", path, "--namespace", selector),
        ("export", path, tmp_path / "x.tar", "--namespace", selector),
        ("events", path, "--namespace", selector),
        ("warm", path, "--remote", f"file://{tmp_path}", "--namespace", selector, "--tokens", tokens_file),
    ]
    for args in commands:
        result = invoke(*args, expect=2)
        assert "empty" in result.stderr and "--namespace" in result.stderr, (args, result.stderr)
        if args[0] != "events":  # events prints JSON lines already: it has no --json
            error = invoke_json(*args, expect=2)["error"]
            assert "empty" in error["message"] and "$MODEL" in error["hint"]
    with ucm_db.open(path) as store:
        assert store.epoch(NS_A) == 0 and store.epoch(NS_B) == 0  # nothing was invalidated
    assert not (tmp_path / "x.tar").exists()


def test_an_unset_shell_variable_invalidates_nothing(tmp_path: Path) -> None:
    """The real entry point, as an operator's script runs it."""
    path = tmp_path / "s"
    make_store(path)
    exe = Path(sys.executable).parent / "ucm-db"
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    done = subprocess.run(["bash", "-c", f'"{exe}" invalidate "{path}" --namespace "$MODEL"'], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "empty" in done.stderr and "--namespace" in done.stderr
    with ucm_db.open(path) as store:
        assert store.epoch(NS_A) == 0 and store.epoch(NS_B) == 0


def test_verify_names_a_lost_epoch_and_fix_records_a_fresh_one(tmp_path: Path) -> None:
    """Issue 48: a damaged epoch record made verify and verify --fix exit 0.
    Now verify names it (exit 1); --fix records a fresh epoch, above every
    one used, and a second verify exits 0."""
    import json

    from click.testing import CliRunner

    import ucm_db
    from ucm_db.index import records
    from ucm_db.store.epochs import EPOCH_PREFIX
    from ucm_db.tools.cli import cli

    ns = ucm_db.Namespace(model="verify-epoch", kv_dtype="bfloat16", block_size=4)
    path = tmp_path / "s"
    with ucm_db.open(path) as store:
        store.put(ns, ns.block_keys(list(range(8))), [b"a" * 64, b"b" * 64])
        name = EPOCH_PREFIX + ns.digest[:16]
        store._tier.engine.write(lambda txn: txn.put(records.INFO, name, b"\xff" * 3))  # a torn record
    runner = CliRunner()
    first = runner.invoke(cli, ["verify", str(path), "--json"])
    assert first.exit_code == 1, first.output
    assert any("namespace epoch" in line for line in json.loads(first.stdout)["index_problems"])
    fixed = runner.invoke(cli, ["verify", str(path), "--fix", "--json"])
    assert json.loads(fixed.stdout)["epochs_renewed"] == 1, fixed.output
    again = runner.invoke(cli, ["verify", str(path)])
    assert again.exit_code == 0, again.output
    with ucm_db.open(path) as store:
        assert store.epoch(ns) > 1 and store.lookup(ns, ns.block_keys(list(range(8)), epoch=store.epoch(ns))) == 0
