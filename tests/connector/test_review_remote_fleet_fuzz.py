"""Randomised scenarios of two engines ("nodes") on the stand-in model, each
with its own local store, sharing one remote tier (a ``file://`` directory).

Each scenario (one fixed seed, ``draw(seed)``) runs node A's requests (phase
a1), then node B's on an empty local store (b1: prompts sharing a1's roots,
multi-turn extensions of a1's requests among them), then maybe more of A's
(a2) and of B's (b2: B's running engine, or B restarted). Every phase ends
as a user would before another node reads: the worker's saves drained and
``Store.flush()`` (the write-back queue uploaded). Drawn: per node ``codec``
none / zstd, a ``capacity_bytes`` of 16-20 blocks (the store evicts),
``remote_mode``, ``remote_codec``, ``remote_lookup`` inline / background, ``load_policy``,
``admit_after``, ``save_decode``; per phase the engine (save fuzz's
``_server``) and requests (its ``_requests``: ``save`` / ``load`` controls,
``max_load_tokens``, aborts); and an engine reset of A
(``reset_prefix_cache(reset_connector=True)``) before b1 or after it.

Worlds, as docs/connector.md ("Reset and invalidation") and docs/remote.md
("Epochs shared by nodes") promise them: before the reset every node keys
at the namespace's epoch e0; A's reset moves the store's (and the remote's)
epoch to e1 and roots A's own chains at a private epoch p (>= 2**63); an
engine of B started after the reset takes e1 at its start (first contact);
B's engine running across the reset learns it only at its next start.

Invariants checked, for every scenario:
    * every output token is right: ``greedy(prompt, max_tokens)`` (an
      aborted request: a prefix of it);
    * every block loaded or saved is keyed in its world: a phase loads only
      keys of its world's chains at the world's epoch (after the reset: never
      a key of before it, nor of A's private epoch on B, nor B's on A), saves
      only keys of its own chains at its epoch, none for ``save: false`` and
      loads none for ``load: false``; each engine's epoch is the promised one;
    * no stored block is wrong: every block of every chain held by a node's
      local store, or by the remote (read through on a fresh probe node),
      holds the stand-in's truth;
    * the remote path works: where B (``load_policy: "always"``, before any
      reset) serves a request whose first block A uploaded, B loads hits.
The whole set must exercise what it means to (test_the_seeds_exercise_the_fleet).

Real parts: vLLM's Scheduler / AsyncScheduler, both connector halves, LMDB
stores and a directory remote under tmp_path; the stand-in runner of
stand_in_engine.py. No mocks.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

from stand_in_engine import (BS, HEADS, HEAD, LAYER, LAYERS, VOCAB, StandInEngine, greedy,  # noqa: E402
                             kv_cache_config, truth, vllm_config)
from test_review_save_fuzz import (BLOCK_BYTES, Arrival, Outcome, Server, _Driver, _engine,  # noqa: E402
                                   _requests, _server)
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.keys.units import unit_keys_of  # noqa: E402

SEEDS = range(1, 9)
Chain = tuple[int, ...]


@dataclass(frozen=True)
class Phase:
    """One node's requests; ``fresh``: on a newly started engine of the node."""

    name: str
    node: str
    server: Server
    fresh: bool


@dataclass(frozen=True)
class Fleet:
    """What one seed draws (printed in every failure message)."""

    seed: int
    settings: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # node -> its kv_connector_extra_config
    phases: tuple[Phase, ...]
    reset_after: str | None  # the phase after which A resets

    def node_settings(self, node: str) -> dict[str, Any]:
        return dict(dict(self.settings)[node])

    def __str__(self) -> str:
        steps = [f"{p.name}@{p.node}{'(start)' if p.fresh else ''}{p.server}"
                 + (" then RESET A" if p.name == self.reset_after else "") for p in self.phases]
        return f"seed {self.seed}: {dict(self.settings)}: " + " then ".join(steps)


