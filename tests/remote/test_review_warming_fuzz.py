"""Seeded model-based review of cache warming (``Store.warm``, ``ucm-db warm``) over a ``file://`` remote.

A writer fills the remote with prompts sharing prefixes (NS and another namespace), may move NS's epoch and
retract a block; NS objects are then deleted, bit-flipped, truncated, extended, swapped or forged (valid
checksums, another parent or namespace). A store, maybe holding prefixes, warms random prompts and key chains
(mid-chain, gapped, older epoch, other namespace). Model: an object is *intact* if its file holds what its
writer uploaded; chains go in warm's order, each finds its local prefix, then fetches intact blocks naming the
previous one as parent; the rest is missing; each distinct block counts once (fetched if fetched, else as its
first chain found it). Checked: report == model; the store holds exactly the model's blocks with the
writer's bytes; nothing queued or changed remotely; progress; epoch; ``ucm-db warm`` after another bump; with
read errors missing/fetched stay under the model, no ``failed`` means the model's report, a rerun reaches it.
Also: pins in a full store, own retraction, bad input, read-only, CLI namespace selection (the four defects
found are fixed: their repros are plain tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import ucm_db
from faultfs import FaultPlan
from ucm_db import Namespace
from ucm_db.errors import ConfigError, TierError
from ucm_db.remote.envelope import ENVELOPE_BYTES, pack_object, unpack_object
from ucm_db.tools.cli import cli

from .test_audit_gc_read_errors import FlakyPathFileSystem  # noqa: F401 - registers ucmaudflaky://

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/review-warm", kv_dtype="bfloat16", block_size=4, layout="test")
OTHER = Namespace(model="test/review-warm-other", kv_dtype="bfloat16", block_size=4, layout="test")
CAP = 64 << 20
SEEDS = list(range(40))
FAIL_SEEDS = list(range(100, 112))
DAMAGES = ("delete", "bitflip", "truncate", "extend", "swap", "reparent", "foreign")
REPORT_FIELDS = ("already_local", "fetched", "missing", "bytes", "failed")


def tokens_of(root: int, symbols: tuple[int, ...]) -> list[int]:
    return [t for i, s in enumerate(symbols) for t in (root, i, s, 7)]


def payload(key: bytes, size: int = 700) -> bytes:
    return hashlib.shake_256(key).digest(size)  # incompressible: stored sizes are the payloads'


def object_files(remote: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in remote.rglob("*") if p.is_file() and len(p.name) == 64}


@dataclass
class World:
    """The remote as its writer left it, and what the model needs of it."""

    tmp: Path
    rng: random.Random
    block_bytes: int = 700
    prompts: list[list[int]] = field(default_factory=list)
    written: list[list[bytes]] = field(default_factory=list)  # NS chains (BlockKeys)
    parent: dict[bytes, bytes | None] = field(default_factory=dict)
    other_chain: list[bytes] = field(default_factory=list)
    original: dict[Path, bytes] = field(default_factory=dict)  # object files as uploaded
    epoch: int = 0

    @property
    def url(self) -> str:
        return f"file://{self.tmp / 'remote'}"

    def path(self, key: bytes) -> Path:
        return self.tmp / "remote" / NS.short_id / key[:1].hex() / key.hex()

    def intact(self, key: bytes) -> bool:
        path = self.path(key)
        return path in self.original and path.is_file() and path.read_bytes() == self.original[path]

    def write(self, prompts: list[list[int]], *, bump: bool = False, retract: bool = False) -> None:
        """Stores ``prompts`` at NS's epoch (after a bump if asked), then maybe retracts one block."""
        with ucm_db.open(self.tmp / "writer", capacity_bytes=CAP, codec="none", remote=self.url,
                         remote_mode="write_through") as a:
            if bump:
                a.bump_epoch(NS)
            self.epoch = a.epoch(NS)
            for tokens in prompts:
                keys = NS.block_keys(tokens, epoch=self.epoch)
                a.put(NS, keys, [payload(k, self.block_bytes) for k in keys])
                self.written.append(keys)
                self.parent.update(zip(keys, [None, *keys[:-1]]))
            if not self.other_chain:
                self.other_chain = list(OTHER.block_keys(prompts[0]))
                a.put(OTHER, self.other_chain, [payload(k) for k in self.other_chain], parent=None)
            if retract:
                a.delete(NS, [self.rng.choice(self.rng.choice(self.written[-len(prompts):]))], remote=True)
        self.original.update({p: b for p, b in object_files(self.tmp / "remote").items() if p not in self.original})

    def damage(self, count: int) -> list[str]:
        """Damages ``count`` random NS objects; returns what was done (for failure messages)."""
        paths = sorted(p for p in self.original if p.parent.parent.name == NS.short_id and p.is_file())
        done = []
        for path in self.rng.sample(paths, min(count, len(paths))):
            kind, key, data = self.rng.choice(DAMAGES), bytes.fromhex(path.name), bytearray(path.read_bytes())
            if kind == "delete":
                path.unlink()
            else:
                path.write_bytes(self._damaged(kind, key, data, paths))
            done.append(f"{kind} {path.name[:12]}")
        return done

    def _damaged(self, kind: str, key: bytes, data: bytearray, paths: list[Path]) -> bytes:
        if kind == "bitflip":
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            return bytes(data)
        if kind in ("truncate", "extend"):
            return bytes(data[: self.rng.randrange(len(data))] if kind == "truncate" else data + b"\0" * 9)
        if kind == "swap":
            return self.original[self.rng.choice([p for p in paths if p.name != key.hex()])]
        obj = unpack_object(bytes(data), key)
        if kind == "reparent":  # a valid object of the right key, naming a parent that is no block
            return pack_object(key, self.rng.randbytes(32), NS.id, bytes(obj.blob))
        return pack_object(key, obj.parent, OTHER.id, bytes(obj.blob))  # "foreign": labelled the other namespace


