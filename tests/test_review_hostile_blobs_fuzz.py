"""Seeded model-based fuzz of the doors taking encoded blocks from outside: ``Store.put_encoded``, ``ucm-db import``
(exports edited by member and row), promotion from a ``file://`` remote. Real blobs (LMDB ``none``, RocksDB
``zstd``) are damaged (bit flips in header, checksum, table, body; cut, extended, empty; huge counts and sizes;
overlapping frames; a zstd bomb), offered under another key or namespace, with a missing or foreign parent,
duplicated, mixed into good calls; a dict models the target. After every call: a hostile blob is refused with its
documented error (import: skipped with its descendants and reported, or exit 2 before writing), never stored; a
refused call stores nothing; every stored block reads back its first put's exact blob and payload, its parent
stored in its namespace (prefix invariant); the index checks clean; peak RSS grows < 512 MiB. Resealed blobs
(valid unkeyed checksum) are refused, or read as misses and quarantined. The tests at the end are what it found, fixed:
resealed frames that cannot decode were stored, a read allocated a resealed header's raw length before checking its
frames (1 GiB for a 3 KiB blob), and a strided view leaked BufferError.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import struct
import tarfile
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard
from click.testing import CliRunner

import ucm_db
from ucm_db import ConfigError, CorruptBlockError, MissingAncestorError, Namespace, codec, components, maintenance
from ucm_db.remote.tier import ENVELOPE_BYTES
from ucm_db.tools.cli import cli
from undecodable import resealed_head

NS = Namespace(model="test/review-hostile-blobs", kv_dtype="bfloat16", block_size=4)
OTHER = Namespace(model="test/review-hostile-blobs-other", kv_dtype="bfloat16", block_size=4)
SEEDS = [7 + 101 * i for i in range(30)]
CHAINS = {"A": (NS, 5), "B": (NS, 4), "C": (OTHER, 3)}
CODECS = ("none", "zstd")
RSS_GROWTH_LIMIT_BYTES = 512 << 20
FRAME = struct.Struct("<QQBBB5x")  # a frame table entry: raw_len, stored_len, mode, element_bytes, plane_mask
Model = dict[bytes, tuple[bytes | None, bytes]]  # what the target holds: key -> (parent, blob)
Outcome = tuple[list[Any], type[Exception] | None]  # a put_encoded call's blocks and the error it must raise
_SQUEEZE = zstandard.ZstdCompressor(write_content_size=False).compressobj()
BOMB = b"".join([_SQUEEZE.compress(bytes(1 << 20)) for _ in range(64)] + [_SQUEEZE.flush()])  # 64 MiB of zeros


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class Universe:
    """Every block the fuzz knows: its namespace, true parent, raw payload and blob per codec; the exports."""

    chains: dict[str, list[bytes]]
    ns_of: dict[bytes, Namespace]
    parent_of: dict[bytes, bytes | None]
    payload_of: dict[bytes, bytes]
    blobs: dict[str, dict[bytes, bytes]]
    archives: dict[str, Path]

    def entry(self, key: bytes, codec_name: str) -> tuple[bytes, bytes | None, bytes]:  # put_encoded's block
        return key, self.parent_of[key], self.blobs[codec_name][key]


@pytest.fixture(scope="module")
def universe(tmp_path_factory: pytest.TempPathFactory) -> Universe:
    rng, root = random.Random(2024), tmp_path_factory.mktemp("sources")
    chains, ns_of, parent_of, payload_of, frames_of, blobs, archives = {}, {}, {}, {}, {}, {}, dict[str, Path]()
    for name, (ns, depth) in CHAINS.items():
        keys = chains[name] = list(ns.block_keys([rng.randrange(50_000) for _ in range(depth * ns.block_size)]))
        for i, key in enumerate(keys):  # three bf16-like layer frames: random low bytes, repeated high bytes
            frames_of[key] = [bytes(b for _ in range(1024) for b in (rng.randrange(256), 0x3F)) for _ in range(3)]
            ns_of[key], parent_of[key], payload_of[key] = ns, keys[i - 1] if i else None, b"".join(frames_of[key])
    for engine, codec_name in (("lmdb", "none"), ("rocksdb", "zstd")):
        with ucm_db.open(root / engine, engine=engine, codec=codec_name) as store:
            for keys in chains.values():
                store.put(ns_of[keys[0]], keys, [frames_of[k] for k in keys], parent=None)
            blobs[codec_name] = dict(zip(payload_of, components.local_tier(store).read_blobs(list(payload_of))))
        maintenance.export_archive(root / engine, archives.setdefault(codec_name, root / f"{engine}.tar"))
    assert all(codec.read_header(b).codec == c for c, by_key in blobs.items() for b in by_key.values())
    return Universe(chains, ns_of, parent_of, payload_of, blobs, archives)


def check_store(store: ucm_db.Store, model: Model, u: Universe, rss_at_start: int, quarantined: int = 0) -> None:
    """The target holds exactly ``model``, each block as put, parents stored, index clean, memory bounded."""
    tier, keys = components.local_tier(store), list(u.payload_of)
    metas = dict(zip(keys, tier.metas(keys)))
    assert {k for k, m in metas.items() if m is not None} == set(model)
    for key, (parent, _) in model.items():
        meta, above = metas[key], metas[key] if parent is None else metas.get(parent)
        assert meta is not None and above is not None and meta.parent == parent
        assert meta.namespace_id == above.namespace_id == u.ns_of[key].id
    assert tier.read_blobs(list(model)) == [blob for _, blob in model.values()]
    for ns in (NS, OTHER):
        mine = [k for k in model if u.ns_of[k] is ns]
        assert store.get(ns, mine) == [u.payload_of[k] for k in mine]
    assert tier.check() == []
    assert (store.stats().blocks, store.stats().quarantined) == (len(model), quarantined)
    assert peak_rss_bytes() - rss_at_start < RSS_GROWTH_LIMIT_BYTES


def damaged(rng: random.Random, blob: bytes) -> bytes:
    """``blob`` damaged the way a hostile or broken sender could, its checksum left as it was."""
    head_at, out = codec.head_bytes(blob), bytearray(blob)
    kind = rng.choice(["flip", "flip", "truncate", "extend", "zero", "huge", "frames", "bomb"])
    if kind == "flip":
        lo, hi = rng.choice([(0, codec.HEADER_BYTES - 8), (codec.HEADER_BYTES - 8, codec.HEADER_BYTES),
                             (codec.HEADER_BYTES, head_at), (head_at, len(blob))])
        out[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    elif kind in ("truncate", "zero"):
        del out[rng.randrange(len(blob)) if kind == "truncate" else 0:]
    elif kind == "extend":
        out += rng.randbytes(rng.randint(1, 64))
    elif kind == "huge":  # frame count, raw or body length far past anything a reader would allocate
        at, fmt, value = rng.choice([(8, "<I", rng.randrange(codec.MAX_FRAMES, 1 << 32)),
                                     (12, "<Q", rng.randrange(1 << 32, 1 << 64)),
                                     (20, "<Q", rng.randrange(1 << 33, 1 << 64))])
        struct.pack_into(fmt, out, at, value)
    elif kind == "frames":  # a frame's lengths overlapping the next or running past the body
        at = codec.HEADER_BYTES + FRAME.size * rng.randrange(codec.read_header(blob).n_frames) + rng.choice([0, 8])
        struct.pack_into("<Q", out, at, rng.choice([0, len(blob), 1 << 40, struct.unpack_from("<Q", out, at)[0] + 1]))
    else:
        out[head_at:] = BOMB
        struct.pack_into("<Q", out, 20, len(BOMB))
    return bytes(out)


def resealed(rng: random.Random, blob: bytes, raw_len: int = 0) -> bytes:
    """``blob`` made undecodable and sealed again with a valid checksum (what an adversary can send); given
    ``raw_len``, its header claims that raw length."""
    head_at = codec.head_bytes(blob)
    head, body = bytearray(blob[:head_at]), bytearray(blob[head_at:])
    kind = rng.choice(["raw_len", "frame_len", "mode", "bomb", "cut_body"]) if not raw_len else "raw_len"
    if kind == "raw_len":  # more than the frames add up to (at random: bounded, so a read's allocation stays small)
        struct.pack_into("<Q", head, 12, raw_len or codec.read_header(blob).raw_len + rng.randint(1, 8 << 20))
    elif kind == "frame_len":
        at = codec.HEADER_BYTES + rng.choice([0, 8])
        struct.pack_into("<Q", head, at, struct.unpack_from("<Q", head, at)[0] + rng.choice([1, 4096, len(body)]))
    elif kind == "mode":
        head[codec.HEADER_BYTES + 16] = rng.choice([3, 9, 255])
    elif kind == "bomb":  # the first frame's bytes: 64 MiB of zstd zeros, claimed as its table's raw length
        frame_raw, stored_len, _, elem, mask = FRAME.unpack_from(head, codec.HEADER_BYTES)
        body[:stored_len] = BOMB
        FRAME.pack_into(head, codec.HEADER_BYTES, frame_raw, len(BOMB), codec.MODE_ZSTD, elem, mask)
    else:
        del body[rng.randrange(len(body)):]
    struct.pack_into("<Q", head, 20, len(body))
    return resealed_head(head, bytes(body)) + bytes(body)


def next_blocks(model: Model, u: Universe) -> list[bytes]:
    """For each chain of NS, its first block not held (its parent is held, or it is the chain's first)."""
    todo = [[k for k in u.chains[name] if k not in model] for name in ("A", "B")]
    return [keys[0] for keys in todo if keys]


def hostile_call(rng: random.Random, model: Model, u: Universe) -> Outcome:
    """Good blocks (maybe none), then one hostile block: the whole call is refused with the error returned."""
    good = [u.entry(k, rng.choice(CODECS)) for k in next_blocks(model, u)][: rng.randint(0, 2)]
    key, parent, blob = u.entry(rng.choice(list(u.payload_of)), rng.choice(CODECS))
    kind = rng.choice(["damaged"] * 4 + ["another-key", "missing-parent", "self-parent", "foreign-parent",
                                         "foreign-key", "malformed"])
    held = {*model, *(g[0] for g in good)}  # a held block stays as it is (first writer wins): its parent is moot
    fresh = [k for k in u.chains["A"] + u.chains["B"] if k not in held]
    absent = [k for k in fresh if u.parent_of[k] is not None and u.parent_of[k] not in held]
    if kind == "damaged":
        return good + [(key, parent, damaged(rng, blob))], CorruptBlockError
    if kind == "another-key":  # key A's blob offered under key B
        other = rng.choice([k for k in u.payload_of if k != key])
        return good + [(other, u.parent_of[other], blob)], CorruptBlockError
    if kind == "missing-parent" and absent:
        key = rng.choice(absent)
        parent = rng.choice([u.parent_of[key], rng.randbytes(32)])
        return good + [(key, parent, u.blobs["none"][key])], MissingAncestorError
    if kind in ("self-parent", "missing-parent") and fresh:
        key = rng.choice(fresh)
        return good + [(key, key, u.blobs["zstd"][key])], MissingAncestorError
    if kind == "foreign-parent" and fresh:  # a block of NS continuing OTHER's chain C (held in full)
        key = rng.choice(fresh)
        return good + [(key, rng.choice(u.chains["C"]), u.blobs["none"][key])], ConfigError
    if kind == "malformed":
        bad: Any = rng.choice([(key, parent), (key[:31], parent, blob), (key, parent, blob.hex()), (key, b"x", blob),
                               (key, parent, None), [key, parent, blob, blob]])
        return good + [bad], ConfigError
    return good + [u.entry(rng.choice(u.chains["C"]), "none")], ConfigError  # OTHER's block offered as NS's


def good_call(rng: random.Random, model: Model, u: Universe) -> Outcome:
    """Good blocks, some duplicated in the call (another codec's blob second), some under a parent not their own."""
    batch: list[Any] = []
    for key in next_blocks(model, u):
        key, parent, blob = u.entry(key, rng.choice(CODECS))
        if parent is not None and rng.random() < 0.3:
            parent = rng.choice([k for k in model if u.ns_of[k] is NS] or [parent])  # stored: taken as its parent
        batch += [(key, parent, blob)] + [u.entry(key, rng.choice(CODECS))] * rng.randint(0, 2)
    return batch, None


def apply_put(store: ucm_db.Store, model: Model, ns: Namespace, batch: list[Any],
              error: type[Exception] | None) -> None:
    if error is not None:
        with pytest.raises(error):
            store.put_encoded(ns, batch)
        return
    added = {key: (parent, blob) for key, parent, blob in reversed(batch) if key not in model}  # the first one wins
    result = store.put_encoded(ns, batch)
    assert (result.stored, set(result.stored_keys)) == (len(added), set(added))
    assert result.already_present == len(batch) - len(added)
    model.update(added)


def seeded_target(seed: int, tmp_path: Path, u: Universe) -> tuple[random.Random, ucm_db.Store, Model]:
    """A target on the seed's engine holding chain C (OTHER) and a random prefix of chain A."""
    rng, model = random.Random(seed), Model()
    store = ucm_db.open(tmp_path / "target", engine=["lmdb", "rocksdb"][seed % 2], codec=rng.choice(CODECS))
    for key in u.chains["C"] + u.chains["A"][: rng.randint(0, 3)]:
        apply_put(store, model, u.ns_of[key], [u.entry(key, rng.choice(CODECS))], None)
    return rng, store, model


@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_put_encoded_calls_are_refused_whole(seed: int, tmp_path: Path, universe: Universe) -> None:
    rss_at_start = peak_rss_bytes()
    rng, store, model = seeded_target(seed, tmp_path, universe)
    with store:
        for _ in range(10):
            apply_put(store, model, NS, *rng.choice([hostile_call] * 4 + [good_call])(rng, model, universe))
            check_store(store, model, universe, rss_at_start)


@pytest.mark.parametrize("seed", SEEDS)
def test_resealed_blobs_are_refused_or_quarantined_when_read(seed: int, tmp_path: Path, universe: Universe) -> None:
    """The documented model for a blob whose checksum holds (docs/api.md: header, key, checksum verified; trust.md:
    not an adversary): refused, or stored and read as a miss quarantining it and its child; nothing else changes."""
    rss_at_start = peak_rss_bytes()
    rng, store, model = seeded_target(seed, tmp_path, universe)
    with store:
        key, parent, blob = universe.entry(next_blocks(model, universe)[0], rng.choice(CODECS))
        child = [universe.entry(k, "none") for k in universe.payload_of if universe.parent_of[k] == key]
        try:
            store.put_encoded(NS, [(key, parent, resealed(rng, blob)), *child])
        except CorruptBlockError:
            return check_store(store, model, universe, rss_at_start)
        assert store.get(NS, [key]) == [None]  # a miss, never other bytes, never an exception
        check_store(store, model, universe, rss_at_start, quarantined=1)  # it went with its child; nothing else did


def write_archive(path: Path, manifest: Any, members: dict[str, bytes], *, manifests: int = 1) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in [("manifest.json", json.dumps(manifest).encode())] * manifests + list(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def read_archive(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    with tarfile.open(path) as tar:
        data = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    return json.loads(data.pop("manifest.json")), data


def hostile_archive(rng: random.Random, manifest: dict[str, Any], members: dict[str, bytes]) -> tuple[set[str], str]:
    """Edits an export in place: returns the keys (hex) whose members were made bad, and a fatal edit (or "")."""
    rows, bad = manifest["blocks"], set()
    for _ in range(rng.randint(1, 3)):
        row = rng.choice(rows)
        kind = rng.choice(["damage", "swap", "drop", "dup", "first", "parent", "unknown-parent", "unknown-ns", "epoch"])
        name = f"blocks/{row[0]}"
        if kind in ("damage", "swap") and name in members:  # its blob damaged, or another block's valid blob
            other = rng.choice([b for n, b in members.items() if n != name])
            members[name] = damaged(rng, members[name]) if kind == "damage" else other
            bad.add(row[0])
        elif kind == "drop":
            members.pop(name, None)
        elif kind in ("dup", "first"):  # a row listed twice, or moved before its parent
            at = rows.index(row)
            rows.insert(at + 1, row) if kind == "dup" else rows.insert(0, rows.pop(at))
        elif kind == "parent":  # another row of its namespace listed earlier: taken as its parent
            row[1] = rng.choice([r[0] for r in rows[: rows.index(row)] if r[2] == row[2]] or [row[1]])
        elif kind in ("unknown-parent", "unknown-ns"):
            row[1 if kind == "unknown-parent" else 2] = rng.randbytes(32 if kind == "unknown-parent" else 16).hex()
        elif kind == "epoch":  # the archive's epoch moved on, below the ceiling an unsigned archive may carry
            manifest["epochs"][rng.choice(list(manifest["epochs"]))] += rng.randint(1, 1 << 40)
    fatal = rng.choice(["ceiling", "negative", "description", "version", "row", "manifests"] + [""] * 14)
    if fatal in ("ceiling", "negative"):  # at or over what an unsigned archive may carry (2**48), or below 0
        manifest["epochs"][rng.choice(list(manifest["epochs"]))] = -1 if fatal == "negative" else 1 << 48
    elif fatal == "description":
        next(iter(manifest["namespaces"].values()))["block_size"] = 8
    elif fatal == "version":
        manifest["version"] = rng.choice([0, 4, True, "2"])
    elif fatal == "row":
        rng.choice(rows)[0] = rng.choice(["", "zz" * 32, rows[0][0][:62]])
    return bad, fatal


@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_archives_import_only_the_good_blocks(seed: int, tmp_path: Path, universe: Universe) -> None:
    rss_at_start = peak_rss_bytes()
    rng, store, model = seeded_target(seed, tmp_path, universe)
    epochs_before = {ns.id.hex(): store.bump_epoch(ns) if rng.random() < 0.2 else store.epoch(ns) for ns in (NS, OTHER)}
    store.close()
    manifest, members = read_archive(universe.archives[rng.choice(CODECS)])
    bad, fatal = hostile_archive(rng, manifest, members)
    write_archive(tmp_path / "hostile.tar", manifest, members, manifests=2 if fatal == "manifests" else 1)
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "hostile.tar"), str(tmp_path / "target"), "--json"])
    report, expected, skipped, good = json.loads(result.stdout), dict(model), set(), dict[str, str]()
    for key_hex, parent_hex, ns_hex in [] if fatal else manifest["blocks"]:  # import's rules, row by row
        if (ns_hex not in manifest["namespaces"] or (parent_hex and good.get(parent_hex) != ns_hex)
                or f"blocks/{key_hex}" not in members or key_hex in bad):
            skipped.add(key_hex)
            continue
        good[key_hex] = ns_hex
        parent = bytes.fromhex(parent_hex) if parent_hex else None
        expected.setdefault(bytes.fromhex(key_hex), (parent, members[f"blocks/{key_hex}"]))
    assert result.exit_code == (2 if fatal else 1 if skipped else 0), result.output
    if not fatal:
        assert {row["key"] for row in report["skipped"]} == skipped
        assert report["stored"] == len(expected) - len(model)
    with ucm_db.open(tmp_path / "target", engine=["lmdb", "rocksdb"][seed % 2]) as store:
        check_store(store, expected, universe, rss_at_start)
        for ns in (NS, OTHER):
            carried = 0 if fatal else manifest["epochs"][ns.id.hex()]
            assert store.epoch(ns) == max(epochs_before[ns.id.hex()], carried)


