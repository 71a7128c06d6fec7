"""Preemptions and asynchronous loads through vLLM's real ``Scheduler`` / ``AsyncScheduler``, both halves of ucm-db's
connector, a real LMDB store and the stand-in runner (stand_in_engine.py), against docs/connector.md (Preemption;
``load_mode``; failed loads under ``kv_load_failure_policy: recompute``; async scheduling).

A seed: a warm engine stores prefixes of three roots; then one or two engines on that store, stepped in turn, each
with a KV cache a few blocks above its largest request (vLLM preempts: recompute preemption), a drawn ``load_mode``
(block, layer, async), scheduler (sync or overlapped), token budget and ``save_decode``, run 4-7 requests over the
roots' prefixes (some twice); some are aborted at a step, some the round they wait for an async load; some prompts
have a stored unit damaged before their lookup, and a step's load may lose a unit between lookup and load (another
engine's eviction). Invariants:
    * every request's output is greedy over the right KV (an aborted one's: a prefix of it);
    * no stored block holds other KV than its tokens' truth, and every block a finished request computed is stored
      (admit_after 1, ``save_decode``; the async-scheduling last decode block excepted, and blocks another's fault
      may have taken since), a preempted request's too (it saves again after resuming), and one whose load failed;
    * between steps every running request's computed slots hold their truth, so no load wrote into a block another
      request owns (blocks a sync load failed on in the last steps skipped: vLLM and the stale-block tracker
      recompute them);
    * every async load planned is reported finished exactly once (one aborted while it runs too);
    * every seed ends within ``MAX_ROUNDS`` rounds.
Defect found and fixed (its repros at the end): a block id left stale by a failed async load (its request aborted
while it ran) stayed stale after another request's async load filled it; under async scheduling the stale-read report
rewound a request whose next step already ran, and its outputs went wrong (a wider sweep of this fuzz hit it).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from stand_in_engine import BS, HEAD, VOCAB, StandInEngine, greedy, lose_unit, truth  # noqa: E402
from test_review_save_fuzz import stored_map  # noqa: E402
from ucm_db.components import local_tier  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

SEEDS = range(1, 19)
MAX_ROUNDS = 400
RECENT = 8  # steps a failed sync load's blocks stay skipped by the ownership check
SETTINGS = {"load_policy": "always", "admit_after": 1}
TALLIES: dict[int, Counter[str]] = {}
Chain = tuple[int, ...]


@dataclass(frozen=True)
class Fault:
    """A stored unit damaged or lost: the tokens of the block it hit (with their prefix)."""
    round: int
    prefix: Chain = field(repr=False)
    loader: str | None  # the request whose planned load lost it; None: damaged before a lookup


@dataclass(frozen=True)
class Arrival:
    req_id: str
    prompt: Chain = field(repr=False)
    max_tokens: int
    admit_round: int
    abort_round: int | None = None  # aborted before this round's step
    abort_waiting: bool = False  # aborted the first round it waits for an async load
    damage_block: int | None = None  # a block of its prompt whose stored unit is damaged before its lookup


@dataclass(frozen=True)
class Server:
    """One engine of a seed's main phase."""
    overlapped: bool  # vLLM's AsyncScheduler
    load_mode: str
    num_blocks: int
    budget_tokens: int
    save_decode: bool
    lose_chance: float  # per step: a unit of one planned load deleted before the load
    requests: tuple[Arrival, ...]


