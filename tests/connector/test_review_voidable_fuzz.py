"""Saves marked voidable (``BlockTransfer.voidable``: SaveSettlement.voidable) against the saves the scheduler voids.

Seeded runs of ucm-db's scheduler half and 1 or 2 worker ranks (real halves and LMDB store, CPU KV caches); the
harness plays vLLM (requests admitted, chunked, preempted, resumed; hits loaded by ucm-db or another connector of a
MultiConnector, sync or async; steps planned before the last output is back or not; failed blocks recomputed) and the
model (a block's KV is right only over right blocks on every rank). All roles; block ids never reused. Per save:
    * voided (in a later ``void_saves``) => voidable, hold_id < 0, computed wrong; its void took what it alone stored;
    * computed wrong and stored by a rank (a held one: committed) => voidable and voided;
    * voidable => computed over an unsettled sync load of another rank (TP>1) or connector (async sibling: repro);
    * kv_both voids nothing, kv_consumer saves nothing; at the end every stored unit holds its key's KV.
Defects found: strict-xfail repros at the end.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from test_scheduler_worker import BS, _new_step, _shape  # noqa: E402
from test_hybrid import blocks_of, idle_step  # noqa: E402
from test_ssm_state import TOKENS, _groups, _mamba, model_dir  # noqa: E402,F401
from test_ssm_state import _step as _ssm_step, _vllm_config as _ssm_config  # noqa: E402
from ucm_db.connector import composition  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.roles import RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.connector.worker.voids import save_id  # noqa: E402
from ucm_db.keys.units import unit_key  # noqa: E402

NB = 256  # KV cache blocks of each rank
STALE, WRONG, TAIL = 0.0, -1.0, 101.0  # a fresh block's memory; KV computed over a wrong slot; a partial block's KV
SEEDS = range(1, 21)


def right(key: bytes) -> float:
    """The KV every slot of the block keyed ``key`` holds when computed right (bf16 holds it exactly)."""
    return float(key[0] % 100 + 1)


@dataclass
class Req:
    """One request as the harness's vLLM holds it."""

    req: Request
    source: str  # who loads its hit: "own" (ucm-db), "sibling" (another connector, sync), "async" (another, async)
    table: list[int] = field(default_factory=list)
    phase: str = "new"  # new, waiting (an async load), running, preempted, done
    first: bool = True  # its next step is its first since a lookup (new, or resumed)
    resumed: bool = False
    ready: int = 0  # the step an async sibling load lets it be scheduled
    last_step: int = -1
    keys: list[bytes] = field(default_factory=list)  # of its whole blocks


@dataclass
class Save:
    """A save planned, and what the model knows of it."""

    t: BlockTransfer
    step: int
    possible: bool  # a void can come: computed over an unsettled sync load of another rank or connector
    over_async: bool  # computed over an async sibling load only
    wrong: bool = False
    alone: list[list[bytes]] = field(default_factory=list)  # per rank: units this save alone stored


