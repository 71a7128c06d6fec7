"""Stores with known contents for the CLI tests, and a CliRunner helper."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

import ucm_db
from ucm_db import Namespace
from ucm_db.tools.cli import cli

NS_A = Namespace(model="test/alpha", kv_dtype="bfloat16", block_size=16)
NS_B = Namespace(model="test/beta", kv_dtype="float16", block_size=8, tp_rank=1, tp_size=2)
BLOCK_BYTES = 4096


def payload(tag: str, index: int) -> bytes:
    """Half random-looking, half zero: compresses about 2x, deterministic."""
    noise = hashlib.shake_256(f"{tag}/{index}".encode()).digest(BLOCK_BYTES // 2)
    return noise + bytes(BLOCK_BYTES // 2)


def chain_keys(ns: Namespace, tag: str, blocks: int) -> list[bytes]:
    base = sum(tag.encode()) * 7919
    return ns.block_keys([(base + i) % 50000 for i in range(blocks * ns.block_size)])


def put_chain(store: ucm_db.Store, ns: Namespace, tag: str, blocks: int) -> list[bytes]:
    keys = chain_keys(ns, tag, blocks)
    store.put(ns, keys, [payload(tag, i) for i in range(blocks)])
    return keys


def make_store(path: Path, engine: str = "lmdb", **options: Any) -> dict[str, list[bytes]]:
    """Chains a0..a3 (5 blocks each) in NS_A and b0 (3 blocks) in NS_B; b0 read twice."""
    chains: dict[str, list[bytes]] = {}
    with ucm_db.open(path, engine=engine, capacity_bytes=options.pop("capacity_bytes", 1 << 30), **options) as store:
        for i in range(4):
            chains[f"a{i}"] = put_chain(store, NS_A, f"a{i}", 5)
        chains["b0"] = put_chain(store, NS_B, "b0", 3)
        store.get(NS_B, chains["b0"])
        store.get(NS_B, chains["b0"])
    return chains


def invoke(*args: Any, expect: int | None = 0) -> Result:
    """Runs the CLI in-process (click >= 8.2 keeps stdout and stderr apart)."""
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if expect is not None:
        assert result.exit_code == expect, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def invoke_json(*args: Any, expect: int = 0) -> dict[str, Any]:
    return json.loads(invoke(*args, "--json", expect=expect).stdout)
