"""Review of the changes of 48600cd..HEAD: repros of what they got wrong, and checks of what they must keep.

Checked (real LMDB/RocksDB stores in tmp_path, real codec blobs, vLLM's real request objects):

* ``codec.verify_sound``/``check_frames`` (put_encoded, import, and every read of a block over 16 MiB raw) refuse a
  blob whose zstd frame does not start like one with ``CorruptBlockError``: what every other frame check raises,
  and all that ``put_encoded``, import, ``get``, ``Store.quarantine`` and ``verify`` catch. Invariant: a hostile or
  damaged blob is refused or a miss, never an exception of the codec's library.
* A read's new "payload missing" quarantine never fires on healthy blocks while a writer puts and evicts beside it
  (LMDB and RocksDB, seeded): ``quarantined`` stays 0 and every block read holds the bytes put for its key.
* ``admit_after: "auto"`` observes, per docs/connector.md, "the blocks of each request that plans saves": requests
  that say ``save: false`` (they plan none) do not move its threshold.

The last tests reproduce the defects it found, fixed.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import CorruptBlockError, Namespace, codec, components, maintenance
from ucm_db.codec.header import FRAME_STRUCT, MODE_SHUFFLE, MODE_ZSTD
from ucm_db.index.entries import BlockEntry
from undecodable import resealed_head

NS = Namespace(model="review/todays-changes", kv_dtype="int8", block_size=4)  # int8: whole zstd frames, no shuffle
OTHER = Namespace(model="review/todays-changes-other", kv_dtype="bfloat16", block_size=4)
SEEDS = [3, 17, 29]
ENGINES = ("lmdb", "rocksdb")
#: Raw bytes past which a read checks a block's frames before allocating (decoding._SCRATCH_KEEP_BYTES), plus some.
LARGE_RAW_BYTES = (16 << 20) + 4096


def keys_of(ns: Namespace, first_token: int, blocks: int) -> list[bytes]:
    """A chain of ``blocks`` keys of ``ns`` whose tokens start at ``first_token``."""
    return list(ns.block_keys(list(range(first_token, first_token + blocks * ns.block_size))))


def with_junk_zstd_frame(blob: bytes) -> bytes:
    """``blob`` with its first compressed frame (or plane) no longer starting like a zstd frame, resealed with a
    valid checksum: what a buggy or hostile writer can hand ``put_encoded``, an archive or a remote."""
    head_at = codec.head_bytes(blob)
    head, body = bytearray(blob[:head_at]), bytearray(blob[head_at:])
    body_at = 0
    for _raw, stored, mode, elem, mask in FRAME_STRUCT.iter_unpack(bytes(head[codec.HEADER_BYTES:])):
        if mode == MODE_ZSTD or (mode == MODE_SHUFFLE and mask & 1):
            at = body_at + (4 * elem if mode == MODE_SHUFFLE else 0)
            body[at : at + 4] = b"JUNK"
            return resealed_head(head, bytes(body)) + bytes(body)
        body_at += stored
    raise AssertionError("the blob holds no compressed frame")


def test_junk_zstd_frame_is_refused_as_corrupt_by_verify_sound() -> None:
    key = keys_of(NS, 0, 1)[0]
    blob = with_junk_zstd_frame(codec.encode(key, [bytes(4096)], codec="zstd", element_bytes=1))
    codec.verify(blob, key)  # the checksum holds: only the frame check can refuse it
    with pytest.raises(CorruptBlockError):
        codec.verify_sound(blob, key)


def test_put_encoded_refuses_a_junk_zstd_frame_with_corrupt_block_error(tmp_path: Path) -> None:
    root, child = keys_of(NS, 0, 2)
    with ucm_db.open(tmp_path / "s", codec="zstd") as store:
        store.put(NS, [root], [bytes(4096)], parent=None)
        blob = with_junk_zstd_frame(codec.encode(child, [bytes(4096)], codec="zstd", element_bytes=1))
        with pytest.raises(CorruptBlockError):
            store.put_encoded(NS, [(child, root, blob)])
        assert store.stats().blocks == 1


def test_import_skips_a_member_with_a_junk_zstd_frame(tmp_path: Path) -> None:
    keys = keys_of(NS, 0, 2)
    with ucm_db.open(tmp_path / "src", codec="zstd") as store:
        store.put(NS, keys, [bytes(4096), bytes(4096)], parent=None)
    maintenance.export_archive(tmp_path / "src", tmp_path / "a.tar")
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    name = f"blocks/{keys[1].hex()}"
    members[name] = with_junk_zstd_frame(members[name])
    with tarfile.open(tmp_path / "b.tar", "w") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    report = maintenance.import_archive(tmp_path / "b.tar", tmp_path / "dst")
    assert [row["key"] for row in report["skipped"]] == [keys[1].hex()]
    assert report["skipped"][0]["reason"].startswith("corrupt")


def test_large_block_with_a_junk_zstd_frame_reads_as_a_miss_and_is_quarantined(tmp_path: Path) -> None:
    """Such a block reaches a store through older code's put_encoded or import, or a remote's promotion (which checks
    the checksum only). Before this change its read was a miss and a quarantine; now every read door raises."""
    good, bad = keys_of(NS, 0, 1)[0], keys_of(NS, 1000, 1)[0]
    with ucm_db.open(tmp_path / "s", codec="zstd") as store:
        store.put(NS, [good], [bytes(4096)], parent=None)  # the namespace's epoch recorded
        blob = with_junk_zstd_frame(codec.encode(bad, [bytes(LARGE_RAW_BYTES)], codec="zstd", element_bytes=1))
        components.local_tier(store).put_blocks([BlockEntry.of_blob(bad, None, blob, LARGE_RAW_BYTES, NS.id)])
        assert store.get(NS, [good, bad]) == [bytes(4096), None]
        assert store.stats().quarantined == 1


def run_writer_and_reader(store: ucm_db.Store, rng: random.Random, chains: list[list[bytes]],
                          payload_of: dict[bytes, bytes]) -> list[tuple[bytes, bytes | None]]:
    """One thread puts ``chains`` (evicting earlier ones: the store is small) while this one reads them in turn;
    returns every (key, bytes read) pair the reads got."""
    started, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            started.wait()
            for chain in chains:
                store.put(NS, chain, [payload_of[k] for k in chain], parent=None)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    started.set()
    reads: list[tuple[bytes, bytes | None]] = []
    while not done.is_set() or len(reads) < 64:
        chain = rng.choice(chains)
        got = store.get(NS, chain)
        reads += [(k, None if g is None else bytes(g)) for k, g in zip(chain, got)]
    writer.join()
    assert not errors, errors
    last = chains[-1]  # the newest put: stored whole (a put never evicts its own batch), so some read hits
    return reads + [(k, None if g is None else bytes(g)) for k, g in zip(last, store.get(NS, last))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", SEEDS)
def test_no_payload_missing_quarantine_beside_a_writer(tmp_path: Path, engine: str, seed: int) -> None:
    rng = random.Random(seed)
    chains = [keys_of(NS, 10_000 * i, rng.randint(1, 6)) for i in range(40)]
    payload_of = {k: rng.randbytes(rng.choice([64, 4096, 30_000])) for chain in chains for k in chain}
    options = {"engine": engine, "codec": rng.choice(["none", "zstd"]), "capacity_bytes": 1 << 20}
    with ucm_db.open(tmp_path / "s", **options) as store:
        reads = run_writer_and_reader(store, rng, chains, payload_of)
        assert all(got is None or got == payload_of[key] for key, got in reads)
        assert any(got is not None for _, got in reads)
        assert store.stats().evictions > 0  # the writer evicted beside the reads (blocks of 2-3 MiB into 1 MiB)
        assert store.stats().quarantined == 0  # no healthy block was taken for one whose payload is gone
        assert components.local_tier(store).check() == []


# -- admit_after "auto" and save: false (docs/connector.md) -------------------------------------------------------


def auto_scheduler(tmp_path: Path) -> Any:
    """A real UcmDbScheduler under ``admit_after: "auto"`` (vLLM imported here: only this test pays for it)."""
    pytest.importorskip("vllm")
    from ucm_db.connector.identity import KVShape
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    shape = KVShape(model="tiny", kv_dtype="bfloat16", block_size=BLOCK_TOKENS, use_mla=False, layout="cpu-test",
                    tp_size=1, pp_size=1, kv_heads=2, layers=2)
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": "auto"})
    return UcmDbScheduler(settings, shape)


BLOCK_TOKENS = 32
PROMPT_BLOCKS = 64


def prefill(scheduler: Any, request_id: str, tokens: list[int], controls: dict[str, Any] | None) -> int:
    """The request's lookup and whole prompt in one step, as vLLM drives them; returns the blocks it plans to save."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from ucm_db.connector.roles import PARAMS_KEY

    extra = None if controls is None else {"kv_transfer_params": {PARAMS_KEY: controls}}
    req = Request(request_id, tokens, SamplingParams(max_tokens=4, extra_args=extra), None)  # type: ignore[arg-type]
    hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, None, hit)
    block_ids = list(range(len(tokens) // BLOCK_TOKENS + 1))
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))],
        scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={request_id: len(tokens)},
        total_num_scheduled_tokens=len(tokens), scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({request_id}, lambda _rid: (block_ids,), {})
    meta = scheduler.build_connector_meta(out)
    return sum(len(save.block_ids) for save in meta.saves)


