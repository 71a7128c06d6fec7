"""Seeded fuzz: `ucm-db compact` and `ucm-db migrate` (in place, `--to-engine`) keep every committed record.

Per seed, a real store (LMDB, RocksDB) is built through the public API with records of every kind: chains sharing
prefixes in three namespaces (codec none/zstd, with and without vLLM event fields), pins, a bumped epoch, a quarantined
block, a retraction, provisional markers (``prov/``) and held uploads (``held/``) of a write-back remote, uploads queued
under a held block. Every table is snapshotted through the engine (read-only) around the CLI run, and compared.

Invariants: 1. compact changes no record but quarantine records (docs/cli.md); a target takes whole unpinned blocks.
2. ``migrate --to-engine`` copies every table verbatim (``settings`` names the new engine), never writes the source.
3. Migrations of older formats (made from a random store) restore ``heads``, add their records, change nothing else.
4. Refusals (a holder process, a read-only or full disk, a newer format) name problem and fix, change nothing.
5. SIGKILL at random delays (fixed seeds) or at crash points leaves the old or the new store. All verify, read exact.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import ucm_db
from ucm_db import Namespace
from ucm_db.engines.base import TABLES, Txn
from ucm_db.events import BlockEventFields
from ucm_db.format import write_format_version
from ucm_db.index.entries import BlockMeta
from ucm_db.migrations.access import open_engine
from ucm_db.tools.cli import cli

from readonly_mount import read_only_view, tree

Tables = dict[str, dict[bytes, bytes]]
#: What the builder stored: the chains still held whole (namespace, keys), and the keys pinned.
Built = tuple[list[tuple[Namespace, list[bytes]]], set[bytes]]
SEEDS = (101, 202, 303)
#: Compacts killed at random delays per engine (RocksDB's children are slower: fewer keep the file under 25 s).
DELAY_KILLS = {"lmdb": 2, "rocksdb": 1}
ENGINES = ("lmdb", "rocksdb")
OTHER_ENGINE = {"lmdb": "rocksdb", "rocksdb": "lmdb"}
NAMESPACES = tuple(Namespace(model=f"review/cm-{i}", kv_dtype="bfloat16", block_size=4) for i in range(3))
#: info records a conversion renews by design: the settings name the new engine (their checksum follows); a RocksDB
#: DEST's first writable open (the conversion's own check) records its boot (ucm_db/store/opening.py).
RENEWED_BY_CONVERSION = {b"settings", b"sum:settings", b"feed-boot"}
#: Owners this process keeps alive (a sweep never judges its own process's owners); closed at teardown.
_LIVE_OWNERS: list[ucm_db.store.provisional.ProvisionalOwner] = []


@pytest.fixture(autouse=True)
def _close_live_owners() -> Iterator[None]:
    yield
    while _LIVE_OWNERS:
        _LIVE_OWNERS.pop().close()


def payload_for(key: bytes) -> bytes:
    """256-3.2 KiB, half noise: zstd stores about half of it."""
    size = 256 + int.from_bytes(key[:2], "little") % 3000
    return hashlib.shake_256(key).digest(size // 2) + bytes(size - size // 2)


def build_store(path: Path, engine: str, seed: int, *, owner_dies: bool = False) -> Built:
    """A store with records of every kind (module docstring). The provisional owner stays alive in this process
    unless ``owner_dies`` (then it is gone, as after its process died: the next writable open sweeps its blocks)."""
    rng = random.Random(seed)
    remote = path.parent / f"{path.name}-remote"
    chains: list[tuple[Namespace, list[bytes]]] = []
    pinned: set[bytes] = set()
    with ucm_db.open(path, engine=engine, capacity_bytes=64 << 20, remote=f"file://{remote}",
                     remote_mode="write_back") as store:
        for _ in range(24):
            ns = rng.choice(NAMESPACES)
            tokens = [rng.randrange(3)] * 8 + [rng.randrange(1000) for _ in range(4 * rng.randint(1, 5))]
            keys = ns.block_keys(tokens, epoch=store.epoch(ns))
            fields = None if rng.random() < 0.5 else {
                k: BlockEventFields(block_hash=k[:8], parent_block_hash=None if i == 0 else keys[i - 1][:8],
                                    token_ids=tuple(tokens[4 * i:4 * i + 4]), block_size=4) for i, k in enumerate(keys)}
            store.put(ns, keys, [payload_for(k) for k in keys], codec_name=rng.choice(["none", "zstd"]),
                      event_fields=fields)
            chains.append((ns, list(keys)))
        for ns, chain in rng.sample(chains, 6):
            store.pin(ns, chain)
            pinned.update(chain if ns is not NAMESPACES[2] else ())  # its epoch moves on below: pins released
        owner = store.provisional_owner()
        for i in range(3):  # a tagged root pair, an untagged child queued under it; the first tag settled
            ns, tag = rng.choice(NAMESPACES), owner.tag()
            keys = ns.block_keys([rng.randrange(1000) for _ in range(12)], epoch=store.epoch(ns))
            tagged = dict.fromkeys(keys[:2], tag)
            store.put_segments(ns, [(keys[:2], [payload_for(k) for k in keys[:2]])], provisional=tagged)
            store.put(ns, keys[2:], [payload_for(k) for k in keys[2:]], parent=keys[1])
            owner.settle([tag] if i == 0 else [])
        victims = [c for c in chains if not pinned & set(c[1])]
        store.delete(victims[0][0], victims[0][1][-1:], remote=True)  # a retraction record
        store.quarantine(victims[1][1][-1], "review: quarantined by the builder", recheck=False)
        store.bump_epoch(NAMESPACES[2])
        store.get(*chains[0])
        whole = [c for c in chains if c[1] not in (victims[0][1], victims[1][1])]
    (owner.close() if owner_dies else _LIVE_OWNERS.append(owner))
    return whole, pinned


def tables_of(path: Path) -> Tables:
    """Every table's records, read through the engine opened read-only."""
    engine = open_engine(path, read_only=True)
    try:
        return engine.read(lambda txn: {t: {bytes(k): bytes(v) for k, v in txn.scan(t)} for t in TABLES})
    finally:
        engine.close()