@dataclass
class PhaseRun:
    """What one phase showed: its world, the epochs its engine used, its keys."""

    phase: Phase
    world: str  # "e0", "e1" or "p" (module docstring); "e0+" a B engine running across the reset
    epochs_seen: set[int] = field(default_factory=set)
    outcome: Outcome = field(default_factory=Outcome)
    loads: dict[str, list[bytes]] = field(default_factory=dict)
    saves: dict[str, list[bytes]] = field(default_factory=dict)
    remote_first_blocks: set[str] = field(default_factory=set)  # requests whose first block the remote held at start


@dataclass
class FleetRun:
    namespace: Any = None  # the model's (both nodes run the same model files)
    epochs: dict[str, int] = field(default_factory=dict)  # world -> epoch
    phases: list[PhaseRun] = field(default_factory=list)
    evicting: bool = False
    stored_local: int = 0  # blocks found stored in the nodes' local stores and checked
    stored_remote: int = 0  # ... on the remote


def _node_settings(rng: random.Random, remote: str) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "remote": remote, "remote_deadline_s": 10.0, "codec": rng.choice(["none", "zstd"]),
        "remote_mode": rng.choice(["write_back", "write_back", "write_back", "write_through"]),
        "remote_codec": rng.choice(["same", "same", "none", "zstd", "auto"]),
        "remote_lookup": rng.choice(["inline", "background"]),
        "load_policy": rng.choice(["always", "always", "always", "auto"]),
        "admit_after": rng.choice([1, 1, 1, 2, "auto"]), "save_decode": rng.random() < 0.7}
    if rng.random() < 0.4:
        settings["capacity_bytes"] = rng.choice([16, 20]) * BLOCK_BYTES
    return settings


def draw(seed: int, remote: str) -> Fleet:
    """Scenario ``seed`` on the remote ``remote`` (the module's draws; the
    reset's place cycles with the seed: none, before b1, after b1 with B
    running across it, after b1 with B restarted)."""
    rng = random.Random(9100 + seed)
    reset_after, b2_odds, b2_fresh = [(None, 0.8, rng.random() < 0.5), ("a1", 0.8, rng.random() < 0.5),
                                      ("b1", 1.0, False), ("b1", 1.0, True)][seed % 4]
    settings = {node: tuple(_node_settings(rng, remote).items()) for node in "AB"}
    roots = [[rng.randrange(VOCAB) for _ in range(20 * BS)] for _ in range(3)]
    earlier: list[Arrival] = []
    drawn: list[tuple[str, str, bool, list[Arrival]]] = []
    for name, node, fresh, odds in (("a1", "A", True, 1.0), ("b1", "B", True, 1.0), ("a2", "A", False, 0.5),
                                    ("b2", "B", b2_fresh, b2_odds)):
        if rng.random() < odds:
            drawn.append((name, node, fresh, _requests(rng, name, roots, earlier)))
            earlier += drawn[-1][3]
    phases, engine_server = [], {}
    for i, (name, node, fresh, requests) in enumerate(drawn):
        if fresh:  # one engine serves this phase and the node's later ones that do not restart it
            then = next((d for d in drawn[i + 1:] if d[1] == node), None)
            engine_server[node] = _server(rng, requests + (then[3] if then and not then[2] else []))
        phases.append(Phase(name, node, dataclasses.replace(engine_server[node], requests=tuple(requests)), fresh))
    return Fleet(seed, tuple(settings.items()), tuple(phases), reset_after)


def chain_of(request: Arrival) -> Chain:
    """The request's prompt and right output: every block it may load or save."""
    return request.prompt + tuple(greedy(list(request.prompt), request.max_tokens))


def keys_at(ns: Any, chains: list[Chain], epoch: int) -> set[bytes]:
    return {k for tokens in chains for k in ns.block_keys(list(tokens), epoch=epoch)}


def _recorder(run: PhaseRun) -> Callable[[StandInEngine, Any, Any], None]:
    def record(engine: StandInEngine, so: Any, out: Any) -> None:
        meta = so.kv_connector_metadata
        for transfer in [*meta.loads, *meta.async_loads]:
            run.loads.setdefault(transfer.req_id, []).extend(transfer.keys)
        for transfer in meta.saves:
            run.saves.setdefault(transfer.req_id, []).extend(transfer.keys)
        run.epochs_seen.add(engine.ours.epoch)
    return record


