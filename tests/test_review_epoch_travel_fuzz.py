"""Seeded fuzz: an epoch move follows the blocks wherever they travel (docs/cli.md "Epochs", docs/remote.md "Epochs
shared by nodes", ucm_db/store/epoch_gate.py). Per seed: 2-3 nodes (LMDB or RocksDB) on one ``file://`` remote, two
namespaces; a walk (each operation once, then random ones) of puts, flush, ``bump_epoch``, ``invalidate`` with or
without ``--remote`` (API, CLI, or another process beside a running store), export/import into another node (archive
version 2, or stripped to 1), ``Store.warm``/``ucm-db warm``, read-through, ``migrate [--to-engine]``, compact,
restarts, a node joining. Model per namespace: the epoch each node learned by the documented routes (own moves; the
remote's at each start, as "a running store learns another node's bump at its next start"; a version-2 archive's),
the epoch the remote must know, who took each epoch, the keys stored anywhere, held per node, known uploaded.

Invariants: 1. a node's epoch never goes back, nor below what it learned (read with and without its remote); 2. a
read keyed at it is a miss or the bytes put under that key; 3. no two invalidations take one epoch; a bump through
the remote goes above all the remote knew, one without takes a fresh epoch (``pending``); 4. the manifest holds each
epoch claimed or told; 5. blocks survive compact (no target), migrate, conversion; uploaded and imported blocks at a
node's epoch are served. Every seed must give every route in ``ROUTES`` an effect.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import Namespace, maintenance, migrations
from ucm_db.remote.tier import RemoteRoot
from ucm_db.store.epochs import FRESH_EPOCH_BASE
from ucm_db.tools.cli import cli

NAMESPACES = (Namespace(model="review/travel-a", kv_dtype="bfloat16", block_size=4),
              Namespace(model="review/travel-b", kv_dtype="float16", block_size=4, tp_rank=1, tp_size=2))
SEEDS = list(range(5))
RANDOM_STEPS = 16
UCM_DB = str(Path(sys.executable).with_name("ucm-db"))
ROUTES = ("bump", "invalidate pending", "invalidate claimed", "told at next contact", "learned at first contact",
          "invalidate beside a running store", "import raised the epoch", "version-1 import kept the epoch",
          "read-through", "warm api fetched", "warm cli fetched", "flush uploaded", "convert", "migrate", "compact",
          "compact evicted", "join")


def payload_for(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(192)


@dataclass(slots=True)
class Node:
    name: str
    path: Path
    engine: str
    learned: dict[bytes, int] = field(default_factory=lambda: {ns.id: 0 for ns in NAMESPACES})
    kept: set[bytes] = field(default_factory=set)  # put or imported here, not evicted: held locally
    queued: set[bytes] = field(default_factory=set)  # put here in write_back, not flushed yet
    store: ucm_db.Store | None = None
    write_through: bool = False

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def blocks(self) -> set[bytes]:
        return {b.key for b in maintenance.iter_blocks(self.path)}


@dataclass(slots=True)
class Fleet:
    work: Path
    rng: random.Random
    prompts: list[list[int]]
    url: str  # the remote all nodes share
    nodes: list[Node] = field(default_factory=list)
    told: dict[bytes, int] = field(default_factory=lambda: {ns.id: 0 for ns in NAMESPACES})  # the remote knows it
    taken: dict[tuple[bytes, int], str] = field(default_factory=dict)  # (namespace id, epoch) -> who took it
    stored: set[bytes] = field(default_factory=set)  # every key put or imported anywhere
    uploaded: set[bytes] = field(default_factory=set)
    routes: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)

    def manifest(self, ns: Namespace) -> int:
        found = RemoteRoot.from_url(self.url).read_manifest(ns.id)
        return int(found.get("epoch", 0)) if found else 0

    def take(self, ns: Namespace, epoch: int, who: str) -> None:  # invariant 3: "must never share a number"
        assert (ns.id, epoch) not in self.taken, f"{self.log}: {who} took {epoch}, as {self.taken[ns.id, epoch]} did"
        self.taken[ns.id, epoch] = who

    def observe(self, node: Node, ns: Namespace, epoch: int) -> None:  # invariant 1
        assert epoch >= node.learned[ns.id], f"{self.log}: {node.name} at {epoch}, it knew {node.learned[ns.id]}"
        if epoch:
            self.taken.setdefault((ns.id, epoch), f"a re-claim on {node.name}")  # a tell superseded claims anew
        node.learned[ns.id] = epoch

    def open(self, node: Node) -> ucm_db.Store:
        """The node's running store. Opening is first contact (cli.md "A remote": it takes "the higher of its own and
        the remote's"; "a writable store tells the remote its epoch when it is higher")."""
        if node.store is not None:
            return node.store
        node.write_through = self.rng.random() < 0.3
        remote_before = {ns.id: self.manifest(ns) for ns in NAMESPACES}
        node.store = ucm_db.open(node.path, engine=node.engine, capacity_bytes=64 << 20, remote=self.url,
                                 remote_mode=("write_back", "write_through")[node.write_through], remote_deadline_s=10)
        for ns in NAMESPACES:
            was, epoch = node.learned[ns.id], node.store.epoch(ns)
            assert epoch >= self.told[ns.id], f"{self.log}: {node.name} opened at {epoch}, remote at {self.told}"
            self.observe(node, ns, epoch)
            self.routes["learned at first contact"] += was < epoch <= remote_before[ns.id]
            self.routes["told at next contact"] += epoch > remote_before[ns.id]
            self.told[ns.id] = max(self.told[ns.id], epoch)
            assert self.manifest(ns) >= self.told[ns.id], f"{self.log}: the remote was not told {epoch}"
        return node.store

    def epoch(self, node: Node, ns: Namespace) -> int:  # what a connector step roots its keys at
        epoch = self.open(node).epoch(ns)
        self.observe(node, ns, epoch)
        return epoch

    def offline(self, node: Node) -> dict[bytes, int]:  # its own records: the remote's epoch would mask a loss
        node.close()
        with ucm_db.open(node.path, read_only=True) as store:
            found = {ns.id: store.epoch(ns) for ns in NAMESPACES}
        for ns in NAMESPACES:
            self.observe(node, ns, found[ns.id])
        return found

    def door(self, api: Callable[[], Any], *cli_args: Any) -> Any:
        """One maintenance call through the Python API or the CLI (cli.md: a thin layer over the API)."""
        via_cli = self.rng.random() < 0.5
        self.log.append(("cli " if via_cli else "api ") + " ".join(str(a) for a in cli_args if not isinstance(a, Path)))
        return run_cli(*cli_args) if via_cli else api()

    def first_of(self, yes: str, no: str) -> bool:  # a coin, but ``yes`` while the seed has not taken it
        return not self.routes[yes] or (bool(self.routes[no]) and self.rng.random() < 0.5)