def differences(before: Tables, after: Tables, *, ignore_info: set[bytes] = set()) -> dict[str, list[str]]:
    """Per table: keys gone, added or changed (hex prefixes), leaving out ``ignore_info`` keys of ``info``."""
    out: dict[str, list[str]] = {}
    for table in TABLES:
        a, b = before.get(table, {}), after.get(table, {})
        keys = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not (table == "info" and k in ignore_info)}
        if keys:
            out[table] = sorted(f"{'-' if k not in b else '+' if k not in a else '~'}{k[:12]!r}" for k in keys)[:6]
    return out


def without_access_time(meta: bytes) -> BlockMeta:
    return replace(BlockMeta.unpack(meta), access_ns=0)


def without_quarantine(tables: Tables) -> Tables:  # compact drops quarantine records (docs/cli.md)
    return {**tables, "quarantine": {}}


def run_cli(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_whole(path: Path, built: Built) -> None:
    """``ucm-db verify`` passes, and every chain the builder left whole reads back bit-exact."""
    result = run_cli("verify", path)
    assert result.exit_code == 0, f"verify after the operation: {result.stdout}{result.stderr}"
    with ucm_db.open(path, read_only=True) as store:
        for ns, keys in built[0]:
            assert [None if v is None else bytes(v) for v in store.get(ns, keys)] == [payload_for(k) for k in keys]


def files_of(path: Path) -> dict[str, str]:
    """Digest of every file of the store but the lock files any open touches."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.rglob("*"))
            if f.is_file() and str(f.relative_to(path)) not in ("ucm-db.lock", "lmdb/lock.mdb")}


# -- 1. compact -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("seed", "engine"), [(101, "lmdb"), (202, "rocksdb"), (303, "lmdb")])
def test_compact_changes_no_record_but_quarantine(tmp_path: Path, seed: int, engine: str) -> None:
    path = tmp_path / "s"
    built = build_store(path, engine, seed)
    before = tables_of(path)
    assert before["quarantine"] and before["uploads"] and all(any(k.startswith(p) for k in before["info"])
                                                              for p in (b"prov/", b"held/", b"retract/", b"pin/"))
    assert run_cli("compact", path, "--require-exclusive").exit_code == 0
    assert differences(without_quarantine(before), tables_of(path)) == {}
    assert_whole(path, built)


@pytest.mark.parametrize("engine", ENGINES)
def test_compact_to_a_target_removes_only_whole_unpinned_blocks(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    built = build_store(path, engine, SEEDS[0])
    before = tables_of(path)
    assert run_cli("compact", path, "--target-bytes", sum(map(len, before["blocks"].values())) // 3).exit_code == 0
    after = tables_of(path)
    gone = before["meta"].keys() - after["meta"].keys()
    assert gone and not gone & built[1], "eviction took nothing, or a pinned block"
    for table in ("blocks", "heads", "uploads"):
        assert {k: v for k, v in before[table].items() if k not in gone} == after[table], table
    assert {k for k in before["children"] if k[32:] not in gone} == after["children"].keys()  # parent + child
    # Eviction files a parent it passes over as used (docs/storage.md): its access time moves, nothing else.
    assert ({k: without_access_time(v) for k, v in before["meta"].items() if k not in gone}
            == {k: without_access_time(v) for k, v in after["meta"].items()})
    kept = (b"prov/", b"held/", b"retract/", b"nsdesc:", b"epoch:", b"pin/", b"pinby/", b"created")
    assert {k: v for k, v in before["info"].items() if k.startswith(kept)} == {
        k: v for k, v in after["info"].items() if k.startswith(kept)}
    assert_whole(path, ([c for c in built[0] if not gone & set(c[1])], built[1]))


# -- 2. migrate --to-engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("seed", "engine"), list(zip(SEEDS, ENGINES)))
def test_conversion_copies_every_record(tmp_path: Path, seed: int, engine: str) -> None:
    source, dest = tmp_path / "s", tmp_path / "d"
    built = build_store(source, engine, seed)
    before, source_files = tables_of(source), files_of(source)
    assert run_cli("migrate", "--to-engine", OTHER_ENGINE[engine], source, dest).exit_code == 0
    assert differences(before, tables_of(dest), ignore_info=RENEWED_BY_CONVERSION) == {}
    assert files_of(source) == source_files, "the conversion wrote its source"
    assert_whole(dest, built)


def test_conversion_of_a_gone_owners_blocks_is_the_verified_copy(tmp_path: Path) -> None:
    source, dest = tmp_path / "s", tmp_path / "d"
    build_store(source, "lmdb", SEEDS[0], owner_dies=True)
    before = tables_of(source)
    assert run_cli("migrate", "--to-engine", "rocksdb", source, dest).exit_code == 0
    assert differences(before, tables_of(dest), ignore_info=RENEWED_BY_CONVERSION) == {}


def test_conversion_onto_a_full_disk_names_the_full_disk(tmp_path: Path) -> None:
    source, disk = tmp_path / "s", tmp_path / "small"
    build_store(source, "lmdb", SEEDS[1])
    before = tables_of(source)
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        result = run_cli("migrate", "--to-engine", "rocksdb", source, disk / "d")
        assert result.exit_code == 1 and list(disk.iterdir()) == [] and tables_of(source) == before
        assert "No space left" in result.stderr and "capacity_bytes" not in result.stderr, result.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- 3. in-place format migrations -------------------------------------------------------------------------------
def rewrite(path: Path, change: Callable[[Txn], None]) -> None:
    """One write transaction straight on the engine (below the Store, as an older or newer ucm-db wrote)."""
    engine = open_engine(path)
    try:
        engine.write(change)
    finally:
        engine.close()


def make_older(path: Path, version: int) -> None:
    """Format ``version`` as it was: heads joined in front of bodies in ``blocks``; no ``created`` in format 1."""
    def back(txn: Txn) -> None:
        for key, head in [(bytes(k), bytes(v)) for k, v in txn.scan("heads")]:
            txn.put("blocks", key, head + bytes(txn.get("blocks", key) or b""))
            txn.delete("heads", key)
        if version < 2:
            txn.delete("info", b"created")
        write_format_version(txn, version)
    rewrite(path, back)


def format_state(path: Path, current: Tables, older: Tables, start: int) -> int:
    """The store's format; asserts its tables are that format's exactly (a migration commits whole, with its record)."""
    after = tables_of(path)
    done = sorted(after["migrations"])
    version = start + len(done)
    assert done == [b"%08d" % v for v in range(start + 1, version + 1)], done
    expected = {**older, "heads": current["heads"] if version == 3 else {}, "migrations": {}}
    moved = {b"format_version", b"sum:format_version"} | ({b"created"} if version >= 2 else set())
    assert differences(expected, {**after, "migrations": {}}, ignore_info=moved) == {}, version
    assert (b"created" in after["info"]) == (version >= 2)
    return version


@pytest.mark.parametrize(("version", "engine"), [(1, "lmdb"), (2, "rocksdb"), (2, "lmdb")])
def test_format_migrations_restore_heads_and_change_nothing_else(tmp_path: Path, version: int, engine: str) -> None:
    path = tmp_path / "s"
    built = build_store(path, engine, SEEDS[version])
    current = tables_of(path)
    make_older(path, version)
    older = tables_of(path)
    assert run_cli("migrate", path).exit_code == 0 and format_state(path, current, older, version) == 3
    assert_whole(path, built)


# -- 4. refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_operations_refuse_a_store_another_process_holds(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    build_store(path, engine, SEEDS[0])
    before = tables_of(path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, ucm_db; s = ucm_db.open(sys.argv[1]); "
                               "print('ready', flush=True); sys.stdin.read(); s.close()", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        for args in (["compact", path, "--require-exclusive"], ["migrate", path],
                     ["migrate", "--to-engine", OTHER_ENGINE[engine], path, tmp_path / "d"]):
            result = run_cli(*args)
            assert result.exit_code == 2, (args, result.stdout, result.stderr)
            assert str(holder.pid) in result.stderr and "stop or close" in result.stderr, (args, result.stderr)
        assert not (tmp_path / "d").exists()
    finally:
        holder.communicate("", timeout=60)
    assert differences(before, tables_of(path)) == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_operations_on_a_read_only_file_system_refuse_and_change_nothing(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    build_store(path, engine, SEEDS[1])
    make_older(path, 2)  # so that `migrate` has work to refuse
    before = tree(path)
    with read_only_view(path, tmp_path / "view") as view:
        for args in (["compact", view], ["migrate", view]):
            result = run_cli(*args)
            assert result.exit_code != 0 and "read-only" in result.stderr and "hint" in result.stderr, result.stderr
    assert tree(path) == before


@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_compact_of_a_newer_format_is_refused_and_changes_no_file(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "s"
    build_store(path, engine, SEEDS[2])
    rewrite(path, lambda txn: write_format_version(txn, 4))  # as a newer ucm-db writes it: checksummed
    files = files_of(path)
    result = run_cli("compact", path)
    assert result.exit_code == 2 and "format 4" in result.stderr and "upgrade ucm-db" in result.stderr
    assert files_of(path) == files


# -- 5. SIGKILL: at random delays (fixed seeds) and at the product's crash points -------------------------------
def child_cli(*args: object, kill_after_s: float | None = None, crash_at: str | None = None) -> tuple[int, float]:
    """The real entry point in a child process, SIGKILLed after ``kill_after_s``; (exit status, seconds run)."""
    env, start = {**os.environ, **({"UCM_DB_CRASH_AT": crash_at} if crash_at else {})}, time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ucm_db.tools.cli", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        err = proc.communicate(timeout=kill_after_s if kill_after_s is not None else 120)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        err = proc.communicate()[1]
    assert proc.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
    return proc.returncode, time.monotonic() - start


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_compact_leaves_the_old_or_the_new_store(tmp_path: Path, engine: str) -> None:
    pristine = tmp_path / "pristine"
    built = build_store(pristine, engine, 7)
    before = tables_of(pristine)
    _, full_s = child_cli("compact", shutil.copytree(pristine, tmp_path / "timed"))  # its whole run's length
    kills: list[dict[str, object]] = [
        {"kill_after_s": random.Random(17 + i).uniform(0.2, 0.7) * full_s} for i in range(DELAY_KILLS[engine])]
    kills += [{"crash_at": f"compact.during_switch:{n}"} for n in (1, 2)] if engine == "lmdb" else []
    killed = 0
    for n, kill in enumerate(kills):
        path = shutil.copytree(pristine, tmp_path / f"k{n}")
        killed += child_cli("compact", path, **kill)[0] != 0  # type: ignore[arg-type]
        after = tables_of(path)
        assert differences(without_quarantine(before), without_quarantine(after)) == {}, kill
        assert after["quarantine"].items() <= before["quarantine"].items()
        assert_whole(path, built)
        assert run_cli("compact", path).exit_code == 0  # the next compact finishes, and clears a killed one's copy
        assert differences(without_quarantine(before), tables_of(path)) == {}
        assert not list(path.glob("lmdb.compact-*"))
    assert killed >= 1 + (2 if engine == "lmdb" else 0)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_conversion_leaves_the_source_and_no_or_a_whole_destination(tmp_path: Path, engine: str) -> None:
    source = tmp_path / "s"
    built = build_store(source, engine, 8)
    before, files = tables_of(source), files_of(source)
    _, full_s = child_cli("migrate", "--to-engine", OTHER_ENGINE[engine], source, tmp_path / "reference")
    reference = tables_of(tmp_path / "reference")
    dest = tmp_path / "d"
    status, _ = child_cli("migrate", "--to-engine", OTHER_ENGINE[engine], source, dest,
                          kill_after_s=random.Random(18).uniform(0.1, 0.5) * full_s)
    assert status == -signal.SIGKILL
    assert tables_of(source) == before and files_of(source) == files, "a conversion wrote its source"
    if dest.exists():  # renamed into place only once verified: whole
        assert differences(reference, tables_of(dest), ignore_info={b"feed-boot"}) == {}
        assert_whole(dest, built)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_migration_leaves_a_whole_format(tmp_path: Path, engine: str) -> None:
    full_s, points = 0.6, [{"crash_at": f"migrate.during_migration:{n}"} for n in (1, 2)] if engine == "lmdb" else []
    for n, kill in enumerate(points + [{"kill_after_s": 0.0}]):
        path = tmp_path / f"k{n}"
        built = build_store(path, engine, 9)  # the owner lives in this process: the child's open sweeps nothing
        current = tables_of(path)
        make_older(path, 1)
        older = tables_of(path)
        if "crash_at" in kill:
            status, full_s = child_cli("migrate", path, **kill)  # type: ignore[arg-type]
            assert status == -signal.SIGKILL and format_state(path, current, older, 1) == n + 1
        else:
            child_cli("migrate", path, kill_after_s=random.Random(19 + n).uniform(0.3, 1.0) * full_s)
            format_state(path, current, older, 1)
        assert run_cli("migrate", path).exit_code == 0 and format_state(path, current, older, 1) == 3
        assert_whole(path, built)