def fields_of(report: Any) -> dict[str, int]:
    return {name: (report if isinstance(report, dict) else report.to_dict())[name] for name in REPORT_FIELDS}


def model_warm(world: World, local: set[bytes], rooted: list[list[bytes]], given: list[list[bytes]]) -> dict[str, int]:
    """What warming these chains must do to a store holding ``local`` (updated in place): a block is fetched
    when intact and naming the block before it as parent (a key chain's first: a local parent, or none)."""
    counts = dict.fromkeys(REPORT_FIELDS, 0)
    found: dict[bytes, str] = {}  # each distinct key once: fetched if this warm fetched it, else its first finding
    for chain, is_rooted in [(c, True) for c in rooted if c] + [(c, False) for c in given if c]:
        n = next((i for i, key in enumerate(chain) if key not in local), len(chain))
        for key in chain[:n]:
            found.setdefault(key, "already_local")
        expected = chain[n - 1] if n else None if is_rooted else world.parent.get(chain[0], b"?")
        if not (n or is_rooted or world.intact(chain[0]) and expected in (None, *local)):
            expected = b"?"  # the probe says the first block cannot be promoted: nothing is fetched
        fetched = 0
        for key in chain[n:]:
            if not world.intact(key) or world.parent[key] != expected:
                break
            local.add(key)
            found[key] = "fetched"
            fetched, expected = fetched + 1, key
            counts["bytes"] += len(world.original[world.path(key)]) - ENVELOPE_BYTES
        for key in chain[n + fetched:]:
            found.setdefault(key, "missing")
    for finding in found.values():
        counts[finding] += 1
    return counts


def built(tmp_path: Path, seed: int) -> tuple[World, list[str]]:
    rng = random.Random(seed)
    world = World(tmp_path, rng)
    world.prompts = [tokens_of(rng.randrange(2), tuple(rng.randrange(3) for _ in range(rng.randint(1, 6))))
                     for _ in range(rng.randint(5, 9))]
    world.write(world.prompts, retract=rng.random() < 0.3)
    if rng.random() < 0.5:
        again = rng.sample(world.prompts, rng.randint(1, len(world.prompts)))
        world.write(again, bump=True, retract=rng.random() < 0.3)
    return world, world.damage(rng.randint(0, 5))


def warm_inputs(world: World) -> tuple[list[list[int]], list[list[bytes]]]:
    rng = world.rng
    prompts = rng.sample(world.prompts, rng.randint(1, len(world.prompts))) + [rng.choice(world.prompts)]
    prompts += [tokens_of(9, (1, 2)), [1, 2]]  # never written; shorter than a block
    chains = []
    for chain in rng.sample(world.written, min(3, len(world.written))):
        start = rng.randrange(len(chain))
        keys = list(chain[start : rng.randint(start + 1, len(chain))])
        if len(keys) > 2 and rng.random() < 0.3:
            del keys[rng.randrange(1, len(keys) - 1)]  # a chain with a key left out
        chains.append(keys)
    if rng.random() < 0.3:
        chains.append(world.other_chain)
    rng.shuffle(prompts)
    return prompts, chains


