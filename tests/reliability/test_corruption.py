"""Corruption: damaged blocks are detected, quarantined, never served.

Damage is injected where it would really happen: into the stored block, by
writing the engine's ``heads`` and ``blocks`` tables directly (as a bad disk or a buggy
copy would), then reading through ``Store.get`` / ``Store.get_into``.
Every injected fault must read as a miss (0 wrong bytes) and add exactly one
quarantine record. Damaged LMDB *files* are opened in a child process: the
child may fail cleanly (a ucm-db error) or detect corruption; the parent
never crashes and no wrong byte is ever returned.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard

import ucm_db
from ucm_db import codec
from ucm_db.errors import CorruptBlockError, UcmDbError

from .harness import NS, chain_tokens, fork_call, payload_for, tail, wait_pid

OTHER_NS = ucm_db.Namespace(model="reliability-suite", kv_dtype="bfloat16", block_size=4, tp_rank=1, tp_size=2)


class Injector:
    """Puts single-block chains and corrupts their stored blobs."""

    def __init__(self, store: ucm_db.Store) -> None:
        self.store = store
        self.injected = 0
        self.detected = 0
        self.wrong = 0
        self._n = 0

    def fresh_key(self, size_bytes: int) -> tuple[bytes, bytes]:
        self._n += 1
        key = NS.block_keys(chain_tokens(f"corrupt-{self._n}", 1))[0]
        payload = payload_for(key, size_bytes)
        self.store.put(NS, [key], [payload], parent=None)
        return key, payload

    def stored_blob(self, key: bytes) -> bytes:
        blob = self.store._tier.get_batch([key])[0]
        assert blob is not None
        return blob

    def inject(self, key: bytes, payload: bytes, damaged: bytes, *, via_get_into: bool = False) -> None:
        """Replaces the stored block of ``key`` by ``damaged`` (a joined blob,
        split where the good block's head ends: its first bytes go to the
        ``heads`` table, the rest to ``blocks``) and reads it."""
        head_len = codec.head_bytes(self.stored_blob(key))

        def write(txn: Any) -> None:
            txn.put("heads", key, damaged[:head_len])
            txn.put("blocks", key, damaged[head_len:])

        self.store._tier.engine.write(write)
        self.injected += 1
        if via_get_into:
            out = bytearray(len(payload))
            ok = self.store.get_into(NS, [key], [out])[0]
            value = out if ok else None
        else:
            value = self.store.get(NS, [key])[0]
        if value is None:
            self.detected += 1
        elif bytes(value) != payload:
            self.wrong += 1
        # Re-put for the next injection (the quarantine removed the block).
        self.store.put(NS, [key], [payload], parent=None)

    def assert_all_detected(self) -> None:
        assert self.wrong == 0, f"{self.wrong} damaged blocks served wrong bytes"
        assert self.detected == self.injected, f"only {self.detected} of {self.injected} detected"
        assert self.store.stats().quarantined == self.injected
        assert self.store._tier.check() == []


@pytest.fixture(params=["zstd", "none"])
def injector(request: pytest.FixtureRequest, tmp_path: Path) -> Injector:
    with ucm_db.open(tmp_path / "store", codec=request.param, capacity_bytes=256 << 20, durability="group") as store:
        yield Injector(store)


def flip(blob: bytes, bit: int) -> bytes:
    damaged = bytearray(blob)
    damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


def test_every_single_bit_flip_of_a_stored_block_is_detected(injector: Injector) -> None:
    """All bits of a small block's blob, through the store (alternating
    get and get_into)."""
    key, payload = injector.fresh_key(256)
    blob = injector.stored_blob(key)
    for bit in range(len(blob) * 8):
        injector.inject(key, payload, flip(blob, bit), via_get_into=bool(bit % 2))
    injector.assert_all_detected()
    print(f"\nbit flips through the store: {injector.injected} injected, {injector.detected} detected ({len(blob)}-byte blob)")


def test_every_single_bit_flip_of_large_blobs_fails_decode() -> None:
    """All bits of 4 KiB-payload blobs (two frames) (zstd shuffle and raw), at the codec."""
    flips = 0
    for codec_name in ("zstd", "none"):
        key = NS.block_keys(chain_tokens(f"codec-flip-{codec_name}", 1))[0]
        payload = payload_for(key, 4096)
        blob = codec.encode(key, [payload[:2048], payload[2048:]], codec=codec_name)
        for bit in range(len(blob) * 8):
            with pytest.raises(CorruptBlockError):
                codec.decode(flip(blob, bit), key)
            flips += 1
    print(f"\nbit flips at the codec: {flips} injected, {flips} detected")


def test_truncations_extensions_and_zeroed_pages_are_detected(injector: Injector) -> None:
    key, payload = injector.fresh_key(96 * 1024)
    blob = injector.stored_blob(key)
    cuts = sorted({0, 1, 8, codec.HEADER_BYTES - 1, codec.HEADER_BYTES, codec.HEADER_BYTES + 1, len(blob) - 1,
                   *random.Random(1).sample(range(len(blob)), 60)})
    for cut in cuts:
        injector.inject(key, payload, blob[:cut])
    for extra in (b"\0", b"\0" * 4096, b"x" * 7):
        injector.inject(key, payload, blob + extra)
    for page in range(0, len(blob), 4096):
        damaged = bytearray(blob)
        damaged[page : page + 4096] = bytes(len(damaged[page : page + 4096]))
        injector.inject(key, payload, bytes(damaged), via_get_into=page % 8192 == 0)
    injector.assert_all_detected()
    print(f"\ntruncations/extensions/zeroed pages: {injector.injected} injected, {injector.detected} detected")


def test_swapped_payloads_and_foreign_headers_are_detected(injector: Injector) -> None:
    key_a, payload_a = injector.fresh_key(4096)
    key_b, payload_b = injector.fresh_key(4096)
    blob_a, blob_b = injector.stored_blob(key_a), injector.stored_blob(key_b)
    injector.inject(key_a, payload_a, blob_b)  # whole payload of another key
    injector.inject(key_b, payload_b, blob_a)
    # The same tokens in another namespace: a different key, so its blob
    # (header naming its own key) is refused under ours.
    tokens = chain_tokens("corrupt-1", 1)
    foreign_key = OTHER_NS.block_keys(tokens)[0]
    foreign = codec.encode(foreign_key, payload_a, codec=injector.store.config.codec)
    injector.inject(key_a, payload_a, foreign)
    # Header (with its checksum) of another block spliced onto our body.
    head = codec.HEADER_BYTES
    injector.inject(key_a, payload_a, blob_b[:head] + blob_a[head:])
    injector.inject(key_a, payload_a, foreign[:head] + blob_a[head:])
    injector.assert_all_detected()


# -- decompression bombs ---------------------------------------------------------
FRAME_BYTES = struct.calcsize("<QQBBB5x")  # one frame-table entry (codec wire format)


def forge(blob: bytes, *, raw_len: int | None = None, table: bytes | None = None, body: bytes | None = None) -> bytes:
    """Rewrites header fields and recomputes the checksum, as an attacker who
    can write objects (but not break BLAKE2 keys) would."""
    header = bytearray(blob[: codec.HEADER_BYTES])
    n_frames = struct.unpack_from("<I", header, 8)[0]
    table_end = codec.HEADER_BYTES + FRAME_BYTES * n_frames
    table = blob[codec.HEADER_BYTES : table_end] if table is None else table
    body = blob[table_end:] if body is None else body
    if raw_len is not None:
        struct.pack_into("<Q", header, 12, raw_len)
    struct.pack_into("<Q", header, 20, len(body))
    struct.pack_into("<Q", header, codec.HEADER_BYTES - 8, 0)
    checksum = xxhash.xxh3_64(bytes(header) + table + body).intdigest()
    struct.pack_into("<Q", header, codec.HEADER_BYTES - 8, checksum)
    return bytes(header) + table + body


def zstd_frame_claiming(content_bytes: int) -> bytes:
    """A zstd frame header declaring ``content_bytes`` (8-byte FCS field)
    followed by one empty last raw block: tiny, claims anything."""
    return struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 0x58, content_bytes) + b"\x01\x00\x00"


def bounded_decode(blob: bytes, key: bytes) -> tuple[float, int]:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CorruptBlockError):
            codec.decode(blob, key)
        with pytest.raises(CorruptBlockError):
            codec.decode_into(blob, key, bytearray(1024))
        return time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_decompression_bombs_are_rejected_before_allocation() -> None:
    key = NS.block_keys(chain_tokens("bomb", 1))[0]
    blob = codec.encode(key, bytes(1024), codec="zstd", element_bytes=1)  # one MODE_ZSTD frame
    table = bytearray(blob[codec.HEADER_BYTES : codec.HEADER_BYTES + FRAME_BYTES])
    assert table[16] == codec.MODE_ZSTD
    bombs = {
        "header raw_len 2**40": forge(blob, raw_len=1 << 40),
        "header raw_len 2**64-1": forge(blob, raw_len=(1 << 64) - 1),
        "zstd frame claims 2**40 bytes": _with_frame(blob, table, zstd_frame_claiming(1 << 40)),
        "zstd frame claims 3 GiB": _with_frame(blob, table, zstd_frame_claiming(3 << 30)),
        "real 256 MiB zstd frame in a 1 KiB slot": _with_frame(blob, table, zstandard.ZstdCompressor().compress(bytes(256 << 20))),
    }
    # Random damage in raw_len (checksum not forged) must not size an allocation either.
    bombs["flipped raw_len bit 31"] = flip(blob, 8 * 12 + 31)
    for name, bomb in bombs.items():
        seconds, peak_bytes = bounded_decode(bomb, key)
        assert peak_bytes < 8 << 20, f"{name}: allocated {peak_bytes} bytes before refusing"
        assert seconds < 1.0, f"{name}: took {seconds:.2f} s to refuse"


def _with_frame(blob: bytes, table: bytearray, frame: bytes) -> bytes:
    new_table = bytearray(table)
    struct.pack_into("<Q", new_table, 8, len(frame))  # stored_len; raw_len stays 1024
    return forge(blob, table=bytes(new_table), body=frame)


# -- damaged LMDB files ------------------------------------------------------------
def reader_child(store_path: Path, expected: dict[str, int], out: Path) -> None:
    """Opens a damaged store and reads everything; reports what happened."""
    report: dict[str, Any] = {"outcome": "ok", "wrong": 0, "detected": 0, "served": 0}
    try:
        with ucm_db.open(store_path) as store:
            listed = list(store._tier.iterate())
            keys = sorted({bytes.fromhex(k) for k in expected} | set(listed))
            for start in range(0, len(keys), 64):
                batch = keys[start : start + 64]
                for key, value in zip(batch, store.get(NS, batch)):
                    if value is None:
                        report["detected"] += 1
                    elif key.hex() not in expected or bytes(value) != payload_for(key, expected[key.hex()]):
                        report["wrong"] += 1
                    else:
                        report["served"] += 1
            report["index_problems"] = len(store._tier.check())
    except UcmDbError as exc:
        report["outcome"] = f"clean error: {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - an escaping foreign exception is what we look for
        report["outcome"] = f"ESCAPED {type(exc).__module__}.{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(report))


def damage_variants(data_mdb: Path, rng: random.Random) -> list[tuple[str, Any]]:
    size = data_mdb.stat().st_size
    pages = size // 4096

    def overwrite(page: int, data: bytes) -> Any:
        return lambda f: (f.seek(page * 4096), f.write(data))

    variants: list[tuple[str, Any]] = [
        ("meta page 0 zeroed", overwrite(0, bytes(4096))),
        ("meta page 1 zeroed", overwrite(1, bytes(4096))),
        ("both meta pages zeroed", lambda f: (f.seek(0), f.write(bytes(8192)))),
        ("meta page 0 random", overwrite(0, rng.randbytes(4096))),
        ("both meta pages random", lambda f: (f.seek(0), f.write(rng.randbytes(8192)))),
        ("truncated to half", lambda f: f.truncate(size // 2)),
        ("truncated to 3 pages", lambda f: f.truncate(3 * 4096)),
    ]
    for _ in range(12):
        page = rng.randrange(2, pages)
        variants.append((f"page {page} random", overwrite(page, rng.randbytes(4096))))
    for _ in range(6):
        page = rng.randrange(2, pages)
        variants.append((f"page {page} zeroed", overwrite(page, bytes(4096))))
    for _ in range(6):
        at = rng.randrange(2 * 4096, size)
        variants.append((f"byte {at} flipped", lambda f, at=at: _flip_byte(f, at)))
    return variants


def _flip_byte(f: Any, at: int) -> None:
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.crash
def test_damaged_lmdb_files_never_serve_wrong_bytes(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    expected: dict[str, int] = {}
    with ucm_db.open(pristine, capacity_bytes=256 << 20, durability="sync") as store:
        for n in range(40):
            keys = NS.block_keys(chain_tokens(f"damaged-{n}", 3))
            sizes = [random.Random(n * 3 + i).choice([2048, 8192, 20000]) for i in range(3)]
            store.put(NS, keys, [payload_for(k, s) for k, s in zip(keys, sizes)])
            expected.update({k.hex(): s for k, s in zip(keys, sizes)})
    outcomes: dict[str, int] = {}
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for i, (name, damage) in enumerate(damage_variants(pristine / "lmdb" / "data.mdb", rng)):
        copy = tmp_path / f"damaged-{i}"
        shutil.copytree(pristine, copy)
        (copy / "lmdb" / "lock.mdb").unlink(missing_ok=True)
        with open(copy / "lmdb" / "data.mdb", "r+b") as f:
            damage(f)
        out = copy / "report.json"
        pid = fork_call(reader_child, copy, expected, out, log_path=copy / "child.log")
        status = wait_pid(pid, 60)
        assert status is not None, f"{name}: child hung"
        if status < 0:
            outcome = f"child killed by signal {-status}"
        else:
            assert status == 0, f"{name}: {tail(copy / 'child.log')}"
            report = json.loads(out.read_text())
            assert report["wrong"] == 0, f"{name}: wrong bytes served: {report}"
            assert not report["outcome"].startswith("ESCAPED"), f"{name}: {report['outcome']}"
            outcome = report["outcome"] if report["outcome"] != "ok" else ("detected" if report["detected"] or report["index_problems"] else "no effect")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(copy)
    print(f"\ndamaged LMDB files: {json.dumps(outcomes)}")