def prefix(keys: list[bytes], known: set[bytes]) -> int:
    return next((i for i, key in enumerate(keys) if key not in known), len(keys))


def run_cli(*args: Any) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def check_reads(fleet: Fleet, node: Node) -> None:
    """Invariants 2 and 5: keyed at the node's epoch; lookups read through the remote (remote.md "Read-through")."""
    for ns in NAMESPACES:
        epoch, store = fleet.epoch(node, ns), fleet.open(node)
        for tokens in fleet.rng.sample(fleet.prompts, 3):
            keys = ns.block_keys(tokens, epoch=epoch)
            local, found = store.lookup(ns, keys, remote=False), store.lookup(ns, keys)
            assert prefix(keys, node.kept) <= local, f"{fleet.log}: {node.name} lost a block it holds"
            assert prefix(keys, node.kept | fleet.uploaded) <= found <= prefix(keys, fleet.stored), fleet.log
            fleet.routes["read-through"] += found > local
            for key, got in zip(keys, store.get(ns, keys), strict=True):
                assert got is None or (key in fleet.stored and got == payload_for(key)), f"{fleet.log}: wrong KV"


def put_chain(fleet: Fleet, node: Node, ns: Namespace, tokens: list[int] | None = None) -> None:
    epoch, store = fleet.epoch(node, ns), fleet.open(node)
    if tokens is None:
        tokens = fleet.rng.choice(fleet.prompts)
        tokens = tokens[:fleet.rng.randint(1, len(tokens) // 4) * 4]
    keys = ns.block_keys(tokens, epoch=epoch)
    if new := keys[store.lookup(ns, keys, remote=False):]:  # a BlockKeys slice knows its parent (docs/api.md)
        store.put(ns, new, [payload_for(k) for k in new])
        fleet.stored |= set(new)
        node.kept |= set(new)
        (fleet.uploaded if node.write_through else node.queued).update(new)  # remote.md: write_through uploads


def flush(fleet: Fleet, node: Node, _ns: Namespace | None = None) -> None:
    fleet.open(node).flush()  # remote.md: "store.flush() waits for it"
    fleet.routes["flush uploaded"] += bool(node.queued)
    fleet.uploaded |= node.queued
    node.queued.clear()


def new_node(fleet: Fleet, engine: str) -> Node:
    node = Node(f"n{len(fleet.nodes)}", fleet.work / f"n{len(fleet.nodes)}", engine)
    fleet.nodes.append(node)
    for ns in NAMESPACES:  # a put with the remote shares the namespace with it (shared_epochs.py)
        put_chain(fleet, node, ns)
    return node


def invalidate(fleet: Fleet, node: Node, ns: Namespace, claim: bool | None = None, *, beside: bool = False) -> None:
    claim = fleet.first_of("invalidate claimed", "invalidate pending") if claim is None else claim
    remote, flags = ({"remote": fleet.url}, ["--remote", fleet.url]) if claim else ({}, [])
    if beside:  # the real entry point, in another process, while the store runs here (LMDB: shared by processes)
        done = subprocess.run([UCM_DB, "invalidate", str(node.path), "--namespace", ns.model, "--json"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
    else:
        node.close()
        report = fleet.door(lambda: {"invalidated": maintenance.invalidate(node.path, (ns.model,), **remote)},
                            "invalidate", node.path, "--namespace", ns.model, *flags)
    (row,) = report["invalidated"]
    epoch = row["epoch"]
    fleet.log.append(f"invalidated {ns.model} on {node.name}{' beside' * beside}: {epoch}")
    assert epoch > node.learned[ns.id], fleet.log
    if claim:  # cli.md invalidate: "the new epoch is claimed there above every node's"
        assert row.get("remote") == "claimed" and epoch > fleet.told[ns.id] and fleet.manifest(ns) >= epoch, row
        fleet.told[ns.id] = epoch
    else:  # shared with the remote: "a fresh epoch no node counted to ... ("remote": "pending")"
        assert row.get("remote") == "pending" and epoch >= FRESH_EPOCH_BASE, (row, fleet.log)
    fleet.take(ns, epoch, f"invalidate on {node.name}")
    node.learned[ns.id] = epoch
    fleet.routes["invalidate beside a running store" if beside else f"invalidate {row['remote']}"] += 1


def maintained(fleet: Fleet, node: Node, api: Callable[[], Any], *cli_args: Any) -> tuple[set[bytes], set[bytes]]:
    """A maintenance call on the closed node (its path, or DEST, last): blocks before and after; epochs survive it."""
    node.close()
    epochs, before = dict(node.learned), node.blocks()
    fleet.door(api, *cli_args)
    node.path = cli_args[-1]
    assert fleet.offline(node) == epochs, f"{fleet.log}: {cli_args[0]} moved an epoch"
    return before, node.blocks()


def convert(fleet: Fleet, node: Node, _ns: Namespace | None = None) -> Node:
    """conversion.py copies every table verbatim: epochs, shared marks and the upload queue with the blocks."""
    engine, dest, src = "rocksdb" if node.engine == "lmdb" else "lmdb", fleet.work / f"c{len(fleet.log)}", node.path
    before, after = maintained(fleet, node, lambda: maintenance.convert_engine(src, dest, engine), "migrate",
                               "--to-engine", engine, src, dest)
    node.engine = engine  # a conflicting engine option is a ConfigError
    assert after == before, f"{fleet.log}: conversion lost blocks"
    fleet.routes["convert"] += 1
    return node


def op_maintain(fleet: Fleet, node: Node, _ns: Namespace, kind: str) -> None:
    """cli.md: compact "evicts to a size" (tails only), else keeps every block; ``migrate`` of a current store too."""
    node.close()
    path, half = node.path, sum(b.stored_bytes for b in maintenance.iter_blocks(node.path)) // 2
    target = half if kind == "compact" and fleet.first_of("compact evicted", "compact") else 0
    api = ((lambda: (migrations.migrate(path), maintenance.convert_pre_unit_blocks(path))) if kind == "migrate"
           else (lambda: maintenance.compact(path, target_bytes=target or None)))
    before, after = maintained(fleet, node, api, kind, *(("--target-bytes", target) if target else ()), path)
    assert after <= before and (target or after == before), f"{fleet.log}: blocks lost"
    fleet.routes[kind] += 1
    fleet.routes["compact evicted"] += after != before
    node.kept &= after
    node.queued &= after


def as_version1(archive: Path, copy: Path) -> None:
    """``copy``: the archive as an older ucm-db wrote it (version 1, no epochs; tests/test_epoch_travel.py)."""
    with tarfile.open(archive) as tar, tarfile.open(copy, "w") as out:
        for member in tar.getmembers():
            body = tar.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == "manifest.json":
                manifest = {k: v for k, v in json.loads(body).items() if k != "epochs"}
                body = json.dumps(manifest | {"version": 1}).encode()
            member.size = len(body)
            out.addfile(member, io.BytesIO(body))


def op_bump(fleet: Fleet, node: Node, ns: Namespace) -> None:
    epoch = fleet.open(node).bump_epoch(ns)
    fleet.log.append(f"bump {ns.model} on {node.name}: {epoch}")
    assert epoch > max(node.learned[ns.id], fleet.told[ns.id]), fleet.log  # remote.md: "above ... the manifest's"
    fleet.take(ns, epoch, f"bump on {node.name}")
    node.learned[ns.id] = fleet.told[ns.id] = epoch
    assert fleet.manifest(ns) >= epoch, f"{fleet.log}: the claim did not reach the manifest"
    fleet.routes["bump"] += 1


def op_invalidate_beside(fleet: Fleet, node: Node, ns: Namespace) -> None:
    """epoch_gate.py: a running store learns a bump "from ``ucm-db invalidate`` on its own store" (RocksDB is
    single-process: such a node is converted to LMDB first)."""
    if fleet.routes["invalidate beside a running store"]:
        return invalidate(fleet, node, ns)
    fleet.open(node if node.engine == "lmdb" else convert(fleet, node))
    invalidate(fleet, node, ns, False, beside=True)
    fleet.told[ns.id] = max(fleet.told[ns.id], fleet.epoch(node, ns))  # learned; and epoch() tells the remote
    assert fleet.manifest(ns) >= fleet.told[ns.id], fleet.log
    check_reads(fleet, node)


def op_export_import(fleet: Fleet, src: Node, ns: Namespace) -> None:
    dst, chosen = fleet.rng.choice([n for n in fleet.nodes if n is not src]), fleet.rng.choice([(), (ns.model,)])
    if fleet.rng.random() < 0.5 or not fleet.routes["import raised the epoch"]:  # the source moved on: pending first
        invalidate(fleet, src, ns, claim=bool(fleet.routes["import raised the epoch"]) and fleet.rng.random() < 0.5)
    src.close()
    archive = fleet.work / f"x{len(fleet.log)}.tar"
    report = fleet.door(lambda: maintenance.export_archive(src.path, archive, chosen), "export", src.path, archive,
                        *[a for model in chosen for a in ("--namespace", model)])
    carried = {bytes.fromhex(h): e for h, e in report["epochs"].items()}
    assert all(e >= src.learned[ns_id] for ns_id, e in carried.items()), fleet.log  # cli.md "Archives" carry it
    with tarfile.open(archive) as tar:
        rows = json.loads(tar.extractfile("manifest.json").read())["blocks"]  # type: ignore[union-attr]
    as_version1(archive, old := archive.with_suffix(".v1.tar"))
    for version in fleet.rng.choice([[1], [2], [1, 2]]) if fleet.routes["version-1 import kept the epoch"] else [1, 2]:
        fleet.log.append(f"{src.name} -> {dst.name} version {version}: {report['epochs']}")
        dst.close()
        before = dict(dst.learned)  # its records: every epoch it answered or took was recorded (epoch_gate.py)
        path = old if version == 1 else archive
        imported = fleet.door(lambda: maintenance.import_archive(path, dst.path), "import", path, dst.path)
        assert imported["skipped"] == [] and imported["stored"] + imported["already_present"] == len(rows), fleet.log
        for ns_id, ours in before.items():
            if (row := imported["epochs"].get(ns_id.hex())) is None:
                continue
            if version == 1:  # archive/epochs.py: "import lowers nothing and raises nothing"
                assert (row["carried"], row["epoch"]) == (None, ours), fleet.log
                fleet.routes["version-1 import kept the epoch"] += carried[ns_id] > ours
            else:  # cli.md: "import records the higher of the store's epoch and the archive's"
                assert (row["carried"], row["epoch"]) == (carried[ns_id], max(ours, carried[ns_id])), fleet.log
                fleet.routes["import raised the epoch"] += carried[ns_id] > ours
            before[ns_id] = row["epoch"]
        assert fleet.offline(dst) == before, f"{fleet.log}: the import report does not say its epochs"
        dst.kept |= {bytes.fromhex(key) for key, _parent, _ns in rows}
        check_reads(fleet, dst)


def op_warm(fleet: Fleet, node: Node, ns: Namespace, route: str) -> None:
    """remote.md "Cache warming": a node restarted (so at the fleet's epoch) computes prompts and uploads them;
    another pulls them by ``Store.warm`` (running, or restarted) or ``ucm-db warm``."""
    producer = fleet.rng.choice([n for n in fleet.nodes if n is not node])
    producer.close()
    for tokens in fleet.prompts[:3]:
        put_chain(fleet, producer, ns, tokens)
    flush(fleet, producer)
    fleet.log.append(f"{route} {node.name} {ns.model}")
    if route == "warm cli fetched" or fleet.rng.random() < 0.5 or not fleet.routes[route]:
        node.close()
    if route == "warm cli fetched":
        (tokens_file := fleet.work / "tokens.jsonl").write_text("".join(json.dumps(p) + "\n" for p in fleet.prompts))
        report = run_cli("warm", node.path, "--remote", fleet.url, "--namespace", ns.model, "--tokens", tokens_file)
    else:
        report = asdict(fleet.open(node).warm(ns, token_sequences=fleet.prompts))
    assert report["failed"] == 0, (report, fleet.log)
    fleet.routes[route] += report["fetched"] > 0
    epoch = fleet.epoch(node, ns)  # cli.md warm: keyed at "the higher of the store's and the remote manifest's"
    for keys in (ns.block_keys(tokens, epoch=epoch) for tokens in fleet.prompts):
        assert fleet.open(node).lookup(ns, keys, remote=False) >= prefix(keys, node.kept | fleet.uploaded), fleet.log


def op_read_or_join(fleet: Fleet, node: Node, _ns: Namespace | None = None) -> None:
    """A read on a running or restarted node, or a new node meeting the remote (cli.md: "a new node")."""
    if len(fleet.nodes) < 3 and fleet.first_of("join", "read-through"):
        node = new_node(fleet, fleet.rng.choice(["lmdb", "lmdb", "rocksdb"]))
        fleet.routes["join"] += 1
    elif fleet.rng.random() < 0.4:
        node.close()
    fleet.log.append(f"read {node.name} ({node.engine})")
    check_reads(fleet, node)


OPERATIONS: list[tuple[Callable[[Fleet, Node, Namespace], Any], int]] = [  # each on a node and namespace drawn
    (put_chain, 6), (flush, 3), (op_bump, 3), (invalidate, 3), (op_invalidate_beside, 1), (op_export_import, 3),
    (partial(op_warm, route="warm cli fetched"), 2), (partial(op_warm, route="warm api fetched"), 2), (convert, 1),
    (partial(op_maintain, kind="compact"), 2), (partial(op_maintain, kind="migrate"), 1), (op_read_or_join, 5),
]


def run_seed(seed: int, work: Path) -> Fleet:
    rng = random.Random(seed)
    (work / "remote").mkdir()
    bases = [[rng.randrange(50000) for _ in range(8)] for _ in range(2)]
    prompts = [rng.choice(bases) + [rng.randrange(50000) for _ in range(4 * rng.randint(1, 4))] for _ in range(6)]
    fleet = Fleet(work, rng, prompts, f"file://{work / 'remote'}")
    for engine in rng.sample(["lmdb", "rocksdb"], 2):
        new_node(fleet, engine)
    ops = rng.sample([op for op, _weight in OPERATIONS], len(OPERATIONS))
    try:
        for op in ops + rng.choices(*zip(*OPERATIONS, strict=True), k=RANDOM_STEPS):
            op(fleet, rng.choice(fleet.nodes), rng.choice(NAMESPACES))
        for node in fleet.nodes:
            flush(fleet, node)
            check_reads(fleet, node)
    finally:
        for node in fleet.nodes:
            node.close()
    return fleet


@pytest.mark.parametrize("seed", SEEDS)
def test_an_epoch_move_follows_the_blocks_wherever_they_travel(tmp_path: Path, seed: int) -> None:
    fleet = run_seed(seed, tmp_path)
    for ns in NAMESPACES:  # invariant 4 at the end
        assert fleet.manifest(ns) >= fleet.told[ns.id]
    silent = [route for route in ROUTES if not fleet.routes[route]]
    assert not silent, f"seed {seed}: these routes had no effect: {silent}; {dict(fleet.routes)}"