def prefilled(world: World, path: Path) -> set[bytes]:
    """A store holding prefixes of some written chains (put without a remote: nothing queued)."""
    local: set[bytes] = set()
    with ucm_db.open(path, capacity_bytes=CAP) as store:
        for chain in world.rng.sample(world.written, world.rng.randint(0, 2)):
            keys = chain[: world.rng.randint(1, len(chain))]
            store.put(NS, keys, [payload(k) for k in keys])
            local.update(keys)
        store.put(OTHER, world.other_chain, [payload(k) for k in world.other_chain], parent=None)
    return local


def assert_holds(path: Path, local: set[bytes]) -> None:
    """The store at ``path`` (opened without its remote) holds exactly ``local`` of NS, with the writer's bytes."""
    with ucm_db.open(path) as store:
        stats = store.stats().namespaces.get(NS.id.hex())
        assert (stats.blocks if stats else 0) == len(local)
        assert store.get(NS, sorted(local)) == [bytearray(payload(k)) for k in sorted(local)]


def world_of(tmp_path: Path, *prompts: list[int]) -> World:
    world = World(tmp_path, random.Random(0))
    world.write(list(prompts))
    return world


def input_file(tmp_path: Path, *lines: Any) -> Path:
    (path := tmp_path / "input.txt").write_text("".join(
        (" ".join(k.hex() for k in x) if isinstance(x[0], bytes) else json.dumps(x)) + "\n" for x in lines))
    return path


