"""Review (seeded, model-based): hybrid models (full attention beside sliding-window and/or SSM state groups) under
preemptions, async loads, aborts and damaged or lost units, through vLLM's real ``Scheduler`` / ``AsyncScheduler``,
both halves of ucm-db's connector and a real LMDB store (docs/connector.md: "Hybrid models", "Preemption"), with
test_audit_hybrid_harness.py's stand-in (it reads the real slots and state: a wrong load changes the outputs) at each
group's own block size (a 64-token window group beside 32-token full attention, as vLLM makes Gemma 4's). A seed: a
warm engine stores prefixes of three roots; one or two engines on that store (stepped in turn; window groups of 32 and
64 tokens may mix), with a drawn scheduler, ``load_mode``, budget, ``save_decode`` and a KV cache 1-3 blocks above
their largest request, serve 4-8 requests (prefixes, repeats, next turns), some aborted at a step or while their async
load runs, some with a unit or state flipped before their lookup; a step may lose a unit of a planned load (another
engine's eviction). Invariants:
    * every output is greedy over the right KV and state (an aborted one's: a prefix of it);
    * between steps every running request's computed slots (non-null blocks of each attention group) and running SSM
      state hold their truth: no group loaded KV or a state of another prefix, nor into another request's block;
    * every stored unit of every group holds its key's truth (a state unit: the state after its boundary); every
      finished request's prompt blocks are stored in full attention (admit_after 1) unless a fault touched its chain
      (a unit lost under its own failed load it stores again);
    * every async load planned is reported finished exactly once; vLLM is never handed block ids (it stops the engine).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
import vllm.v1.kv_cache_interface as specs_of  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import test_audit_hybrid_harness as harness  # noqa: E402
from test_audit_hybrid_harness import LAYERS, STATE0, VOCAB, WINDOW, _mamba, _slot, _state  # noqa: E402
from test_review_preemption_async_fuzz import damage_unit  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

BS = 32
CONFIGS = {"window+full": (("window", "full"), {"window": 32, "full": 32}),  # groups in vLLM's order, block sizes
           "window64+full": (("window", "full"), {"window": 64, "full": 32}),
           "mamba+full": (("mamba", "full"), {"mamba": 32, "full": 32}),
           "mamba+window+full": (("mamba", "window", "full"), {"mamba": 32, "window": 32, "full": 32})}
DEFAULT_SEEDS = range(1, 17)
SEEDS = [pytest.param(s, marks=[] if s in DEFAULT_SEEDS else [pytest.mark.long]) for s in range(1, 65)]
MAX_ROUNDS = 500
SETTINGS = {"load_policy": "always", "admit_after": 1}
TALLIES: dict[int, Counter[str]] = {}
Chain = tuple[int, ...]


def trace(tokens: Chain, kinds: tuple[str, ...], slots: list[int], states: list[int]) -> tuple[list[int], list[int]]:
    """Right slots and states (``states[n]``: after ``n`` tokens), extending those of a prefix ([], [STATE0])."""
    for q in range(len(slots), len(tokens)):
        near = slots[q - 1] if "window" in kinds and q else 0
        far = slots[q - WINDOW + 1] if "window" in kinds and q >= WINDOW - 1 else 0
        slots.append(_slot(slots[-1] if q else 0, states[q], tokens[q], q, near, far))
        states.append(_state(states[q], tokens[q], q) if "mamba" in kinds else states[q])
    return slots, states


def truth_chain(prompt: Chain, n: int, kinds: tuple[str, ...]) -> tuple[Chain, list[int], list[int]]:
    """``prompt`` and its ``n`` greedy outputs (test_audit_hybrid_harness.greedy), with their trace."""
    tokens, (slots, states) = list(prompt), trace(prompt, kinds, [], [STATE0])
    for _ in range(n):
        tokens.append(harness._sample(slots[-1], states[-1]))
        trace(tuple(tokens), kinds, slots, states)
    return tuple(tokens), slots, states


def kv_config(num_blocks: int, kinds: tuple[str, ...], bs: dict[str, int]) -> specs_of.KVCacheConfig:
    window = bs.get("window", BS)  # vLLM's groups have one page size: a 64-token window group, half the head size
    specs = {"mamba": _mamba(),
             "full": specs_of.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32),
             "window": specs_of.SlidingWindowSpec(block_size=window, num_kv_heads=2, head_size=64 * BS // window,
                                                  dtype=torch.float32, sliding_window=WINDOW)}
    return specs_of.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[specs_of.KVCacheGroupSpec([LAYERS[k]], specs[k]) for k in kinds])


def state_of(kv: torch.Tensor, block: int) -> int:
    return int(kv[block].flatten()[:8].view(torch.int64)[0])  # where the harness's stand-in keeps a state


def slots_of(kv: torch.Tensor, block: int, end: int) -> list[float]:  # NaN where a slot's heads and columns differ
    page = kv[block, :, :end, :].permute(1, 0, 2).reshape(end, -1)
    return torch.where((page == page[:, :1]).all(1), page[:, 0], torch.nan).tolist()


class Runner(harness._Runner):
    """ucm-db's worker half and the audit harness's stand-in, at each group's block size."""

    def __init__(self, config: Any, num_blocks: int, kinds: tuple[str, ...], bs: dict[str, int]) -> None:
        self.kinds, self.bs, self.reqs, self.state_idx = kinds, bs, {}, {}
        self.kv = {k: torch.zeros(specs_of.compute_layer_kv_cache_shape_bytes(_mamba(), num_blocks), dtype=torch.int8)
                   if k == "mamba" else torch.zeros(num_blocks, 2, bs[k], 128 * BS // bs[k]) for k in kinds}
        self.connector = UcmDbConnector(config, KVConnectorRole.WORKER, kv_config(num_blocks, kinds, bs))
        self.connector.register_kv_caches({LAYERS[k]: t for k, t in self.kv.items()})

    def _read_slot(self, req: dict[str, Any], kind: str, q: int) -> int:
        block = req["tables"][kind][q // self.bs[kind]]
        values = set(self.kv[kind][block, :, q % self.bs[kind], :].flatten().tolist()) if block else {-2.0, -3.0}
        return int(values.pop()) if len(values) == 1 else -1  # vLLM's null block is never read right

    def _write_slot(self, req: dict[str, Any], q: int, value: int) -> None:
        for k in (k for k in ("window", "full") if k in self.kinds):
            self.kv[k][req["tables"][k][q // self.bs[k]], :, q % self.bs[k], :] = float(value)


class Engine(harness.HybridEngine):
    """vLLM's scheduler (block size: the groups' lcm) and :class:`Runner`; ``before_load``: a fault to inject."""

    def __init__(self, root: Path, store: Path, config_name: str, *, num_blocks: int = 160, overlapped: bool = False,
                 budget: int = 4096, extra: dict[str, Any] | None = None) -> None:
        init_none_hash(sha256)
        self.config, (self.kinds, self.bs) = config_name, CONFIGS[config_name]
        config = harness._config(root, store, num_blocks, budget, {**SETTINGS, **(extra or {})})
        config.scheduler_config.async_scheduling = overlapped
        scheduler, kv = AsyncScheduler if overlapped else Scheduler, kv_config(num_blocks, self.kinds, self.bs)
        self.sched = scheduler(config, kv, StructuredOutputManager(config), max(self.bs.values()), BS)
        self.runner = Runner(config, num_blocks, self.kinds, self.bs)
        self.hasher, self.overlapped, self.outputs = get_request_block_hasher(BS, sha256), overlapped, {}
        self._in_flight = self.last = self.before_load = None

    @property
    def parts(self) -> list[Any]:  # ucm-db's scheduler half of each group
        return self.sched.connector._scheduler.parts  # type: ignore[union-attr]

    def step(self) -> None:
        """One step in the engine core's order (overlapped: ``schedule(N+1)``, ``execute(N+1)``, ``update(N)``)."""
        so = self.sched.schedule() if self.sched.has_requests() else None
        if so is not None and self.before_load is not None:
            self.before_load, hook = None, self.before_load
            hook(so.kv_connector_metadata)
        self.last = None if so is None else (so, self.runner.execute(so))
        back, self._in_flight = (self._in_flight, self.last) if self.overlapped else (self.last, None)
        if back is not None:  # the step whose output is back
            self._update(*back)


@dataclass(frozen=True)
class Arrival:
    req_id: str
    prompt: Chain = field(repr=False)
    max_tokens: int
    admit_round: int  # admitted before this round's step
    abort_round: int | None  # aborted before this round's step
    abort_waiting: bool  # aborted the first round it waits for an async load
    damage: tuple[int, int] | None  # (group, block) whose stored unit is flipped before its lookup


@dataclass(frozen=True)
class Server:  # an engine of the main phase
    config: str
    overlapped: bool
    load_mode: str
    num_blocks: int
    budget: int
    lose_chance: float  # per step: a unit of one planned load deleted before the load
    save_decode: bool
    requests: tuple[Arrival, ...]


def draw(seed: int) -> tuple[str, list[Chain], tuple[Server, ...]]:
    """The warm engine's config and prompts, and the main phase's engines (window configs may mix)."""
    rng, family = random.Random(9100 + seed), [list(CONFIGS)[seed % len(CONFIGS)]]
    family = ["window+full", "window64+full"] if family[0].startswith("window") else family
    roots = [tuple(rng.randrange(VOCAB) for _ in range(8 * BS)) for _ in range(3)]
    warm = [root[:rng.randint(2, 7) * BS + rng.choice([1, 9])] for root in roots]
    servers = []
    for e in range(rng.choice([1, 2, 2])):
        out: list[Arrival] = []
        kinds, bs = CONFIGS[config := rng.choice(family)]
        for i in range(rng.randint(4, 8)):
            turn, admit, kind = rng.random(), rng.choice([0, 0, 0, 1, 2, 4, 6]), rng.random()
            if out and turn < 0.15:
                prompt = rng.choice(out).prompt
            elif out and turn < 0.3:  # a next turn: an earlier request's prompt and outputs, then a question
                prev = rng.choice(out)
                prompt = truth_chain(prev.prompt, prev.max_tokens, kinds)[0]
                prompt += tuple(rng.randrange(VOCAB) for _ in range(rng.choice([1, 9])))
                admit = prev.admit_round + rng.choice([3, 20, 40])
            else:  # a root's prefix, at a block boundary or not, and a tail (none: the prefix alone)
                prompt = rng.choice(roots)[:rng.randint(1, 7) * BS + rng.choice([0, 1, 7, 20])]
                prompt += tuple(rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 5, 30])))
            damage = (rng.randrange(len(kinds)), rng.randrange(len(prompt) // 64 + 1)) if rng.random() < 0.25 else None
            out.append(Arrival(f"h{seed}-{e}-{i}", prompt, rng.choice([3, 20, 45, 70]), admit,
                               admit + rng.randint(1, 12) if kind < 0.12 else None, 0.12 <= kind < 0.35, damage))
        tokens = max(len(r.prompt) + r.max_tokens for r in out)  # the most blocks a request holds (a whole prefill)
        largest = -(-tokens // BS) + (-(-tokens // bs["window"]) if "window" in kinds else 0) + 3 * ("mamba" in kinds)
        servers.append(Server(config, rng.random() < 0.4, rng.choice(["block", "layer", "async"]),
                              largest + rng.choice([1, 2, 3]), rng.choice([4096, 4096, 96, 160]),
                              rng.choice([0.0, 0.3, 0.5]), rng.random() < 0.5,
                              tuple(sorted(out, key=lambda r: r.admit_round))))
    return family[0], warm, tuple(servers)


class Run:
    """One engine of the main phase and what it did (each violation kept as text); ``faults``: (prefix of the chains
    a fault touched, the request whose load it failed), shared by the seed's engines."""

    def __init__(self, server: Server, engine: Engine, rng: random.Random, faults: list[tuple[Chain, str]]) -> None:
        self.server, self.engine, self.rng, self.faults = server, engine, rng, faults
        self.waiting, self.violations, self.stuck_rounds = list(server.requests), list[str](), 0
        self.truths = {a.req_id: truth_chain(a.prompt, a.max_tokens, engine.kinds) for a in server.requests}
        self.planned, self.reported, self.tally = Counter[str](), Counter[str](), Counter[str]()  # async loads: by id
        self.aborted, self.preempted, self.failed = set[str](), set[str](), set[str]()  # failed: their async load

    def observe(self, so: Any, out: Any) -> None:
        meta, kv_out = so.kv_connector_metadata, out.kv_connector_output
        loading, preempted, failed = ({t.req_id for g in meta.groups for t in g.async_loads}, set(so.preempted_req_ids
                                      or ()), set(kv_out.failed_recving or ()))
        self.planned.update(loading)
        self.reported.update(kv_out.finished_recving or ())
        self.tally.update(resumed_loads=len(loading & self.preempted), preempted=len(preempted),
                          async_loads=sum(len(g.async_loads) for g in meta.groups), failed_loads=len(failed))
        self.preempted, self.failed = self.preempted | preempted, self.failed | failed
        if kv_out.invalid_block_ids:
            self.violations.append(f"block ids {kv_out.invalid_block_ids} reported (vLLM stops a hybrid engine)")

    def lose(self, meta: Any) -> None:  # another engine evicts a unit of a planned load (and its descendants)
        planned = [(g, t) for g, m in enumerate(meta.groups) for t in m.async_loads if t.keys]
        if planned:
            g, t = self.rng.choice(planned)
            part, index = self.engine.parts[g], self.rng.randrange(len(t.keys))
            assert part.store.delete(part.namespace, [unit_key(t.keys[index], part._spans[-1], part._grid)]) >= 1
            req, bs = self.engine.sched.requests[t.req_id], self.engine.bs[self.engine.kinds[g]]
            block = part.keys_for(req, len(req.all_token_ids) // bs).index(t.keys[index])
            self.faults.append((tuple(req.all_token_ids[:(block + 1) * bs]), t.req_id))  # with its descendants
            self.tally[f"lost_{self.engine.kinds[g]}"] += 1

    def admit(self, a: Arrival) -> None:
        self.engine.add(a.req_id, list(a.prompt), a.max_tokens)  # looked up at the next step
        req = self.engine.sched.requests[a.req_id]
        if a.damage is not None:
            g, block = a.damage
            part, bs = self.engine.parts[g], self.engine.bs[self.engine.kinds[g]]
            last = (len(a.prompt) - 1) // BS - 1  # a state group: the boundary a lookup hits (states are sparse)
            block = last if self.engine.kinds[g] == "mamba" else min(block, len(a.prompt) // bs - 1)
            if block >= 0 and damage_unit(SimpleNamespace(ours=part), part.keys_for(req, block + 1)[block]):
                self.faults.append((a.prompt[:(block + 1) * bs], ""))  # stays until a load reads it: no one mends it
                self.tally[f"damaged_{self.engine.kinds[g]}"] += 1

    def check_owned(self, rnd: int) -> None:
        """Every running request's computed slots (non-null blocks) and running state hold their truth."""
        for r in (engine := self.engine).sched.running:
            tokens, slots, states = self.truths[r.request_id]
            n = min(r.num_computed_tokens, len(r.all_token_ids))
            if tuple(r.all_token_ids[:n]) != tokens[:n]:
                continue  # its outputs are wrong: the output check fails it
            ids = engine.sched.kv_cache_manager.get_block_ids(r.request_id)
            for g, kind in enumerate(engine.kinds):
                bs, tensor = engine.bs[kind], engine.runner.kv[kind]
                curr = -(-r.num_computed_tokens // BS) - 1  # a state group's running block
                if kind == "mamba" and n == r.num_computed_tokens and 0 <= curr < len(ids[g]) and ids[g][curr]:
                    self.tally["state_checks"] += 1
                    if state_of(tensor, ids[g][curr]) != states[n]:
                        self.violations.append(f"round {rnd}: {r.request_id}'s running state is wrong")
                for b in (b for b in range(-(-n // bs)) if kind != "mamba" and ids[g][b]):  # null blocks skipped
                    end = min(n, (b + 1) * bs) - b * bs
                    self.tally["owned_checks"] += 1
                    if slots_of(tensor, ids[g][b], end) != [float(v) for v in slots[b * bs:b * bs + end]]:
                        self.violations.append(f"round {rnd}: {r.request_id}'s {kind} block {b} is wrong")

    def unstick(self) -> None:
        """Aborts the head of vLLM's own deadlock (not ucm-db's): a request whose async load failed heads its queue
        of KV holders holding none, needs more than are free, and stops the loop before one that would free some."""
        sched, queue = self.engine.sched, list(self.engine.sched.kv_holding_waiting)
        stuck = (len(queue) > 1 and queue[0].status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                 and queue[0].num_computed_tokens == 0
                 and any(r.request_id in sched.finished_recving_kv_req_ids for r in queue[1:]))
        self.stuck_rounds = self.stuck_rounds + 1 if stuck else 0
        if self.stuck_rounds >= 3:
            sched.finish_requests(queue[0].request_id, RequestStatus.FINISHED_ABORTED)
            self.aborted.add(queue[0].request_id)
            self.tally["vllm_deadlock_aborted"] += 1

    def round(self, rnd: int) -> None:
        engine = self.engine
        self.check_owned(rnd)
        while self.waiting and self.waiting[0].admit_round < rnd:
            self.admit(self.waiting.pop(0))
        for a in self.server.requests:
            req = engine.sched.requests.get(a.req_id)
            loading = req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if req is not None and not req.is_finished() and (a.abort_round == rnd or a.abort_waiting and loading):
                engine.sched.finish_requests(a.req_id, RequestStatus.FINISHED_ABORTED)
                self.aborted.add(a.req_id)
                self.tally.update(aborted=1, aborted_loading=loading)
        self.unstick()
        if self.rng.random() < self.server.lose_chance:
            engine.before_load = self.lose
        engine.step()
        if engine.last is not None:
            self.observe(*engine.last)
        engine.last = None


def check_store(root: Path, store: Path, runs: list[Run], tally: Counter[str]) -> None:
    """Stored units hold their keys' truth (sync loads by each config's workers); prompts are in full attention."""
    chains = {a.prompt + tuple(run.engine.outputs.get(a.req_id, [])): (run, a)
              for run in runs for a in run.server.requests}
    for config in {run.server.config for run in runs}:
        checker = Engine(root, store, config, num_blocks=max(map(len, chains)) // BS + 2)
        worker = checker.runner.connector._worker  # type: ignore[union-attr]
        try:
            traces = {tokens: trace(tokens, checker.kinds, [], [STATE0]) for tokens in chains}
            for (tokens, (run, a)), (g, kind) in ((c, k) for c in chains.items() for k in enumerate(checker.kinds)):
                part, size, tensor = checker.parts[g], checker.bs[kind], checker.runner.kv[kind]
                slots, states = traces[tokens]
                probe = Request(f"check-{a.req_id}", list(tokens), SamplingParams(max_tokens=1), None)
                keys = part.keys_for(probe, len(tokens) // size)
                worker.parts[g].start_load(UcmDbConnectorMetadata(
                    loads=[BlockTransfer("check", tuple(keys), tuple(range(1, len(keys) + 1)))],
                    namespace=part.namespace.id, epoch=part.epoch or 0))
                missing = worker.parts[g].take_load_errors()
                for b in (b for b in range(len(keys)) if b + 1 not in missing):
                    tally[f"stored_{kind}"] += 1
                    got, want = (state_of(tensor, b + 1), states[(b + 1) * BS]) if kind == "mamba" else (
                        slots_of(tensor, b + 1, size), [float(v) for v in slots[b * size:(b + 1) * size]])
                    assert got == want, f"{a.req_id}'s chain: {kind} block {b} stored wrong"
                tensor.zero_()
                touched = {loader for prefix, loader in run.faults if tokens[:len(prefix)] == prefix}
                mends = touched == {a.req_id} and a.req_id in run.failed  # its failed load: it saves again
                if kind != "full" or run.server.config != config or a.req_id in run.aborted or touched and not mends:
                    continue
                gaps = [b for b in range(len(a.prompt) // BS) if b + 1 in missing]
                assert gaps == [], f"{a.req_id}'s prompt blocks {gaps} not stored ({run.server})"
                tally.update(must_store_checked=1, mended_checked=mends)
        finally:
            checker.close()


def run_seed(root: Path, seed: int) -> Counter[str]:
    config, warm, servers = draw(seed)
    writer = Engine(root, root / "store", config)
    for i, prompt in enumerate(warm):
        writer.add(f"h{seed}-warm-{i}", list(prompt), 1)
    while writer.sched.has_requests():
        writer.step()
    writer.close()
    rng, faults, runs = random.Random(seed), list[tuple[Chain, str]](), list[Run]()
    try:
        for s in servers:
            runs.append(Run(s, Engine(root, root / "store", s.config, num_blocks=s.num_blocks, overlapped=s.overlapped,
                                      budget=s.budget, extra={"load_mode": s.load_mode, "save_decode": s.save_decode}),
                            rng, faults))
        rnd, done = 0, lambda: all(not r.waiting and not r.engine.sched.has_requests() and not r.engine._in_flight
                                   for r in runs)
        while not done() and rnd < MAX_ROUNDS:
            rnd += 1
            for run in runs:
                run.round(rnd)
        assert done(), f"unfinished: {servers}"
    finally:
        for run in runs:
            run.engine.close()
    tally = Counter[str](rounds=rnd, two_engines=len(runs) == 2, mixed_block_sizes=len({s.config for s in servers}) > 1)
    for run in runs:
        assert run.violations == [], f"{run.violations[:4]}: {run.server}"
        assert run.planned == run.reported, f"async loads planned {run.planned}, reported {run.reported}"
        for a in run.server.requests:
            got, want = run.engine.outputs.get(a.req_id, []), list(run.truths[a.req_id][0][len(a.prompt):])
            assert got == (want[:len(got)] if a.req_id in run.aborted else want), f"{a.req_id}'s output is wrong"
        tally += run.tally + Counter(overlapped=run.server.overlapped, **{f"config_{run.server.config}": 1})
    check_store(root, root / "store", runs, tally)
    return tally


@pytest.mark.parametrize("seed", SEEDS)
def test_hybrid_preemptions_and_faults_keep_outputs_and_store_right(tmp_path: Path, seed: int) -> None:
    TALLIES[seed] = run_seed(tmp_path, seed)


def test_the_seeds_reach_every_path() -> None:
    if set(TALLIES) != set(DEFAULT_SEEDS):
        pytest.skip("needs the default seeds, without --long (run the whole file)")
    total = sum(TALLIES.values(), Counter[str]())
    floors = {"preempted": 12, "resumed_loads": 4, "async_loads": 100, "failed_loads": 15, "aborted_loading": 10,
              "lost_full": 2, "lost_window": 2, "lost_mamba": 2, "damaged_full": 5, "damaged_window": 2,
              "damaged_mamba": 1, "mended_checked": 3, "state_checks": 1000, "owned_checks": 10000, "stored_mamba": 100,
              "stored_window": 100, "must_store_checked": 30, "mixed_block_sizes": 1, "two_engines": 4, "overlapped": 3,
              **{f"config_{name}": 2 for name in CONFIGS}}
    assert {k: total[k] for k, floor in floors.items() if total[k] < floor} == {}, dict(total)