@pytest.mark.parametrize("seed", SEEDS[:8])
def test_damaged_remote_objects_are_misses_never_promoted(seed: int, tmp_path: Path, universe: Universe) -> None:
    """A writer uploads chain A; one object's blob is damaged (its envelope does not cover it) or another key's. A
    reader serves each block's exact payload or a miss; its local tier holds only blocks that decode, parents first."""
    rng, url, chain = random.Random(seed), f"file://{tmp_path / 'remote'}", universe.chains["A"]
    with ucm_db.open(tmp_path / "writer", remote=url, remote_mode="write_through") as writer:
        writer.put_encoded(NS, [universe.entry(k, rng.choice(CODECS)) for k in chain])
        sent = {k: bytes(b or b"") for k, b in zip(chain, components.local_tier(writer).read_blobs(chain))}
    victim = rng.randrange(len(chain))
    path = Path(components.RemoteRoot.from_url(url).tier(NS.id).path(chain[victim]))
    blob = sent[chain[(victim + 1) % len(chain)]] if rng.random() < 0.3 else damaged(rng, sent[chain[victim]])
    path.write_bytes(path.read_bytes()[:ENVELOPE_BYTES] + blob)
    with ucm_db.open(tmp_path / "reader", remote=url) as reader:
        got = reader.get(NS, chain)
        assert got[:victim] == [universe.payload_of[k] for k in chain[:victim]]
        assert all(g is None or g == universe.payload_of[k] for k, g in zip(chain, got))
        assert got[victim] is None or blob.startswith(sent[chain[victim]])  # served only where its bytes are whole
        tier = components.local_tier(reader)
        held = [k for k, m in zip(chain, tier.metas(chain)) if m is not None]
        assert held == chain[: len(held)] and tier.check() == []
        for key, stored in zip(held, tier.read_blobs(held)):
            assert stored is not None and codec.decode(stored, key) == universe.payload_of[key]