def _remote_holds(remote_dir: Path, engine: StandInEngine, tokens: Chain, epoch: int) -> bool:
    """Whether every unit object of the chain's first block is on the remote
    (docs/remote.md: ``ROOT/<namespace short id>/<key[0] hex>/<key hex>``)."""
    ours = engine.ours
    if len(tokens) <= BS:
        return False
    block = ours.namespace.block_keys(list(tokens[:BS]), epoch=epoch)[0]
    units = unit_keys_of([block], ours._spans, ours._grid)
    return all((remote_dir / ours.namespace.short_id / k[:1].hex() / k.hex()).is_file() for k in units)


def _finish(engine: StandInEngine) -> None:
    engine.runner.connector._worker.drain()  # the worker's saves committed
    engine.ours.store.flush(upload_timeout_s=60)  # and uploaded (docs/remote.md, write_back)


def run(root: Path, base: Path, fleet: Fleet) -> FleetRun:
    """Runs the fleet's phases (the model under ``root``, the nodes' stores
    and the remote under ``base``); returns what they showed."""
    out, started_after_reset = FleetRun(), {"A": False, "B": False}
    engines: dict[str, StandInEngine] = {}
    try:
        for phase in fleet.phases:
            node = phase.node
            if phase.fresh and node in engines:
                _finish(engines[node])
                engines.pop(node).close()
            if node not in engines:
                engines[node] = _engine(root, base / node, phase.server, fleet.node_settings(node))
                started_after_reset[node] = "e1" in out.epochs
                out.epochs.setdefault("e0", engines[node].ours.epoch)
                out.namespace = engines[node].ours.namespace
            engine = engines[node]
            world = "e0" if "e1" not in out.epochs else "p" if node == "A" else "e1" if started_after_reset[node] \
                else "e0+"
            prun = PhaseRun(phase, world, {engine.ours.epoch})
            prun.remote_first_blocks = {r.req_id for r in phase.server.requests if world == "e0"
                                        and _remote_holds(base / "remote", engine, r.prompt, out.epochs["e0"])}
            driver = _Driver(engine, phase.server, prun.outcome)
            engine.post_execute.append(_recorder(prun))
            while driver.busy and driver.clock < phase.server.step_bound:
                driver.tick()
            prun.outcome.unfinished += sorted(engine.sched.requests) + [r.req_id for r in driver.waiting]
            prun.outcome.outputs = [{r.req_id: engine.outputs.get(r.req_id, []) for r in phase.server.requests}]
            engine.post_execute.clear()
            _finish(engine)
            out.phases.append(prun)
            if phase.name == fleet.reset_after:
                a = engines["A"]
                assert a.sched.reset_prefix_cache(reset_connector=True), f"A's reset refused: {fleet}"
                out.epochs["e1"], out.epochs["p"] = a.ours.store.epoch(a.ours.namespace), a.ours.epoch
        out.evicting = any(e.ours.store.stats().evictions > 0 for e in engines.values())
    finally:
        for engine in engines.values():
            engine.close()
    return out


def _epochs_allowed(run: PhaseRun, epochs: dict[str, int]) -> set[int]:
    return {epochs["e0"], epochs["e1"]} if run.world == "e0+" else {epochs[run.world]}