def draw(seed: int) -> tuple[list[list[int]], tuple[Server, ...]]:
    """The warm engine's prompts and the main phase's engines."""
    rng = random.Random(5300 + seed)
    roots = [[rng.randrange(VOCAB) for _ in range(6 * BS)] for _ in range(3)]
    warm = [root[:rng.randint(2, 6) * BS + 1] for root in roots[:2]] + [roots[2][:rng.randint(1, 3) * BS + 5]]
    servers = []
    for e in range(rng.choice([1, 2, 2])):
        out: list[Arrival] = []
        for i in range(rng.randint(4, 7)):
            if out and rng.random() < 0.2:
                prompt = list(rng.choice(out).prompt)
            else:
                prompt = rng.choice(roots)[:rng.randint(1, 6) * BS + rng.choice([0, 1, 7, 20])]
                prompt += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 30]))]
            admit, kind = rng.choice([0, 0, 0, 1, 2, 4, 6]), rng.random()
            out.append(Arrival(f"pa-{seed}-{e}-{i}", tuple(prompt), rng.choice([3, 20, 45, 60]), admit,
                               admit + rng.randint(1, 12) if kind < 0.15 else None, 0.15 <= kind < 0.35,
                               rng.randrange(len(prompt) // BS) if rng.random() < 0.15 else None))
        largest = max(-(-(len(r.prompt) + r.max_tokens) // BS) for r in out)
        servers.append(Server(rng.random() < 0.4, rng.choice(["block", "layer", "async", "async"]),
                              largest + rng.choice([1, 2, 2, 3]), rng.choice([4096, 4096, 96, 160]), rng.random() < 0.7,
                              rng.choice([0.0, 0.3, 0.6]), tuple(sorted(out, key=lambda r: r.admit_round))))
    return warm, tuple(servers)


def damage_unit(engine: StandInEngine, key: bytes) -> bool:
    """Flips the last byte of the first unit stored under block ``key`` (as a bad sector would); False if none."""
    ours = engine.ours
    unit = unit_key(key, ours._spans[0], ours._grid)

    def flip(txn: Any) -> bool:
        body = txn.get("blocks", unit)
        if body is None:
            return False
        body = bytearray(body)
        body[-1] ^= 0xFF
        txn.put("blocks", unit, bytes(body))
        return True
    return bool(local_tier(ours.store).engine.write(flip))


@dataclass
class Run:
    """One engine of the main phase and what it did, as it did it (each violation kept as text)."""
    server: Server
    engine: StandInEngine
    rng: random.Random
    faults: list[Fault]  # shared by the seed's engines
    waiting: list[Arrival] = field(default_factory=list)
    clock: int = 0
    planned: Counter[str] = field(default_factory=Counter)  # async loads, by request
    reported: Counter[str] = field(default_factory=Counter)  # finished_recving, by request
    preempted: set[str] = field(default_factory=set)
    resumed_saves: set[str] = field(default_factory=set)  # preempted requests that saved after their preemption
    aborted: set[str] = field(default_factory=set)
    invalid: deque[set[int]] = field(default_factory=lambda: deque(maxlen=RECENT))
    violations: list[str] = field(default_factory=list)
    tally: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.waiting = list(self.server.requests)
        self.engine.sched.scheduler_config.max_num_batched_tokens = self.server.budget_tokens
        self.engine.post_execute.append(lambda eng, so, out: self.observe(so, out))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.engine.sched.has_requests() and self.engine._in_flight is None

    def observe(self, so: Any, out: Any) -> None:
        meta, kv_out = so.kv_connector_metadata, out.kv_connector_output
        self.planned.update(t.req_id for t in meta.async_loads)
        self.tally.update(sync_loads=len(meta.loads), async_loads=len(meta.async_loads))
        self.preempted |= set(so.preempted_req_ids or ())
        self.resumed_saves |= {t.req_id for t in meta.saves if t.req_id in self.preempted}
        self.tally["resumed_loads"] += sum(t.req_id in self.preempted for t in [*meta.loads, *meta.async_loads])
        self.reported.update(kv_out.finished_recving or ())
        self.invalid.append(set(kv_out.invalid_block_ids))
        self.tally["failed_blocks"] += len(kv_out.invalid_block_ids)
        self.tally["stale_reads_overlapped"] += bool(meta.stale_reads) and self.server.overlapped  # the fixed defect's signature

    def lose(self, meta: Any) -> None:
        """Another engine evicts a unit of one planned load (with its descendants) before the load reads it."""
        transfers = [*meta.loads, *meta.async_loads]
        if not transfers:
            return
        t = self.rng.choice(transfers)
        index, req = self.rng.randrange(len(t.keys)), self.engine.sched.requests[t.req_id]
        keys = self.engine.ours.keys_for(req, len(req.all_token_ids) // BS)
        block = keys.index(t.keys[index])
        self.faults.append(Fault(self.clock, tuple(req.all_token_ids[:(block + 1) * BS]), t.req_id))
        lose_unit(self.engine, t, index)
        self.tally["lost_units"] += 1

    def admit(self, a: Arrival) -> None:
        engine = self.engine
        req = Request(a.req_id, list(a.prompt), SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                                                               ignore_eos=True), None, block_hasher=engine.hasher)
        if a.damage_block is not None:
            key = engine.ours.keys_for(req, a.damage_block + 1)[a.damage_block]
            if damage_unit(engine, key):
                self.faults.append(Fault(self.clock, a.prompt[:(a.damage_block + 1) * BS], None))
                self.tally["damaged_units"] += 1
        engine.sched.add_request(req)

    def check_owned(self, rnd: int) -> None:
        """Every running request's computed slots hold their truth (a load into a block it owns would not)."""
        engine, skip = self.engine, set().union(*self.invalid)
        for r in engine.sched.running:
            ids = engine.sched.kv_cache_manager.get_block_ids(r.request_id)[0]
            n = min(r.num_computed_tokens, len(r.all_token_ids))
            if n == 0 or skip & set(ids):
                continue
            blocks = torch.tensor(ids[:-(-n // BS)])
            got = torch.stack([t[:, :, :, ::HEAD][blocks] for t in engine.runner.kv.values()])  # a K and a V column
            got = got.permute(1, 3, 0, 2, 4).reshape(len(blocks) * BS, -1)[:n]
            bad = (got != torch.tensor(truth(list(r.all_token_ids[:n])), dtype=torch.float32)[:, None]).any(1)
            self.tally["owned_checks"] += 1
            if bad.any():
                q = int(bad.nonzero()[0])
                self.violations.append(f"round {rnd}: {r.request_id}'s slot {q} (block {ids[q // BS]}) is wrong")

    def round(self, rnd: int) -> None:
        engine, self.clock = self.engine, rnd
        self.check_owned(rnd)
        while self.waiting and self.waiting[0].admit_round < rnd:
            self.admit(self.waiting.pop(0))
        for a in self.server.requests:
            req = engine.sched.requests.get(a.req_id)
            if req is None or req.is_finished():
                continue
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if a.abort_round == rnd or (a.abort_waiting and loading):
                engine.sched.finish_requests(a.req_id, RequestStatus.FINISHED_ABORTED)
                self.aborted.add(a.req_id)
                self.tally.update(aborted=1, aborted_loading=loading)
        if self.rng.random() < self.server.lose_chance:
            engine.runner.before_load = self.lose
        if engine.sched.has_requests():
            engine.step()
        elif engine._in_flight is not None:
            engine._update(*engine._in_flight)
            engine._in_flight = None


def must_store(server: Server, a: Arrival) -> int:
    """Leading blocks of ``a``'s chain it must have stored (admit_after 1; ``save_decode``)."""
    computed = len(a.prompt) + a.max_tokens - 1
    end = computed // BS if server.save_decode else len(a.prompt) // BS
    if server.overlapped and a.max_tokens > 1 and computed % BS == 0 and end == computed // BS:
        end -= 1  # test_review_request_controls_fuzz: test_async_scheduling_never_saves_the_last_decode_block
    return end


def exempt_from(a: Arrival, tokens: Chain, faults: list[Fault]) -> int | None:
    """The first block of ``a``'s chain that another's fault may have taken after ``a`` stored it (a damaged unit
    stays until a load reads it; a lost one takes its descendants), None if none: ``a``'s own failed load and a loss
    before its lookup it must mend by saving again."""
    hits = [len(f.prefix) // BS - 1 for f in faults if tokens[:len(f.prefix)] == f.prefix
            and (f.loader is None or (f.loader != a.req_id and f.round > a.admit_round))]
    return min(hits, default=None)


def check_store(root: Path, store: Path, runs: list[Run], tally: Counter[str]) -> None:
    """No stored block wrong; every block a finished request computed stored (but those :func:`exempt_from`)."""
    chains: dict[Chain, list[tuple[Run, Arrival]]] = {}
    for run in runs:
        for a in run.server.requests:
            chains.setdefault(a.prompt + tuple(run.engine.outputs.get(a.req_id, [])), []).append((run, a))
    for tokens in chains:
        if any(longer[:len(tokens)] == tokens for longer in chains if len(longer) > len(tokens)):
            continue  # checked with the longer chain: the same keys
        present, wrong = stored_map(root, store, list(tokens), {})
        assert wrong == [], f"blocks {wrong} of {chains[tokens][0][1].req_id}'s chain stored wrong"
        tally["stored_blocks"] += sum(present)
        for run, a in (held for shorter, reqs in chains.items() if tokens[:len(shorter)] == shorter for held in reqs):
            if a.req_id in run.aborted:
                continue
            exempt = exempt_from(a, tokens, run.faults)
            end = min(must_store(run.server, a), len(tokens) // BS if exempt is None else exempt)
            missing = [b for b in range(end) if not present[b]]
            assert missing == [], f"{a.req_id} (preempted: {a.req_id in run.preempted}): blocks {missing} not stored"
            tally["must_store_checked"] += end > 0
            tally["preempted_stored_checked"] += end > 0 and a.req_id in run.preempted
            tally["fault_mended_checked"] += end > 0 and any(tokens[:len(f.prefix)] == f.prefix for f in run.faults)


def run_seed(root: Path, seed: int, runs: list[Run]) -> Counter[str]:
    warm, servers = draw(seed)
    store = root / "store"
    writer = StandInEngine(root, store, extra=SETTINGS)
    for i, prompt in enumerate(warm):
        writer.add(f"pa-{seed}-warm-{i}", prompt, 1)
    writer.run()
    writer.close()
    rng, faults = random.Random(seed), list[Fault]()
    try:
        for s in servers:
            extra = {**SETTINGS, "load_mode": s.load_mode, "save_decode": s.save_decode}
            runs.append(Run(s, StandInEngine(root, store, overlapped=s.overlapped, num_blocks=s.num_blocks,
                                             extra=extra), rng, faults))
        for rnd in range(1, MAX_ROUNDS + 1):
            if all(run.done for run in runs):
                break
            for run in runs:
                run.round(rnd)
        assert all(run.done for run in runs), f"unfinished after {MAX_ROUNDS} rounds: {servers}"
    finally:
        for run in runs:
            run.engine.close()
    tally = Counter[str](rounds=rnd, two_engines=len(runs) == 2)
    for run in runs:
        assert run.violations == [], f"{run.violations[:4]}: {run.server}"
        assert run.planned == run.reported, f"async loads planned {run.planned}, reported {run.reported}"
        for a in run.server.requests:
            got, want = run.engine.outputs.get(a.req_id, []), greedy(list(a.prompt), a.max_tokens)
            assert got == (want[:len(got)] if a.req_id in run.aborted else want), f"{a.req_id}'s output is wrong"
        tally += run.tally + Counter(preempted=len(run.preempted), resumed_saves=len(run.resumed_saves),
                                     overlapped=run.server.overlapped, **{f"mode_{run.server.load_mode}": 1})
    check_store(root, store, runs, tally)
    return tally


@pytest.mark.parametrize("seed", SEEDS)
def test_preemptions_and_async_loads_keep_outputs_and_store_right(tmp_path: Path, seed: int) -> None:
    TALLIES[seed] = run_seed(tmp_path, seed, [])


def test_the_seeds_reach_every_path() -> None:
    if set(TALLIES) != set(SEEDS):
        pytest.skip("needs every seed (run the whole file)")
    total = sum(TALLIES.values(), Counter[str]())
    assert total["preempted"] >= 12 and total["resumed_saves"] >= 5 and total["resumed_loads"] >= 2, total
    assert total["async_loads"] >= 40 and total["sync_loads"] >= 15 and total["aborted_loading"] >= 8, total
    assert total["lost_units"] >= 10 and total["damaged_units"] >= 6 and total["failed_blocks"] >= 30, total
    assert total["fault_mended_checked"] >= 20 and total["preempted_stored_checked"] >= 8, total
    assert total["owned_checks"] >= 2000 and total["two_engines"] >= 5 and 5 <= total["overlapped"] <= 30, total
    assert all(total[f"mode_{mode}"] for mode in ("block", "layer", "async")), total


# -- the defect found, fixed (a scenario that misses its point raises RuntimeError, failing the test) -------------
def _stale_block_reloaded(root: Path, overlapped: bool) -> tuple[StandInEngine, list[int], list[Any]]:
    """R1's async load fails at its block 3 (a unit damaged before its lookup) and R1 is aborted while it runs:
    vLLM frees R1's blocks once the load is reported, and the scheduler keeps the failed block id stale. R2, of the
    same prompt, is given that block id (a 6-block cache) and async-loads its stored block 0 into it. Returns the
    engine (closed), R2's prompt and the steps after R2's arrival."""
    store, prompt = root / "store", [random.Random(3).randrange(VOCAB) for _ in range(4 * BS + 1)]
    writer = StandInEngine(root, store, extra=SETTINGS)
    writer.add("w", prompt, 1)
    writer.run()
    writer.close()
    engine = StandInEngine(root, store, overlapped=overlapped, num_blocks=6, extra={**SETTINGS, "load_mode": "async"})
    try:
        r1 = Request("r1", prompt[:4 * BS] + [1] * 10, SamplingParams(max_tokens=3), None, block_hasher=engine.hasher)
        if not damage_unit(engine, engine.ours.keys_for(r1, 4)[3]):
            raise RuntimeError("block 3 is not stored")
        engine.sched.add_request(r1)
        engine.step()
        if r1.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            raise RuntimeError(f"r1 is {r1.status}, not loading")
        engine.sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
        while "r1" in engine.sched.requests:
            engine.step()
        failed, first = set(engine.runner.invalid_seen), len(engine.scheduled)
        r2 = prompt[:4 * BS] + [2] * 10
        engine.add("r2", r2, 5)
        engine.run()
    finally:
        engine.close()
    steps = [so.kv_connector_metadata for so in engine.scheduled[first:]]
    if len(failed) != 1 or not failed & {b for meta in steps for t in meta.async_loads for b in t.block_ids}:
        raise RuntimeError(f"r2's async load misses the failed block {failed}: {steps}")
    return engine, r2, steps


def test_under_async_scheduling_an_async_load_into_a_block_a_failed_async_load_left_keeps_outputs_right(
        tmp_path: Path) -> None:
    engine, r2, _ = _stale_block_reloaded(tmp_path, overlapped=True)
    assert engine.outputs["r2"] == greedy(r2, 5)  # was the output shifted by one token


def test_a_block_an_async_load_filled_is_not_judged_stale(tmp_path: Path) -> None:
    engine, r2, steps = _stale_block_reloaded(tmp_path, overlapped=False)
    assert engine.outputs["r2"] == greedy(r2, 5)  # vLLM's sync Scheduler rewinds safely
    assert [meta.stale_reads for meta in steps if meta.stale_reads] == []  # was [(4,)]: 138 tokens recomputed
