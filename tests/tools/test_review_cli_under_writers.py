"""The read-side `ucm-db` commands while real processes write the store: a seeded fuzz (fixed seeds).

Each scenario makes a 1 MiB store (LMDB or RocksDB; puts evict) holding a pinned 3-block sentinel chain, its middle
block damaged in the engine's `blocks` table in some, and starts writers: tests/tools/writer_proc.py (LMDB only)
and this file's mutator (puts, deletes, pins, unpins, reads). The installed `ucm-db` runs in subprocesses, each
bounded by a timeout; about one command in three has a writer SIGKILLed while it runs. Invariants (docs/cli.md):
    * `inspect` (plain, --json), `verify`, `lookup`, `pin`/`unpin` (LMDB), `export` exit 0 beside writers (1: verify
      and export of a damaged store, pin over max_pinned_bytes); --json parses; what inspect gives from one scan
      agrees, and each chain it lists starts at a root block.
    * `verify` reports exactly the damaged block (none on a healthy store); `--fix` (LMDB) quarantines it and
      its descendant, nothing healthy.
    * An export beside writers lists parents first, leaves the damaged block out with its descendant, and imports
      into a fresh store whose every block reads back its writer's bytes (derived from the key).
    * What needs the store to itself (`compact --require-exclusive`, `migrate --to-engine`; RocksDB `pin`,
      `verify --fix`) refuses with exit 2 (LockedError saying why), promptly, writing nothing.
    * Afterwards the store opens writable, its index check passes, `verify` finds only the damage made, and every
      block reads back its writer's bytes. The last two tests reproduce the defects it found, fixed.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import StoreFullError, maintenance
from ucm_db.maintenance import inspection
from ucm_db.migrations.access import open_engine
from ucm_db.store import Store

import writer_proc
from cli_stores import NS_A, chain_keys, payload

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

UCM_DB = str(Path(sys.executable).parent / "ucm-db")
CAPACITY = 1 << 20
#: Chains the mutator puts, deletes and pins (writer_proc's numbering, far above what writer_proc reaches).
MUTATOR_CHAINS = range(10_000, 10_048)
#: The pinned sentinel chain (NS_A), whose middle block some scenarios damage.
SENTINEL_KEYS = chain_keys(NS_A, "sentinel", 3)
SENTINEL_PAYLOADS = [payload("sentinel", i) for i in range(3)]
COMMAND_TIMEOUT_S = 60
#: (seed, engine, the sentinel: "healthy", "damaged", or "fix": damaged, and `verify --fix` runs beside the writers)
SCENARIOS = [(1, "lmdb", "healthy"), (2, "lmdb", "fix"), (3, "lmdb", "healthy"), (4, "lmdb", "damaged"),
             (6, "lmdb", "fix"), (7, "rocksdb", "healthy"), (8, "rocksdb", "fix"), (9, "rocksdb", "healthy")]


class Model:
    """Every key a writer may store and the bytes it put for it; writer_proc's chains (numbered from 0, how far
    it got unknown while it runs) are added on demand."""

    def __init__(self) -> None:
        self.namespaces = {writer_proc.NS.id: writer_proc.NS, NS_A.id: NS_A}
        self.payloads: dict[bytes, bytes] = {}
        self.roots: set[bytes] = set()
        self.next_writer_chain = 0
        for keys, payloads in [writer_proc.chain(i) for i in MUTATOR_CHAINS] + [(SENTINEL_KEYS, SENTINEL_PAYLOADS)]:
            self.payloads.update(zip(keys, payloads))
            self.roots.add(keys[0])

    def of(self, key: bytes) -> bytes | None:
        while key not in self.payloads and self.next_writer_chain < MUTATOR_CHAINS.start:
            for keys, payloads in map(writer_proc.chain, range(self.next_writer_chain, self.next_writer_chain + 200)):
                self.payloads.update(zip(keys, payloads))
                self.roots.add(keys[0])
            self.next_writer_chain += 200
        return self.payloads.get(key)


MODEL = Model()


def make_base_store(path: Path, engine: str, damaged: bool) -> None:
    """A 1 MiB store holding the pinned sentinel chain, its middle block damaged if asked."""
    keys = SENTINEL_KEYS
    with ucm_db.open(path, engine=engine, capacity_bytes=CAPACITY) as store:
        store.put(NS_A, keys, SENTINEL_PAYLOADS)
        store.pin(NS_A, [keys])
    if damaged:  # one payload byte flipped below the Store, as tests/tools/test_cli_verify.py does
        engine_handle = open_engine(path)
        blob = bytearray(engine_handle.read(lambda txn: bytes(txn.get("blocks", keys[1]))))
        blob[-5] ^= 0x40
        engine_handle.write(lambda txn: txn.put("blocks", keys[1], bytes(blob)))
        engine_handle.close()


# -- the writer processes ---------------------------------------------------------------------------------------
def mutate(path: str, stop_file: str, seed: str) -> None:
    """The mutator process: random puts, partial puts, deletes, pins, unpins and reads of MUTATOR_CHAINS,
    printing each operation's name once it returned; a read gives each key's bytes or a miss."""
    rng = random.Random(int(seed))
    with ucm_db.open(path) as store:
        while not Path(stop_file).exists():
            keys, payloads = writer_proc.chain(rng.choice(MUTATOR_CHAINS))
            depth = rng.randrange(1, writer_proc.BLOCKS + 1)
            op = rng.choice(["put", "put", "put", "prefix", "delete", "pin", "unpin", "read"])
            try:
                if op == "read":
                    got = store.get(writer_proc.NS, keys)
                    assert all(g is None or bytes(g) == p for g, p in zip(got, payloads)), "a read gave other bytes"
                elif op in ("pin", "unpin"):
                    getattr(store, op)(writer_proc.NS, [keys])
                elif op == "delete":  # the block and its descendants
                    store.delete(writer_proc.NS, keys[depth - 1:depth])
                else:
                    end = depth if op == "prefix" else writer_proc.BLOCKS
                    store.put(writer_proc.NS, keys[:end], payloads[:end])
            except StoreFullError:  # a pin over max_pinned_bytes, or a put with only pinned blocks left
                pass
            print(op, flush=True)
            time.sleep(0.01)  # a pace (writer_proc has one too): leaves the CLI a core on a 2-core machine


@dataclass
class Writers:
    """The writer processes of a scenario (by name), and those SIGKILLed."""

    procs: dict[str, subprocess.Popen[str]]
    stop: Path
    killed: set[str] = field(default_factory=set)

    def alive(self) -> list[str]:
        return [name for name in self.procs if name not in self.killed]

    def wait_for(self, name: str, count: int) -> None:
        """Reads ``count`` more lines of the writer's output: it committed that many more operations."""
        for _ in range(count):
            line = self.procs[name].stdout.readline()  # type: ignore[union-attr]
            assert line, f"{name} ended: {self.procs[name].communicate()[1]}"

    def kill(self, name: str) -> None:
        self.procs[name].kill()  # SIGKILL
        self.procs[name].wait(timeout=COMMAND_TIMEOUT_S)
        self.killed.add(name)

    def finish(self) -> None:
        """Stops the writers left; each exits 0."""
        self.stop.touch()
        for name, proc in self.procs.items():
            _out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
            assert name in self.killed or proc.returncode == 0, f"writer {name} failed:\n{err}"