def test_save_false_traffic_leaves_auto_admission_at_1(tmp_path: Path) -> None:
    scheduler = auto_scheduler(tmp_path)
    try:
        tokens = PROMPT_BLOCKS * BLOCK_TOKENS
        for i in range(20):  # 1280 blocks of unique prompts, past MIN_EVIDENCE_BLOCKS (1024), none saved
            prompt = [1 + (i * tokens + t) % 50_000 for t in range(tokens)]
            assert prefill(scheduler, f"off-{i}", prompt, {"save": False}) == 0
        assert scheduler._planner._admission.auto.threshold == 1  # nothing that plans saves was observed
        assert prefill(scheduler, "saving", [7] * tokens, None) > 0  # a first sighting stored, as at N=1
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_a_damaged_key_read_twice_in_one_call_is_quarantined_once(tmp_path: Path, engine: str) -> None:
    """``get(ns, [k, k, child])`` with k's payload gone files one quarantine record (was two for one block)."""
    keys = keys_of(NS, 0, 2)
    with ucm_db.open(tmp_path / "s", engine=engine, codec="none") as store:
        store.put(NS, keys, [b"a" * 512, b"b" * 512], parent=None)
        store._engine.write(lambda txn: txn.delete("blocks", keys[0]))
        assert store.get(NS, [keys[0], keys[0], keys[1]])[:2] == [None, None]
        assert store.stats().quarantined == 1