def check_keys(fleet: Fleet, out: FleetRun) -> None:
    """Outputs, epochs, and every planned load and save keyed in its world."""
    e, ns = out.epochs, out.namespace
    assert e["e0"] == 0, f"a new fleet's epoch is {e['e0']}: {fleet}"
    if "e1" in e:
        assert e["e1"] > e["e0"] and e["p"] >= 1 << 63, f"reset gave epochs {e}: {fleet}"
    world_chains: dict[str, list[Chain]] = {}
    for prun in out.phases:
        world_chains.setdefault(prun.world.rstrip("+"), []).extend(chain_of(r) for r in prun.phase.server.requests)
    for prun in out.phases:
        name, outcome, allowed = prun.phase.name, prun.outcome, _epochs_allowed(prun, e)
        assert not outcome.unfinished, f"{outcome.unfinished} unfinished: {fleet}"
        assert prun.epochs_seen <= allowed, f"{name} ({prun.world}) keyed at {prun.epochs_seen}, not {allowed}: {fleet}"
        own = [chain_of(r) for r in prun.phase.server.requests]
        may_load = keys_at(ns, world_chains[prun.world.rstrip("+")], e[prun.world.rstrip("+")])
        may_save: set[bytes] = set()
        for epoch in allowed:
            may_save |= keys_at(ns, own, epoch)
            may_load |= keys_at(ns, own, epoch)
        for request in prun.phase.server.requests:
            rid, controls = request.req_id, dict(request.controls)
            got, expected = outcome.outputs[0][rid], greedy(list(request.prompt), request.max_tokens)
            if rid in outcome.aborted:
                assert got == expected[:len(got)], f"{rid} (aborted) output a wrong token: {fleet}"
            else:
                assert got == expected, f"{rid}'s output is wrong: {got} != {expected}: {fleet}"
            loads, saves = prun.loads.get(rid, []), prun.saves.get(rid, [])
            assert not set(loads) - may_load, f"{rid} ({prun.world}) loaded keys of another world: {fleet}"
            assert not set(saves) - may_save, f"{rid} ({prun.world}) saved keys not its own at its epoch: {fleet}"
            assert not (loads and controls.get("load") is False), f"{rid} loaded with load false: {fleet}"
            assert not (saves and not request.saves), f"{rid} saved with save false: {fleet}"


def check_remote_hits(fleet: Fleet, out: FleetRun) -> tuple[int, bool]:
    """B, before any reset and with ``load_policy: "always"``, loads hits
    where a request of its first phase (looked up, never aborted nor capped)
    has a first block A uploaded, unless a request of b1 that is not looked
    up (whole) computes that block in B's own cache first; returns (the
    blocks b1 loaded, whether hits were required)."""
    b1 = next(p for p in out.phases if p.phase.name == "b1")
    loaded = sum(map(len, b1.loads.values()))
    if b1.world != "e0" or fleet.node_settings("B")["load_policy"] != "always":
        return loaded, False
    requests = b1.phase.server.requests
    off = [r.prompt[:BS] for r in requests if set(dict(r.controls)) & {"load", "max_load_tokens"}]  # compute it
    candidates = [r.req_id for r in requests if r.req_id in b1.remote_first_blocks and r.abort_step is None
                  and set(dict(r.controls)) <= {"save"} and r.prompt[:BS] not in off]
    assert not candidates or loaded > 0, f"B loaded nothing though the remote held {candidates}' first blocks: {fleet}"
    return loaded, bool(candidates)


def stored_wrong(root: Path, store: Path, chains: dict[int, list[Chain]],
                 settings: dict[str, Any]) -> tuple[int, list[str]]:
    """(blocks found, "epoch/block" of those wrong): each chain's blocks at
    each epoch loaded into a fresh worker on ``store`` (read through where
    ``settings`` name a remote) and compared with the truth."""
    init_none_hash(sha256)
    size = max(len(t) // BS for ts in chains.values() for t in ts) + 1
    config = vllm_config(root, store, settings)
    scheduler = UcmDbConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(size))
    worker = UcmDbConnector(config, KVConnectorRole.WORKER, kv_cache_config(size))
    kv = {LAYER.format(i): torch.zeros(size, HEADS, BS, 2 * HEAD, dtype=torch.float32) for i in range(LAYERS)}
    worker.register_kv_caches(kv)
    found, wrong = 0, []
    try:
        ns = scheduler._scheduler.namespace
        for epoch, tokens in ((ep, t) for ep, ts in chains.items() for t in ts):
            keys = ns.block_keys(list(tokens), epoch=epoch)
            if not keys:
                continue
            meta = UcmDbConnectorMetadata(loads=[BlockTransfer("check", tuple(keys), tuple(range(len(keys))))],
                                          namespace=ns.id, epoch=epoch)
            worker._worker.start_load(meta)  # type: ignore[union-attr]
            missing, values = worker._worker.take_load_errors(), truth(list(tokens))  # type: ignore[union-attr]
            for b in (b for b in range(len(keys)) if b not in missing):
                found += 1
                got = [{int(v) for t in kv.values() for v in t[b, :, s, :].flatten().tolist()} for s in range(BS)]
                if got != [{v} for v in values[b * BS:(b + 1) * BS]]:
                    wrong.append(f"{epoch}/{b} of {len(tokens)} tokens")
        return found, wrong
    finally:
        worker.shutdown()
        scheduler.shutdown()