class Harness:
    """vLLM's scheduler and model around ucm-db's scheduler half and ``tp`` worker ranks."""

    def __init__(self, path: Path, tp: int, role: str, rng: random.Random, overlap: bool = False, fault: float = 0.0,
                 sources: tuple[str, ...] = ("own",)) -> None:
        settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", "save_process": False})
        self.sched, self.tp, self.role, self.rng, self.overlap, self.fault = \
            UcmDbScheduler(settings, _shape(tp), RolePolicy(role)), tp, role, rng, overlap, fault
        self.kv = [{f"layers.{i}.attn": torch.zeros(NB, 2 // tp, BS, 128, dtype=torch.bfloat16) for i in range(2)}
                   for _ in range(tp)]
        self.workers = [UcmDbWorker(settings, _shape(tp), NB, RolePolicy(role)) for _ in range(tp)]
        for rank, (worker, kv) in enumerate(zip(self.workers, self.kv)):
            worker.register_kv_caches(kv, rank, 0)
        self.rank_spans = [self.sched._spans] if tp == 1 else [[span] for span in self.sched._spans]
        self.sources, self.reqs, self.saves, self.next_block = sources, dict[str, Req](), list[Save](), 1
        self.pending = dict[int, tuple[set[int], set[int]]]()  # step -> (sync, async) loads of others not settled
        self.in_flight: tuple[int, set[int]] | None = None
        self.finished, self.preempt, self.reported = set[str](), set[str](), set[int]()  # reported: failed loads
        self.voided, self.commits, self.seen = set[int](), set[int](), Counter[str]()

    def units(self, rank: int, keys: Any) -> list[bytes]:
        return [unit_key(k, span, self.sched._grid) for span in self.rank_spans[rank] for k in keys]

    def present(self, units: list[bytes]) -> list[bool]:
        return [p is not None for p in self.sched.store.get(self.sched.namespace, units)] if units else []

    def value(self, block: int) -> float:
        """What every rank and layer holds in ``block`` (NaN where they differ)."""
        values = {float(v) for kv in self.kv for t in kv.values() for v in t[block].unique().tolist()}
        return values.pop() if len(values) == 1 else float("nan")

    def write(self, blocks: int | list[int], value: float) -> None:
        for t in (t for kv in self.kv for t in kv.values()):
            t[blocks] = value

    def add(self, req_id: str, prompt: list[int], source: str | None = None) -> None:
        source = source or self.rng.choice(self.sources)
        load = {"ucm_db": {"load": False}} if source == "own" and self.overlap else {}  # ucm-db claims async then
        req = Request(req_id, prompt, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": load}), None)
        self.reqs[req_id] = Req(req, source if len(prompt) - 1 >= 2 * BS else "own")

    def _admit(self, r: Req, step: int) -> None:
        """vLLM's lookup and allocation: every child is asked; ucm-db loads, or another connector does."""
        n, req = r.req.num_tokens, r.req
        r.table, r.keys = list(range(self.next_block, self.next_block + -(-n // BS))), self.sched.keys_for(req, n // BS)
        self.next_block += len(r.table)
        self.write(r.table, STALE)
        ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
        if r.source != "own":
            composition.note_ucm_db_load(req.request_id)  # the loading child is another ucm-db
        self.sched.update_state_after_alloc(req, blocks_of((r.table,)), ext if r.source == "own" else 0)
        r.phase, req.num_computed_tokens = "running", ext
        if r.source == "own":
            return
        k = self.rng.randint(1, (n - 1) // BS - 1)  # blocks the other connector loads (in the step, or before it)
        failed = next((i for i in range(k) if self.rng.random() < self.fault / k), None)
        for i in range(k):
            self.write(r.table[i], STALE if i == failed else right(r.keys[i]))
        self.reported |= {r.table[failed]} if failed is not None else set()  # in this step's output
        self.seen[f"{r.source}_failed"] += failed is not None
        req.num_computed_tokens = k * BS
        if r.source == "async":  # vLLM holds it until the load ends, and recomputes from a failed block
            r.phase, r.ready = "waiting", step + self.rng.randint(1, 2)
            req.num_computed_tokens = (k if failed is None else failed) * BS

    def _schedule(self, step: int) -> tuple[SchedulerOutput, list[Req], set[int], set[int]]:
        new, cached, sync, async_loads, tokens = [], CachedRequestData.make_empty(), set[int](), set[int](), {}
        room = 3 - sum(r.phase == "running" for r in self.reqs.values())  # running at most 3
        for r in [r for r in self.reqs.values() if r.phase in ("new", "preempted")][:max(0, room)]:
            self._admit(r, step)
        for r in [r for r in self.reqs.values() if r.phase == "waiting" and r.ready <= step]:
            r.phase = "running"
        todo = [r for r in self.reqs.values() if r.phase == "running" and r.req.num_computed_tokens < r.req.num_tokens]
        for r in todo:
            rid, first, r.first, r.last_step = r.req.request_id, r.first, False, step
            tokens[rid] = min(r.req.num_tokens - r.req.num_computed_tokens, self.rng.choice([BS // 2, BS, 2 * BS, 99]))
            if first and r.source != "own":
                (async_loads if r.source == "async" else sync).update(r.table[:r.req.num_computed_tokens // BS])
            if first and not r.resumed:
                new.append(NewRequestData.from_request(r.req, (r.table,)))
                continue
            cached.req_ids.append(rid)
            cached.new_block_ids.append((r.table,) if first else None)  # a resumed one's whole table
            cached.num_computed_tokens.append(r.req.num_computed_tokens)
            cached.resumed_req_ids |= {rid} if first else set()
        so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=tokens,
                             total_num_scheduled_tokens=sum(tokens.values()), scheduled_spec_decode_tokens={},
                             scheduled_encoder_inputs={}, finished_req_ids=self.finished, free_encoder_mm_hashes=[],
                             preempted_req_ids=self.preempt)
        so.kv_connector_block_state = KVConnectorBlockState(set(tokens), lambda rid: (self.reqs[rid].table,), {})
        self.finished, self.preempt = set(), set()
        return so, [self.reqs[rid] for rid in tokens], sync, async_loads

    def step(self, step_no: int) -> None:
        so, scheduled, sync, async_loads = self._schedule(step_no)
        meta = self.sched.build_connector_meta(so)
        sync |= {b for t in meta.loads for b in t.block_ids} if self.tp > 1 else set()
        self.pending[step_no] = sync, async_loads
        sync_open, async_open = (set().union(*(p[i] for p in self.pending.values())) for i in (0, 1))
        self.saves += [Save(t, step_no, bool(a & sync_open), bool(a & async_open) and not a & sync_open)
                       for t, a in ((t, set(t.after_loads)) for t in meta.saves)]
        for t in meta.loads:  # another engine evicts one rank's unit (with its descendants) before the load
            if self.rng.random() < self.fault:
                rank, i = self.rng.randrange(self.tp), self.rng.randrange(len(t.keys))
                self.seen["own_failed"] += self.sched.store.delete(self.sched.namespace, self.units(rank, [t.keys[i]]))
        invalid, self.reported = self.reported, set()
        for worker in self.workers:
            worker.handle_preemptions(meta)
            worker.start_load(meta)
            worker.drain()  # the step's verdicts and voids ran
        self._check_voids(meta)
        for r in scheduled:
            self._compute(r, so.num_scheduled_tokens[r.req.request_id])
        self._save(meta)
        invalid |= set().union(*(w.take_load_errors() for w in self.workers))
        out, self.in_flight = ([self.in_flight], (step_no, invalid)) if self.overlap else ([(step_no, invalid)], None)
        for output in (o for o in out if o is not None):  # one step ahead of its output, or not
            self._output(*output)
        running = [r for r in self.reqs.values() if r.phase == "running" and not r.first]
        if running and self.rng.random() < 0.15:  # vLLM preempts one: it is looked up again when resumed
            r = self.rng.choice(running)
            r.phase, r.first, r.resumed, r.req.num_computed_tokens = "preempted", True, True, 0
            r.source = self.rng.choice([s for s in self.sources if s != "async"] or ["own"])
            self.preempt.add(r.req.request_id)
            self.seen["preempted"] += 1

    def _compute(self, r: Req, n: int) -> None:
        """The stand-in forward pass: right KV only over right KV (every rank's)."""
        c, keys = r.req.num_computed_tokens, r.keys
        for i in range(c // BS, -(-(c + n) // BS)):
            truth = right(keys[i]) if i < len(keys) else TAIL
            ok = all(self.value(r.table[j]) == right(keys[j]) for j in range(i))
            ok = ok and (c <= i * BS or self.value(r.table[i]) == truth)  # a block begun earlier: right so far
            self.write(r.table[i], truth if ok else WRONG)
        r.req.num_computed_tokens = c + n  # vLLM advances it once the step is planned

    def _save(self, meta: Any) -> None:
        """The step's saves: which were computed wrong, and the units each stored that no other save names."""
        mine = [(s, [self.units(rank, s.t.keys) for rank in range(self.tp)]) for s in self.saves if s.step == meta.step]
        named = Counter(u for _, us in mine for u in sum(us, []))
        before = [[self.present(u) for u in us] for _, us in mine]
        for worker in self.workers:
            worker.save(meta)
            worker.drain()
        for (s, us), was in zip(mine, before):
            s.wrong = any(self.value(b) != right(k) for b, k in zip(s.t.block_ids, s.t.keys))
            s.alone = [[u for u, p, q in zip(units, w, self.present(units)) if q and not p and named[u] == 1]
                       for units, w in zip(us, was)]

    def _check_voids(self, meta: Any) -> None:
        self.commits.update(meta.held_commits)
        self.seen["held_dropped"] += len(meta.held_drops)
        for v in meta.void_saves:
            (s,) = [s for s in self.saves if save_id(s.t) == save_id(v) and s.step < meta.step and s.t.hold_id < 0][-1:]
            assert s.t.voidable, f"voided, never marked voidable: {s}"
            assert s.wrong, f"a right save voided: {s}"
            assert not any(p for units in s.alone for p in self.present(units)), f"its void left units it stored: {s}"
            self.voided.add(id(s))
            self.seen[f"voids_tp{self.tp}"] += 1

    def _output(self, step_no: int, invalid: set[int]) -> None:
        """vLLM's handling of a step's output: failed blocks recomputed (recompute policy), the connector told."""
        for r in (r for r in self.reqs.values() if r.phase == "running"):
            bad = [i * BS for i, b in enumerate(r.table[:-(-r.req.num_computed_tokens // BS)]) if b in invalid]
            r.req.num_computed_tokens = min([r.req.num_computed_tokens, *bad])
        self.sched.observe_output(UcmDbWorkerMetadata(step_no), invalid)
        del self.pending[step_no]
        for r in self.reqs.values():
            if r.phase == "running" and r.last_step <= step_no and r.req.num_computed_tokens >= r.req.num_tokens:
                r.phase = "done"
                self.sched.request_finished(r.req, r.table)
                self.finished.add(r.req.request_id)

    def run(self, requests: list[tuple[str, list[int]]], source: str | None = None, max_steps: int = 80) -> None:
        for req_id, prompt in requests:
            self.add(req_id, prompt, source)
        idle = 0
        for step_no in range(max_steps):
            idle = idle + 1 if all(r.phase == "done" for r in self.reqs.values()) else 0
            if idle > 3:  # the last outputs are back, their verdicts and voids ran
                return
            self.step(step_no)
        raise AssertionError("requests left unfinished")

    def wrong_units(self, chains: list[list[int]]) -> list[str]:
        """The units of every whole block of ``chains`` stored holding other KV than their key's (counts the others)."""
        wrong = []
        for n, tokens in enumerate(chains):
            keys = self.sched.keys_for(Request(f"chk{n}", tokens, SamplingParams(), None), len(tokens) // BS)
            units = [(u, k) for rank in range(self.tp) for u, k in zip(self.units(rank, keys), keys * 2)]
            for (u, k), payload in zip(units, self.sched.store.get(self.sched.namespace, [u for u, _ in units])):
                got = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).unique().tolist() if payload else []
                self.seen["units_checked"] += len(got) > 0
                wrong += [f"chain {n} unit {u.hex()[:10]}: {got}"] if got and got != [right(k)] else []
        return wrong

    def close(self) -> None:
        for part in [*self.workers, self.sched]:
            part.shutdown()


def run_seed(root: Path, seed: int) -> tuple[dict[str, Any], Counter[str]]:
    """Seed ``seed``'s run (its knobs, warm-up and requests drawn) checked; (its knobs, what it reached)."""
    rng = random.Random(7700 + seed)
    roots = [[rng.randrange(1000) for _ in range(9 * BS)] for _ in range(2)]
    warm = [root[:rng.randint(3, 6) * BS + 1] for root in roots]
    requests = [(f"B{i}", rng.choice(roots)[:rng.randint(2, 9) * BS + rng.choice([0, 5, 17])]
                 + [rng.randrange(1000) for _ in range(rng.choice([1, 9, 40]))]) for i in range(rng.randint(5, 8))]
    overlap = rng.random() < 0.4
    knobs: dict[str, Any] = {"tp": 1 + seed % 2, "overlap": overlap, "fault": rng.choice([0.3, 0.6]),
                             "role": ["kv_producer", "kv_both", "kv_producer", "kv_consumer"][seed // 2 % 4],
                             "sources": ("sibling", "async") + (() if overlap else ("own", "own"))}
    warmup = Harness(root, knobs["tp"], "kv_both", random.Random(seed))
    warmup.run([(f"W{i}", prompt) for i, prompt in enumerate(warm)], "own")
    warmup.close()
    h = Harness(root, rng=random.Random(seed), **knobs)
    try:
        h.run(requests)
        for s in h.saves:
            stored = any(s.alone) or (s.t.hold_id >= 0 and s.t.hold_id in h.commits)
            assert not (s.wrong and stored) or (s.t.voidable and id(s) in h.voided), f"wrong KV left stored: {s}"
            assert not s.t.voidable or s.possible or s.over_async, f"voidable, no void can come: {s}: {knobs}"
            h.seen.update(voidable=s.t.voidable, async_wasted=s.t.voidable and s.over_async, held=s.t.hold_id >= 0)
        assert (h.role != "kv_both" or not h.voided) and (h.role != "kv_consumer" or not h.saves), knobs
        wrong = h.wrong_units(warm + [p for _, p in requests])
        assert not wrong, f"units stored wrong: {wrong[:4]}: {knobs}"
        return knobs, h.seen
    finally:
        h.close()


_SEEN: dict[int, tuple[dict[str, Any], Counter[str]]] = {}


@pytest.mark.parametrize("seed", SEEDS)
def test_voided_saves_are_exactly_the_voidable_ones_computed_wrong(tmp_path: Path, seed: int) -> None:
    _SEEN[seed] = run_seed(tmp_path, seed)


def test_the_seeds_reach_every_path(tmp_path: Path) -> None:
    for seed in (s for s in SEEDS if s not in _SEEN):
        test_voided_saves_are_exactly_the_voidable_ones_computed_wrong(tmp_path / str(seed), seed)
    total = sum((seen for _, seen in _SEEN.values()), Counter[str]())
    assert all(total[k] for k in ("voids_tp1", "voids_tp2", "voidable", "held", "held_dropped", "own_failed",
                                  "sibling_failed", "async_failed", "preempted", "units_checked")), total
    assert {(k["tp"], k["role"]) for k, _ in _SEEN.values()} >= {(t, r) for t in (1, 2) for r in ("kv_producer",
                                                                                                  "kv_both")}
    assert any(k["overlap"] and seen["voids_tp1"] + seen["voids_tp2"] for k, seen in _SEEN.values()), "no overlap void"


# -- defects found (strict xfail; a scenario that misses its point raises RuntimeError, failing the test) ----------
def _sibling_step(sched: UcmDbScheduler, req: Request, table: list[int], loaded: int) -> Any:
    """The metadata of a step computing new ``req`` in ``table``, whose first ``loaded`` blocks another ucm-db loads."""
    sched.get_num_new_matched_tokens(req, 0)
    composition.note_ucm_db_load(req.request_id)
    sched.update_state_after_alloc(req, blocks_of((table,)), 0)
    req.num_computed_tokens = loaded * BS
    return sched.build_connector_meta(_new_step(req, table, req.num_tokens - loaded * BS))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a save over another connector's finished async load "
                   "is voidable (kv_producer) or held (kv_both), though no void can come: it failed, if at all, "
                   "before vLLM scheduled the request")
@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_save_over_an_async_sibling_load_waits_for_no_void(tmp_path: Path, role: str) -> None:
    h = Harness(tmp_path, 1, role, random.Random(5), sources=("async",))
    h.run([("A", list(range(7, 7 + 5 * BS + 3)))])
    h.close()
    over = [s for s in h.saves if s.over_async]
    if not over or h.voided or any(s.possible for s in h.saves):
        raise RuntimeError(f"the scenario saved over no async sibling load alone: {h.saves}")
    assert [(s.t.voidable, s.t.hold_id) for s in over] == [(False, -1)] * len(over)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="SaveSettlement keeps a failed block id bad while a "
                   "later step is pending: a right save over another request's later load into that id is voided")
@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_block_id_loaded_again_after_a_failed_sibling_load_voids_no_right_save(tmp_path: Path, role: str) -> None:
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path)}), _shape(), RolePolicy(role))
    r1, r2, r3 = (Request(f"r{i}", list(range(100 * i, 100 * i + n * BS + 1)), SamplingParams(max_tokens=1), None)
                  for i, n in ((1, 3), (2, 2), (3, 2)))
    m0 = _sibling_step(sched, r1, [10, 11, 12, 13], 2)  # block 11 fails to load
    m1 = _sibling_step(sched, r2, [20, 21, 22], 1)  # planned before step 0's output (async scheduling)
    r1.num_computed_tokens = BS  # vLLM recomputes from block 11 ...
    sched.observe_output(UcmDbWorkerMetadata(m0.step), {11})
    sched.request_finished(r1, [10, 11, 12, 13])  # ... but the client aborted r1: block 11 is free
    m2 = _sibling_step(sched, r3, [11, 30, 31], 1)  # planned after step 0's output: r3's load into 11 holds
    for meta in (m1, m2):
        sched.observe_output(UcmDbWorkerMetadata(meta.step), set())
    verdicts = sched.build_connector_meta(idle_step())
    sched.shutdown()
    if [t.after_loads for t in m2.saves] != [(11,)] or not (m0.saves[0].voidable or m0.saves[0].hold_id >= 0):
        raise RuntimeError(f"not the scenario: {m0.saves} {m2.saves}")
    (save,) = m2.saves
    assert save_id(save) not in {save_id(t) for t in verdicts.void_saves} and save.hold_id not in verdicts.held_drops


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_an_ssm_state_save_over_a_sibling_load_is_provisional_as_its_attention_group(model_dir: Path, tmp_path: Path,
                                                                                     role: str) -> None:
    """A state save is planned outside the settlement: never held, but voidable (its units tagged provisional,
    swept once vLLM stopped the engine over a failed load) wherever its attention group's save is held or voidable
    (connector/hybrid/hooks.py)."""
    config = _ssm_config(model_dir, tmp_path / "store", role=role, store_foreign_loads=True)
    connector = UcmDbConnector(config, KVConnectorRole.SCHEDULER, _groups(_mamba()))
    req = Request("R", TOKENS, SamplingParams(max_tokens=1), None)
    ids = ([0, 0, 23, 24, 25, 26, 27], list(range(31, 38)))  # align mode: state blocks before the hit's end are null
    connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, blocks_of(ids), 0)
    req.num_computed_tokens = 3 * BS  # another connector (store_foreign_loads) loaded 3 blocks synchronously
    meta = connector.build_connector_meta(_ssm_step(req, ids, len(TOKENS) - 3 * BS, [(0, 26, 6 * BS)]))
    connector.shutdown()
    (state,), (attention,) = (group.saves for group in meta.groups)
    if not attention.after_loads or not (attention.voidable or attention.hold_id >= 0):
        raise RuntimeError(f"not the scenario: {attention}")
    assert state.voidable and state.hold_id < 0