def start_writers(path: Path, engine: str, seed: int, stop: Path) -> Writers:
    """Starts the scenario's writers, once each has committed three operations."""
    commands = {"mutator": [sys.executable, __file__, "mutate", str(path), str(stop), str(seed)]}
    if engine == "lmdb":
        commands["writer"] = [sys.executable, writer_proc.__file__, str(path), str(stop)]
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in commands.items()}
    writers = Writers(procs, stop)
    for name in procs:
        writers.wait_for(name, 3)
    return writers


# -- the CLI ------------------------------------------------------------------------------------------------------
def run_cli(args: list[Any], writers: Writers, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `ucm-db ARGS` in a subprocess (bounded); with ``kill``, SIGKILLs that writer while it runs,
    after the writer committed a few more operations."""
    cli = subprocess.Popen([UCM_DB, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill is not None:
        writers.wait_for(kill, 2)
        writers.kill(kill)
    try:
        out, err = cli.communicate(timeout=COMMAND_TIMEOUT_S)  # TimeoutExpired names the command: it hung
    finally:
        cli.kill()  # nothing once it exited
    return subprocess.CompletedProcess(args, cli.returncode, out, err)


def expect(result: subprocess.CompletedProcess[str], code: int) -> dict[str, Any]:
    assert result.returncode == code, f"{result.args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout) if "--json" in result.args else {}


def check_inspect(report: dict[str, Any]) -> None:
    """What one scan of the block records gives agrees (histograms; all chains, under a large --top), every listed
    chain starts at a root block, no damage is named. The totals and namespace rows come from other read
    transactions: test_inspect_figures_agree_when_a_writer_commits_meanwhile."""
    chains = report["hottest_chains"]
    assert sum(chain["blocks"] for chain in chains) == sum(report["histograms"]["hits"].values()), report
    assert sum(report["histograms"]["age_since_last_use"].values()) == sum(report["histograms"]["hits"].values())
    firsts = [bytes.fromhex(chain["first_block"]) for chain in chains]
    assert all(MODEL.of(key) is not None and key in MODEL.roots for key in firsts), chains
    assert all(chain["longest_blocks"] <= writer_proc.BLOCKS for chain in chains), chains
    assert report["epoch_problems"] == [] and report["damaged_records"] == [] and report["parent_cycles"] == []
    assert all(0 <= row["pinned_bytes"] <= row["stored_bytes"] and row["blocks"] > 0 for row in report["namespaces"])


def check_archive(archive: Path, damaged_keys: set[bytes]) -> int:
    """The manifest lists blocks of the model only, each after its parent, none damaged; returns how many."""
    with tarfile.open(archive) as tar:
        rows = json.loads(tar.extractfile("manifest.json").read())["blocks"]  # type: ignore[union-attr]
    listed: set[str] = set()
    for key, parent, _ns in rows:
        assert MODEL.of(bytes.fromhex(key)) is not None and bytes.fromhex(key) not in damaged_keys, key
        assert parent is None or parent in listed, f"{key} listed without its parent {parent}"
        listed.add(key)
    return len(rows)


def check_store(path: Path, skip: set[bytes]) -> None:
    """The store opens writable, its index check passes, and every stored block (but ``skip``) reads back the
    bytes its writer put for that key."""
    blocks = list(maintenance.iter_blocks(path))
    with ucm_db.open(path) as store:
        assert store._tier.check() == [] and store.stats().blocks == len(blocks)
        for block in blocks:
            if block.key not in skip:
                got = store.get(MODEL.namespaces[block.namespace_id], [block.key])[0]
                assert got is not None and bytes(got) == MODEL.of(block.key), block


# -- the scenarios ----------------------------------------------------------------------------------------------
@dataclass
class Scenario:
    """One scenario's store (``path``, in ``tmp_path``), writers and random choices; each step is a command."""

    tmp_path: Path
    path: Path
    engine: str
    damaged: bool
    rng: random.Random
    writers: Writers

    def prompt_command(self, verb: str, chains: list[int]) -> list[Any]:
        """`ucm-db VERB` (lookup, pin, unpin) --json of the prompts writer_proc.chain(i) keys, i in ``chains``."""
        prompts, size = self.tmp_path / f"{verb}.jsonl", writer_proc.BLOCKS * writer_proc.NS.block_size
        prompts.write_text("".join(json.dumps([i * 1000 + j for j in range(size)]) + "\n" for i in chains))
        return [verb, self.path, "--namespace", writer_proc.NS.model, "--tokens", prompts, "--json"]

    def damaged_keys(self) -> list[str]:
        return [SENTINEL_KEYS[1].hex()] if self.damaged else []

    def maybe_kill(self) -> str | None:
        """A writer to SIGKILL during the next command (about one command in three)."""
        alive = self.writers.alive()
        return self.rng.choice(alive) if alive and self.rng.random() < 0.3 else None

    def inspect(self) -> None:
        if self.rng.random() < 0.5:
            text = run_cli(["inspect", self.path], self.writers, self.maybe_kill())
            expect(text, 0)
            assert "blocks " in text.stdout and "namespace" in text.stdout
        else:
            report = run_cli(["inspect", self.path, "--top", 1000, "--json"], self.writers, self.maybe_kill())
            check_inspect(expect(report, 0))

    def verify(self) -> None:
        report = expect(run_cli(["verify", self.path, "--json"], self.writers, self.maybe_kill()), int(self.damaged))
        assert [c["key"] for c in report["corrupt"]] == self.damaged_keys(), report
        assert report["index_problems"] == [] and report["quarantined_blocks"] == 0, report

    def lookup(self) -> None:
        lookup = self.prompt_command("lookup", [self.rng.choice(MUTATOR_CHAINS), 0])
        report = expect(run_cli(lookup, self.writers, self.maybe_kill()), 0)
        assert [p["blocks"] for p in report["prompts"]] == [writer_proc.BLOCKS] * 2
        assert all(0 <= p["stored_blocks"] <= writer_proc.BLOCKS for p in report["prompts"]), report

    def export(self) -> None:
        archive = self.tmp_path / f"x{self.rng.randrange(1 << 30)}.tar"
        report = expect(run_cli(["export", self.path, archive, "--json"], self.writers, self.maybe_kill()),
                        int(self.damaged))
        assert [c["key"] for c in report["corrupt"]] == self.damaged_keys(), report
        assert check_archive(archive, set(SENTINEL_KEYS[1:]) if self.damaged else set()) == report["blocks"]
        dest = self.tmp_path / f"imported-{archive.stem}"
        imported = expect(run_cli(["import", archive, dest, "--json"], self.writers), 0)
        assert imported["skipped"] == [] and imported["stored"] == report["blocks"], imported
        check_store(dest, set())

    def refuse_exclusive(self) -> None:
        """compact --require-exclusive or migrate --to-engine (LMDB), pin (RocksDB): exit 2 beside a writer."""
        if self.engine == "rocksdb":
            error = expect(run_cli(self.prompt_command("pin", [MUTATOR_CHAINS[0]]), self.writers), 2)["error"]
            assert error["type"] == "LockedError" and "single-process" in error["message"], error
        elif self.rng.random() < 0.5:  # one of the two (a subprocess costs a quarter second)
            error = expect(run_cli(["compact", self.path, "--require-exclusive", "--json"], self.writers), 2)["error"]
            assert error["type"] == "LockedError" and "exclusive use was required" in error["message"], error
            assert all(f"pid {proc.pid}" in error["message"] for proc in self.writers.procs.values()), error
        else:
            dest = self.tmp_path / "converted"
            error = expect(run_cli(["migrate", "--to-engine", "rocksdb", self.path, dest, "--json"], self.writers), 2)
            assert error["error"]["type"] == "LockedError", error
            assert not dest.exists() and not list(self.tmp_path.glob(".converted*")), list(self.tmp_path.iterdir())

    def pin_unpin(self) -> None:
        """LMDB: pin then unpin a mutator chain beside the writers (exit 0, or 1 over max_pinned_bytes)."""
        chain = self.rng.choice(MUTATOR_CHAINS)
        for verb in ("pin", "unpin"):
            result = run_cli(self.prompt_command(verb, [chain]), self.writers, self.maybe_kill())
            report = json.loads(result.stdout)
            if result.returncode == 1:
                assert report["error"]["type"] == "StoreFullError" and "max_pinned_bytes" in report["error"]["message"]
                return
            expect(result, 0)
            assert 0 <= report["prompts"][0]["pinned_blocks"] <= writer_proc.BLOCKS, report

    def verify_fix(self) -> None:
        """LMDB: --fix beside the writers quarantines the damaged block with its one descendant, nothing else
        (its count is test_verify_fix_counts_...). RocksDB: refused beside the writer (exit 2), nothing written."""
        refused = self.engine == "rocksdb" and bool(self.writers.alive())
        report = expect(run_cli(["verify", self.path, "--fix", "--json"], self.writers), 2 if refused else 1)
        if refused:
            assert report["error"]["type"] == "LockedError" and "single-process" in report["error"]["message"]
            self.verify()  # still reported: nothing was written
            return
        with ucm_db.open(self.path, read_only=True) as store:
            # A quarantine takes its blocks' pins (docs/cli.md, "Pins"): the root may have been evicted since.
            assert store.lookup(NS_A, SENTINEL_KEYS, remote=False) in (0, 1)
            assert set(store._tier.quarantine_records()) == {SENTINEL_KEYS[1]}
        self.damaged = False


@pytest.mark.parametrize(("seed", "engine", "sentinel"), SCENARIOS)
def test_read_commands_beside_writers(tmp_path: Path, seed: int, engine: str, sentinel: str) -> None:
    make_base_store(tmp_path / "s", engine, sentinel != "healthy")
    writers = start_writers(tmp_path / "s", engine, seed, tmp_path / "stop")
    scenario = Scenario(tmp_path, tmp_path / "s", engine, sentinel != "healthy", random.Random(seed), writers)
    try:
        queries = [scenario.lookup] + ([scenario.pin_unpin] if engine == "lmdb" else [])
        steps = [scenario.inspect, scenario.verify, queries[seed % len(queries)]]
        scenario.rng.shuffle(steps)
        scenario.refuse_exclusive()  # before any kill: the writers hold the store
        if sentinel == "fix":
            scenario.verify_fix()
        for step in steps:
            step()
        scenario.export()
    finally:
        writers.finish()
    still_damaged = {SENTINEL_KEYS[1]} if scenario.damaged else set()
    check_store(tmp_path / "s", still_damaged)
    report = maintenance.verify(tmp_path / "s")
    assert list(report.corrupt) == sorted(still_damaged) and report.index_problems == [], report.to_dict()


# -- the defects found, fixed: deterministic reproductions --------------------------------------------------
def put_one(path: str, chain: str) -> None:
    """The one-shot writer process: puts writer_proc.chain(chain) (4 blocks)."""
    with ucm_db.open(path) as store:
        store.put(writer_proc.NS, *writer_proc.chain(int(chain)))


def put_in_another_process(path: Path, chain: int) -> None:
    subprocess.run([sys.executable, __file__, "put", str(path), str(chain)], check=True, timeout=COMMAND_TIMEOUT_S)


def test_inspect_figures_agree_when_a_writer_commits_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    make_base_store(path, "lmdb", False)
    rows = inspection.namespace_rows

    def rows_after_a_commit(*args: Any) -> list[dict[str, Any]]:
        put_in_another_process(path, 0)
        return rows(*args)

    monkeypatch.setattr(inspection, "namespace_rows", rows_after_a_commit)
    report = maintenance.inspect(path)
    listed = sum(row["blocks"] for row in report["namespaces"])
    assert report["blocks"] == listed == sum(report["histograms"]["hits"].values()), report


def test_verify_fix_counts_the_blocks_it_quarantined_when_a_writer_commits_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    make_base_store(path, "lmdb", True)
    quarantine = Store.quarantine

    def quarantine_then_a_commit(self: Store, *args: Any, **kwargs: Any) -> bool:
        done = quarantine(self, *args, **kwargs)
        put_in_another_process(path, 0)
        return done

    monkeypatch.setattr(Store, "quarantine", quarantine_then_a_commit)
    report = maintenance.verify(path, fix=True)
    assert list(report.corrupt) == [SENTINEL_KEYS[1]]
    assert report.quarantined_blocks == 2, report.to_dict()  # the damaged block and its one descendant


if __name__ == "__main__":
    if sys.argv[1] == "mutate":
        mutate(*sys.argv[2:5])
    else:
        put_one(*sys.argv[2:4])