def check_stored(root: Path, base: Path, fleet: Fleet, out: FleetRun) -> None:
    """No block a node's local store or the remote holds is wrong."""
    every: dict[int, list[Chain]] = {}
    for node in "AB":
        chains: dict[int, list[Chain]] = {}
        for prun in (p for p in out.phases if p.phase.node == node):
            for epoch in _epochs_allowed(prun, out.epochs):
                chains.setdefault(epoch, []).extend(chain_of(r) for r in prun.phase.server.requests)
                every.setdefault(epoch, []).extend(chain_of(r) for r in prun.phase.server.requests)
        local = {k: v for k, v in fleet.node_settings(node).items() if k in ("capacity_bytes", "codec")}
        found, wrong = stored_wrong(root, base / node, chains, local)
        out.stored_local += found
        assert wrong == [], f"node {node}'s store holds wrong blocks {wrong}: {fleet}"
    remote = {k: v for k, v in fleet.node_settings("A").items() if k in ("remote", "remote_deadline_s")}
    found, wrong = stored_wrong(root, base / "probe", every, remote)
    out.stored_remote += found
    assert wrong == [], f"the remote holds wrong blocks {wrong}: {fleet}"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote-fleet-fuzz")


_EXERCISED: dict[int, tuple[FleetRun, int, bool]] = {}  # seed -> the run, b1's loaded blocks, hits required


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
def test_two_nodes_share_a_remote_without_wrong_or_stale_kv(root: Path, seed: int) -> None:
    base = Path(tempfile.mkdtemp(prefix=f"seed{seed}-", dir=root))  # fresh nodes and remote, also when run again
    (base / "remote").mkdir()
    fleet = draw(seed, f"file://{base / 'remote'}")
    out = run(root, base, fleet)
    _EXERCISED[seed] = (out, *check_remote_hits(fleet, out))
    check_keys(fleet, out)
    check_stored(root, base, fleet, out)


def test_the_seeds_exercise_the_fleet(root: Path) -> None:
    """The scenarios above are not vacuous: B loaded A's uploads in many,
    A reset in some (with B started after it, and running across it), a
    local store evicted in some, and blocks were found and checked in the
    nodes' stores and on the remote."""
    for seed in SEEDS:  # run alone: the scenarios the test above ran in the suite
        if seed not in _EXERCISED:
            test_two_nodes_share_a_remote_without_wrong_or_stale_kv(root, seed)
    runs = list(_EXERCISED.values())
    worlds = [{p.world for p in out.phases} for out, _, _ in runs]
    before_reset = [(b1, required) for out, b1, required in runs if out.phases[1].world == "e0"]  # b1 before a reset
    seen = {"b1 before a reset": len(before_reset), "b1 loaded": sum(b1 > 0 for b1, _ in before_reset),
            "hits required": sum(required for _, required in before_reset),
            "a2 after a reset": sum("p" in w for w in worlds), "B across it": sum("e0+" in w for w in worlds),
            "B started after the reset": sum("e1" in w for w in worlds),
            "evicting": sum(out.evicting for out, _, _ in runs),
            "remote checked": sum(out.stored_remote > 0 for out, _, _ in runs),
            "loads after the reset": sum(any(p.loads for p in out.phases if p.world == "e1") for out, _, _ in runs)}
    assert seen["b1 loaded"] >= seen["b1 before a reset"] // 2 and seen["hits required"] >= 2, seen
    assert seen["B started after the reset"] >= 3 and seen["B across it"] >= 2 and seen["evicting"] >= 1, seen
    assert seen["remote checked"] == len(SEEDS) and seen["loads after the reset"] >= 1, seen