def cli_warm(*args: Any) -> Result:
    return CliRunner().invoke(cli, ["warm", *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_warm_matches_the_model(tmp_path: Path, seed: int) -> None:
    world, damage = built(tmp_path, seed)
    local = prefilled(world, tmp_path / "node")
    prompts, chains = warm_inputs(world)
    before = object_files(tmp_path / "remote")
    ticks: list[tuple[int, int]] = []
    with ucm_db.open(tmp_path / "node", remote=world.url) as node:
        report = node.warm(NS, token_sequences=prompts, keys=chains, progress=lambda d, t: ticks.append((d, t)))
        rooted = [list(NS.block_keys(p, epoch=world.epoch)) for p in prompts]
        model = model_warm(world, local, rooted, chains)
        assert fields_of(report) == model, f"seed {seed}, damage {damage}"
        assert node.epoch(NS) == world.epoch and node.stats().pending_uploads == 0
    total = sum(map(len, rooted + chains))  # progress walks every chain; the report counts distinct blocks
    assert report.blocks == len({key for chain in rooted + chains for key in chain}) and ticks[-1] == (total, total)
    assert all(a[0] <= b[0] <= total for a, b in zip(ticks, ticks[1:]))
    assert object_files(tmp_path / "remote") == before, "warming changed an object on the remote"
    assert_holds(tmp_path / "node", local)
    if world.rng.random() < 0.5:  # the epoch moves on the remote; the CLI warms the same store afresh
        world.write(world.rng.sample(world.prompts, 2), bump=True)
        prompts, chains = warm_inputs(world)
        rooted = [list(NS.block_keys(p, epoch=world.epoch)) for p in prompts]
        by_keys = world.rng.random() < 0.5
        result = cli_warm(tmp_path / "node", "--remote", world.url, "--namespace", NS.model, "--json",
                          "--keys" if by_keys else "--tokens", input_file(tmp_path, *(chains if by_keys else prompts)))
        assert result.exit_code == 0, result.output
        model = model_warm(world, local, [] if by_keys else rooted, chains if by_keys else [])
        assert fields_of(json.loads(result.stdout)) == model, f"seed {seed} after the bump"
        assert_holds(tmp_path / "node", local)


@pytest.mark.parametrize("seed", FAIL_SEEDS)
def test_warm_through_transient_read_errors(tmp_path: Path, seed: int) -> None:
    world, damage = built(tmp_path, seed)
    prompts, _chains = warm_inputs(world)
    rooted = [list(NS.block_keys(p, epoch=world.epoch)) for p in prompts]
    model, plan = model_warm(world, local := set[bytes](), rooted, []), FaultPlan(seed=seed)
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=f"ucmfault://{tmp_path / 'remote'}",
                     remote_options={"target_protocol": "file", "plan": plan}) as node:
        assert node.epoch(NS) == world.epoch  # first contact made before the faults
        plan.read_error_rate = 0.15
        report = node.warm(NS, token_sequences=prompts)
        plan.clear()
        assert report.blocks == len({key for chain in rooted for key in chain}), f"{report} {damage}"
        assert report.missing <= model["missing"], f"{report} {damage}"
        assert report.fetched <= model["fetched"] and (report.failed or fields_of(report) == model)
        assert node.stats().blocks == report.fetched, "the store holds other than what the report says it fetched"
        again = node.warm(NS, token_sequences=prompts)
        assert (again.failed, again.missing) == (0, model["missing"])
        assert again.already_local + again.fetched == model["already_local"] + model["fetched"]
    assert_holds(tmp_path / "node", local)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_warm_into_a_full_store_keeps_pins_and_prefixes(tmp_path: Path, seed: int) -> None:
    """1 MiB store, 20 KB blocks: a pinned chain, more chains than fit, one that fits only without the pins
    (missing). Pins stay, chains are stored as prefixes, blocks move by fetched less evicted."""
    rng = random.Random(seed)
    world = World(tmp_path, rng, block_bytes=20_000)
    prompts = [tokens_of(p, tuple(rng.randrange(3) for _ in range(5))) for p in range(12)]
    world.write([*prompts, tokens_of(99, (0,) * 50)])
    chains = world.written
    with ucm_db.open(tmp_path / "node", capacity_bytes=1 << 20, codec="none", remote=world.url) as node:
        assert node.warm(NS, keys=[chains[0]]).fetched == 5
        node.pin(NS, chains[0])
        before = node.stats()
        report = node.warm(NS, keys=[chains[i] for i in rng.sample(range(1, len(chains)), len(chains) - 1)])
        after = node.stats()
        assert (report.already_local, report.missing, report.failed) == (0, 50, 0), report
        assert after.blocks == before.blocks + report.fetched - (after.evictions - before.evictions)
        assert after.stored_bytes <= 1 << 20
    with ucm_db.open(tmp_path / "node") as node:
        for keys in chains:
            got = node.get(NS, keys)
            held = [g is not None for g in got]
            assert held == sorted(held, reverse=True), "a warmed chain is stored with a hole"
            assert all(g == payload(k, 20_000) for g, k in zip(got, keys) if g is not None)
        assert node.lookup(NS, chains[0]) == 5, "a pinned chain was evicted by warming"


def test_warm_never_promotes_a_block_this_node_retracted(tmp_path: Path) -> None:
    """api.md: a key deleted with remote=True is never read back here, even once a lagging upload lands."""
    tokens = tokens_of(0, (1, 2, 0, 1, 2))
    world = world_of(tmp_path, tokens)
    keys = world.written[0]
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=world.url, remote_mode="write_through") as node:
        assert node.warm(NS, token_sequences=[tokens]).fetched == 5
        node.delete(NS, keys[3:], remote=True)
        assert not world.path(keys[3]).exists()
        for key in keys[3:]:  # the lagging upload lands
            world.path(key).write_bytes(world.original[world.path(key)])
        report = node.warm(NS, token_sequences=[tokens])
        assert (report.already_local, report.fetched, report.missing) == (3, 0, 2)
        assert node.lookup(NS, keys, remote=False) == 3