@pytest.mark.parametrize("door", ["put_encoded", "import"])
def test_a_resealed_blob_whose_frames_do_not_add_up_is_refused(door: str, tmp_path: Path, universe: Universe) -> None:
    key, parent, blob = universe.entry(universe.chains["A"][0], "zstd")  # 3 KiB, claiming one raw byte more
    blob = resealed(random.Random(0), blob, len(universe.payload_of[key]) + 1)
    if door == "import":
        manifest, members = read_archive(universe.archives["zstd"])
        write_archive(tmp_path / "x.tar", manifest, {**members, f"blocks/{key.hex()}": blob})
        report = maintenance.import_archive(tmp_path / "x.tar", tmp_path / "s")
        assert key.hex() in {row["key"] for row in report["skipped"]}
    else:
        with ucm_db.open(tmp_path / "s") as store, pytest.raises(CorruptBlockError):
            store.put_encoded(NS, [(key, parent, blob)])
    with ucm_db.open(tmp_path / "s") as store:
        assert components.local_tier(store).metas([key]) == [None]


def test_reading_a_stored_blob_that_claims_a_huge_raw_length_stays_bounded(tmp_path: Path, universe: Universe) -> None:
    """Put and read back in a forked child, whose peak RSS starts afresh (pytest's own peak would hide it)."""
    key, _, blob = universe.entry(universe.chains["A"][0], "zstd")
    blob = resealed(random.Random(0), blob, 1 << 30)
    read_fd, write_fd = os.pipe()
    if (pid := os.fork()) == 0:  # the child: never returns into pytest
        try:
            with ucm_db.open(tmp_path / "child") as store:
                before = peak_rss_bytes()
                with contextlib.suppress(CorruptBlockError):  # refused: what a fix may do
                    store.put_encoded(NS, [(key, None, blob)])
                store.get(NS, [key])
                os.write(write_fd, str(peak_rss_bytes() - before).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        growth, _ = int(pipe.read() or -1), os.waitpid(pid, 0)  # -1: the child wrote nothing
    assert 0 <= growth < RSS_GROWTH_LIMIT_BYTES


def test_decoding_a_blob_claiming_a_huge_raw_length_allocates_none_of_it(universe: Universe) -> None:
    """The read side alone (a blob stored before put_encoded checked frames): refused before its claim is allocated."""
    key, _, blob = universe.entry(universe.chains["A"][0], "zstd")
    blob = resealed(random.Random(0), blob, 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptBlockError):
            codec.decode(blob, key)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 64 << 20


def test_a_strided_blob_is_refused_as_malformed(tmp_path: Path, universe: Universe) -> None:
    key, parent, blob = universe.entry(universe.chains["A"][0], "none")
    with ucm_db.open(tmp_path / "s") as store, pytest.raises(ConfigError):
        store.put_encoded(NS, [(key, parent, memoryview(blob * 2)[::2])])
