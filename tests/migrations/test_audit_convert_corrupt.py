"""``migrate --to-engine`` of a store holding a corrupt block names the fix.

Audit finding: one rotted block in the source made the conversion fail with
"converted store fails verification: 1 corrupt, []" and the hint "restore
from backup or report the error": it read as if the conversion had damaged
the copy, and named no way forward. The copy is verbatim (its table
digests equal the source's), so the block is the source's; ``ucm-db verify
SOURCE --fix`` quarantines it, and the conversion then succeeds. The error
now says so.

Real LMDB source, real RocksDB destination, the real CLI through CliRunner.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import ucm_db
from ucm_db import Namespace
from ucm_db.tools.cli import cli

NS = Namespace(model="test/convert-corrupt", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(4 * 3)))


def run(*args: object, expect: int) -> dict[str, object]:
    result = CliRunner().invoke(cli, [*map(str, args), "--json"], catch_exceptions=False)
    assert result.exit_code == expect, result.stdout + result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_a_corrupt_source_block_is_named_with_verify_fix_and_converts_after_it(tmp_path: Path) -> None:
    source = tmp_path / "s"
    with ucm_db.open(source) as store:
        store.put(NS, KEYS, [bytes([i]) * 700 for i in range(3)])

        def flip(txn: object) -> None:  # one bit of the middle block's body, as a bad sector would
            body = bytearray(txn.get("blocks", KEYS[1]))  # type: ignore[attr-defined]
            body[-1] ^= 1
            txn.put("blocks", KEYS[1], bytes(body))  # type: ignore[attr-defined]
        store._tier.engine.write(flip)

    error = run("migrate", "--to-engine", "rocksdb", source, tmp_path / "d", expect=1)["error"]
    assert f"ucm-db verify {source} --fix" in error["hint"]  # type: ignore[index,operator]
    assert KEYS[1].hex()[:16] in error["message"] and str(source) in error["message"]  # type: ignore[index,operator]
    assert not (tmp_path / "d").exists()

    run("verify", source, "--fix", expect=1)  # found and quarantined (with its descendant)
    converted = run("migrate", "--to-engine", "rocksdb", source, tmp_path / "d", expect=0)
    assert converted["blocks_verified"] == 1
    with ucm_db.open(tmp_path / "d", engine="rocksdb") as store:
        assert store.lookup(NS, KEYS, remote=False) == 1
