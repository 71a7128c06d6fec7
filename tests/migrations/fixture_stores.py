"""Known contents of the checked-in fixture stores, and how they were made.

``python tests/migrations/fixture_stores.py tests/fixtures/stores FORMAT`` writes one LMDB and
one RocksDB store with these contents using the code of the *current* format.
It was run once per format and its output checked in under
``tests/fixtures/stores/format<N>-<engine>/`` (LMDB's lock.mdb, RocksDB's LOG
files and ucm-db.lock removed). Never regenerate an old format's fixture with
newer code: the point is that they hold what older code wrote.

The payloads are derived from names, so a test can recompute every block.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from ucm_db.keys import Namespace

NAMESPACES = {
    "llama": Namespace(model="fixture/llama-tiny", kv_dtype="bfloat16", block_size=4, layout="cpu:2x4x8"),
    "qwen": Namespace(model="fixture/qwen-tiny", kv_dtype="float16", block_size=8, tp_rank=1, tp_size=2),
}
#: (namespace name, chain tag, blocks) of every chain put.
CHAINS = [("llama", "a", 5), ("llama", "b", 3), ("qwen", "c", 4)]
#: (namespace name, chain tag, index) of blocks deleted after the puts (with descendants).
DELETED = [("llama", "b", 2)]
BLOCK_BYTES = 512


def tokens(tag: str, blocks: int, block_size: int) -> list[int]:
    seed = sum(tag.encode())
    return [(seed * 1000 + i) % 32000 for i in range(blocks * block_size)]


def payload(tag: str, index: int) -> bytes:
    """Deterministic, mildly compressible bytes of one block."""
    digest = hashlib.sha256(f"{tag}:{index}".encode()).digest()
    return (digest[:16] + bytes(16)) * (BLOCK_BYTES // 32)


def expected_blocks() -> dict[bytes, tuple[str, bytes]]:
    """key -> (namespace name, payload) of every block the fixture holds."""
    out: dict[bytes, tuple[str, bytes]] = {}
    deleted = {(n, t): i for n, t, i in DELETED}
    for name, tag, blocks in CHAINS:
        ns = NAMESPACES[name]
        keys = ns.block_keys(tokens(tag, blocks, ns.block_size))
        keep = deleted.get((name, tag), blocks)
        for i, key in enumerate(keys[:keep]):
            out[key] = (name, payload(tag, i))
    return out


def write_store(path: Path, engine: str) -> None:
    import ucm_db

    with ucm_db.open(path, engine=engine, capacity_bytes=64 << 20, durability="sync", map_size_bytes=4 << 20) as store:
        for name, tag, blocks in CHAINS:
            ns = NAMESPACES[name]
            keys = ns.block_keys(tokens(tag, blocks, ns.block_size))
            store.put(ns, keys, [payload(tag, i) for i in range(blocks)])
        for name, tag, index in DELETED:
            ns = NAMESPACES[name]
            blocks = dict((t, b) for _, t, b in CHAINS)[tag]
            keys = ns.block_keys(tokens(tag, blocks, ns.block_size))
            store.delete(ns, [keys[index]])
    for junk in ("lmdb/lock.mdb", "ucm-db.lock"):
        (path / junk).unlink(missing_ok=True)
    for log in path.glob("rocksdb/LOG*"):
        log.unlink()


if __name__ == "__main__":
    out_dir, fmt = Path(sys.argv[1]), int(sys.argv[2])
    from ucm_db.store import STORE_FORMAT_VERSION

    assert fmt == STORE_FORMAT_VERSION, f"this code writes format {STORE_FORMAT_VERSION}, not {fmt}"
    for engine in ("lmdb", "rocksdb"):
        target = out_dir / f"format{fmt}-{engine}"
        shutil.rmtree(target, ignore_errors=True)
        write_store(target, engine)
        print(target, sum(f.stat().st_size for f in target.rglob("*") if f.is_file()), "bytes")