def test_bad_input_is_refused_and_a_read_only_store_only_counts(tmp_path: Path) -> None:
    world = world_of(tmp_path, tokens_of(0, (1, 2, 0)))
    chain = world.written[0]
    (bad_keys := tmp_path / "chains.txt").write_text(f"{'ab' * 32}\n{'zz' * 32}\n")
    result = cli_warm(tmp_path / "s", "--remote", world.url, "--namespace", NS.model, "--keys", bad_keys)
    assert result.exit_code == 2 and f"cannot read {bad_keys} line 2" in result.stderr
    result = cli_warm(tmp_path / "s", "--remote", world.url, "--namespace", "test/nope", "--tokens",
                      input_file(tmp_path, [1] * 8))
    assert result.exit_code == 2 and "0 namespaces" in result.stderr and "test/nope" in result.stderr
    assert not (tmp_path / "s").exists()
    with ucm_db.open(tmp_path / "api", capacity_bytes=CAP, remote=world.url) as node:
        for call in (lambda: node.warm(NS, keys=[[chain[0], b"short"]]), lambda: node.warm(NS),
                     lambda: node.warm(NS, token_sequences=tokens_of(0, (1, 2))),  # type: ignore[arg-type] # one prompt
                     lambda: node.warm(NS, token_sequences=[[-1] * 8])):
            with pytest.raises(ConfigError):
                call()
        assert node.stats().blocks == 0
        node.put(NS, chain[:1], [payload(chain[0])])
    with pytest.raises(ConfigError):
        ucm_db.open(tmp_path / "api", read_only=True, remote=world.url)
    with ucm_db.open(tmp_path / "api", read_only=True) as node:
        report = node.warm(NS, keys=[chain])
        assert (report.already_local, report.fetched, report.missing) == (1, 0, 2)
        with pytest.raises(TierError):
            node.put(NS, chain[1:2], [b"x"])
    assert_holds(tmp_path / "api", {chain[0]})


def test_already_local_counts_only_blocks_stored_before_the_warm(tmp_path: Path) -> None:
    """WarmReport.already_local is "blocks stored locally under the namespace before warming": two prompts
    sharing 3 blocks, warmed into an empty store, report 3 (fetched + already_local = 11, 8 stored)."""
    prompts = [tokens_of(0, (1, 1, 1, 0, 0, 0)), tokens_of(0, (1, 1, 1, 2, 2))]
    world = world_of(tmp_path, *prompts)
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=world.url) as node:
        report = node.warm(NS, token_sequences=prompts)
        assert report.fetched == node.stats().blocks == 8
        assert report.already_local == 0, report


def test_a_chain_cut_off_by_an_earlier_failure_is_not_reported_missing(tmp_path: Path) -> None:
    """remote.md: ``missing`` counts blocks the remote does not hold. One transient error on block 1 of
    keys[:3] leaves keys[3:]'s parent not local: its 3 blocks (all on the remote) are failed, not missing."""
    world = world_of(tmp_path, tokens_of(0, (1, 2, 0, 1, 2, 0)))
    keys = list(world.written[0])
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=f"ucmaudflaky://{tmp_path / 'remote'}",
                     remote_options={"target_protocol": "file", "fail_suffix": keys[1].hex(), "fail_reads": 1}) as node:
        report = node.warm(NS, keys=[keys[:3], keys[3:]])
        assert (report.fetched, report.failed, report.missing) == (1, 5, 0), report


def test_cli_warm_takes_the_full_namespace_id(tmp_path: Path) -> None:
    """cli.md: "the full id names a namespace" (`inspect --json` and `stats()` give 32 hex digits; `lookup`
    takes them). Real entry point."""
    world = world_of(tmp_path, tokens_of(0, (1, 2)))
    done = subprocess.run([str(Path(sys.executable).with_name("ucm-db")), "warm", str(tmp_path / "node"), "--remote",
                           world.url, "--namespace", NS.id.hex(), "--json", "--tokens",
                           input_file(tmp_path, tokens_of(0, (1, 2)))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["fetched"] == 2


def test_cli_warm_model_name_wins_over_an_id_prefix(tmp_path: Path) -> None:
    """cli.md: "A model's name wins over id prefixes" (store/view.py's select_namespaces does so): model
    "e5" beside a namespace whose id starts "e5" is refused as 2 matches."""
    hexy, clash = (dataclasses.replace(NS, model=m) for m in ("e5", "test/other-975"))
    assert clash.short_id.startswith("e5")
    tokens, url = tokens_of(0, (1, 2)), f"file://{tmp_path}/remote"
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through") as writer:
        for ns in (hexy, clash):
            writer.put(ns, ns.block_keys(tokens), [b"x" * 64, b"y" * 64])
    result = cli_warm(tmp_path / "node", "--remote", url, "--namespace", "e5", "--json", "--tokens",
                      input_file(tmp_path, tokens))
    assert result.exit_code == 0, result.output
    with ucm_db.open(tmp_path / "node") as node:
        assert node.lookup(hexy, hexy.block_keys(tokens)) == 2
