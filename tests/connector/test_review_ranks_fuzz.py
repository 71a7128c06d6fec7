"""Seeded scenarios of an engine with TP=2 or TP=4 worker ranks in one process whose loads fail on ONE rank only.

A warm-up engine (TP 1, 2 or 4) stores two roots' prefixes; the engine under review (kv_both or kv_producer, load mode,
Scheduler or AsyncScheduler, prefix cache, a small KV cache: drawn) runs 6-8 requests sharing them, with real faults in
the failing rank's units of planned loads (bytes flipped on disk through the store's LMDB engine, or the unit deleted);
engines at the other TP sizes then run every chain again. Each rank is a real worker UcmDbConnector over its KV heads
(``engine_facts.ranks`` patched), outputs merged by vLLM's KVOutputAggregator; the stand-in model reads a slot as the
value all ranks agree on (an all-reduce). Writers are drained after a step's voids and saves, so a seed replays alike.
Invariants: outputs are the greedy truth; every stored unit holds the truth for its key; a save over a failed load is
held and dropped (kv_both) or voided a step later (kv_producer), keeping the other ranks' units stored before it;
load_errors only on the failing rank, as it reported; saves_voided per writing rank as docs/connector.md says; vLLM's
sums of both. The two defects the suite found (lost saves: connector/worker/voids.py, loads.py) are repros at the end.
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from stand_in_engine import BS, LAYER, LAYERS, VOCAB, F, StandInEngine, StandInRunner, g, greedy, truth  # noqa: E402
from stand_in_engine import vllm_config  # noqa: E402
from test_async_loads import _idle_step  # noqa: E402
from test_failed_load_saves import IDS, PROMPT, _admitted, settings  # noqa: E402,F401
from test_review_tp_pp_spans import HEAD, _model  # noqa: E402
from test_scheduler_worker import _admit, _new_step, _request  # noqa: E402
from ucm_db.connector import engine_facts  # noqa: E402
from ucm_db.connector.connector import UcmDbConnector  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata, UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.worker.voids import SaveId, save_id  # noqa: E402
from ucm_db.keys.units import head_range, unit_key  # noqa: E402

KV_HEADS = 4  # at TP=4 one head a rank: a fault is in one rank's unit only
SEEDS = range(1, 21)
Arrival = tuple[str, list[int], int]  # request id, prompt, max tokens


class RankedRunner(StandInRunner):
    """The stand-in model over ``tp`` ranks, each a real worker half over its KV heads; ``kv`` holds every rank's."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig, engine: RankedEngine) -> None:
        tp, blocks, self.ranks, self.kv = config.parallel_config.tensor_parallel_size, kv_config.num_blocks, [], {}
        for rank in range(tp):
            caches = {LAYER.format(i): torch.zeros(blocks, KV_HEADS // tp, BS, 2 * HEAD) for i in range(LAYERS)}
            with mock.patch.object(engine_facts, "ranks", return_value=(rank, 0)):  # no torch.distributed here
                self.ranks.append(UcmDbConnector(config, KVConnectorRole.WORKER, kv_config))
                self.ranks[-1].register_kv_caches(caches)
            self.kv.update({f"rank{rank}/{name}": t for name, t in caches.items()})
        self.connector, self.reqs, self.step, self.before_load, self.invalid_seen = self.ranks[0], {}, 0, None, set()
        self.aggregator, self.engine = KVOutputAggregator(tp), engine

    def _value(self, req: Any, q: int) -> int:
        """The value all ranks' heads and layers hold at position ``q`` (an all-reduce), -1 if they disagree."""
        slot = torch.stack([t[req.block_ids[q // BS], :, q % BS, :] for t in self.kv.values()])
        return int(slot.min()) if int(slot.min()) == int(slot.max()) else -1

    def execute(self, so: Any) -> ModelRunnerOutput:
        """One step: each rank as vLLM's KV connector mixin runs it, outputs merged as vLLM's executor merges them."""
        self.step += 1
        self._update_states(so)
        meta, sampled = so.kv_connector_metadata, {}
        injected = self.engine.before(meta)
        for connector in self.ranks:
            connector.handle_preemptions(meta)
            connector.bind_connector_metadata(meta)
            connector.start_load_kv(None)  # type: ignore[arg-type]
            for name in (LAYER.format(i) for i in range(LAYERS)):
                connector.wait_for_layer_load(name)
            connector._worker.drain()  # type: ignore[union-attr]  # the step's voids ran
        self.engine.saves(meta)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            for q in range(req.computed, req.computed + n):
                self._write(req, q, F(self._value(req, q - 1) if q else 0, req.tokens[q], q))
            req.computed += n
            sampled[req_id] = [g(self._value(req, req.computed - 1))] if req.computed >= len(req.tokens) else []
            req.tokens.extend(sampled[req_id])
        req_ids, outputs = list(so.num_scheduled_tokens), []
        for connector in self.ranks:
            connector.wait_for_save()
            results = connector.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, invalid_block_ids=connector.get_block_ids_with_load_errors(),
                kv_connector_stats=connector.get_kv_connector_stats(),
                kv_connector_worker_meta=connector.build_connector_worker_meta())
            connector.clear_connector_metadata()
            connector._worker.drain()  # type: ignore[union-attr]
            outputs.append(ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                                             [sampled[r] for r in req_ids], kv_connector_output=kv_out))
        self.engine.after(meta, [o.kv_connector_output.invalid_block_ids for o in outputs], injected)  # type: ignore
        merged = self.aggregator.aggregate(outputs)  # type: ignore[arg-type]
        self.engine.stats.update(getattr(merged.kv_connector_output.kv_connector_stats, "data", {}))  # type: ignore
        return merged  # type: ignore[return-value]


class RankedEngine(StandInEngine):
    """vLLM's scheduler, ucm-db's scheduler half, a RankedRunner; faults in one rank's loads, the checks' ledger."""

    def __init__(self, root: Path, store: Path, tp: int, role: str = "kv_both", load_mode: str = "block",
                 overlapped: bool = False, num_blocks: int = 160, prefix_caching: bool = True, max_seqs: int = 64,
                 failing: int = 0, fault_rate: float = 0.0, seed: int = 0) -> None:
        init_none_hash(sha256)
        config = self.config = vllm_config(root, store, {"load_mode": load_mode}, role, overlapped)
        config.model_config = ModelConfig(model=str(_model(root, LAYERS, KV_HEADS)), skip_tokenizer_init=True,
                                          dtype="float32", max_model_len=4096)
        config.parallel_config.tensor_parallel_size = config.parallel_config.world_size = tp
        config.cache_config.num_gpu_blocks, config.cache_config.enable_prefix_caching = num_blocks, prefix_caching
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.float32)
        rank_kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[  # a rank's heads
            KVCacheGroupSpec([LAYER.format(i) for i in range(LAYERS)], spec)])
        self.sched = (AsyncScheduler if overlapped else Scheduler)(config, rank_kv, StructuredOutputManager(config), BS)
        self.sched.max_num_running_reqs = self.sched.max_num_active_reqs = max_seqs  # the others wait
        self.overlapped, self.tp, self.hasher = overlapped, tp, get_request_block_hasher(BS, sha256)
        self.outputs, self.kv_params, self.post_execute, self.scheduled, self._in_flight = {}, {}, [], [], None
        self.failing, self.fault_rate, self.rng = failing, fault_rate, random.Random(seed)
        self.seen, self.stats = Counter[str](), Counter[str]()  # what the run reached; vLLM's aggregated stats
        self.reported, self.expected_voided = [0] * tp, [0] * tp  # per rank (stale reads left out)
        self.invalid_by_step, self.held = dict[int, set[int]](), dict[int, tuple[BlockTransfer, int]]()  # held: its step
        self.dropped, self.committed, self.voided = set[int](), set[int](), list[SaveId]()
        # a producer's save over loads -> (blocks, per rank: its writer stores some; others' units there before it,...)
        self.voidable: dict[SaveId, tuple[int, list[bool], list[bytes], tuple[int, ...], int]] = {}
        self.runner: RankedRunner = RankedRunner(config, rank_kv, self)

    def rank_units(self, rank: int, keys: tuple[bytes, ...]) -> list[bytes]:
        first, last = head_range(KV_HEADS, self.tp, rank)
        return [unit_key(k, self.ours._spans[h], self.ours._grid) for h in range(first, last) for k in keys]

    def present(self, keys: list[bytes]) -> list[bool]:
        return self.ours.store._tier.engine.read(lambda txn: [txn.get("blocks", k) is not None for k in keys])

    def damage(self, key: bytes) -> bool:
        """Flips a bit of a stored unit on disk: its checksum fails when it is read."""
        def flip(txn: Any) -> bool:
            blob = txn.get("blocks", key)
            return blob is not None and (txn.put("blocks", key, bytes(blob[:-1]) + bytes([blob[-1] ^ 0x40])) or True)
        return bool(self.ours.store._tier.engine.write(flip))

    def close(self) -> None:
        for connector in self.runner.ranks:
            connector._worker.drain()  # type: ignore[union-attr]
            self.stats.update(getattr(connector.get_kv_connector_stats(), "data", {}))  # vLLM's next step's
            connector.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]
        self.runner.kv.clear()  # the ledger stays (_EXERCISED), the KV caches go

    def before(self, meta: UcmDbConnectorMetadata) -> set[int]:
        """Faults this step's loads; notes its verdicts and voids. Returns the block ids faulted."""
        injected, faulted, ours = set(), set(), self.ours
        for transfer in (t for t in [*meta.loads, *meta.async_loads] if self.rng.random() < self.fault_rate):
            i = self.rng.randrange(len(transfer.keys))
            key = self.rng.choice(self.rank_units(self.failing, (transfer.keys[i],)))
            kind = self.rng.choice(["damage", "lose"])
            if key not in faulted and (self.damage(key) if kind == "damage" else
                                       ours.store.delete(ours.namespace, [key]) > 0):  # its descendants too
                faulted.add(key)
                self.seen.update({kind: 1, "async": transfer in meta.async_loads})
                injected.add(transfer.block_ids[i])
        self.seen["faulted"] += len(injected)
        self._protect: list[bytes] = []  # units the step's voids must leave stored
        for void in meta.void_saves:
            blocks, stores, before, _, _ = self.voidable[save_id(void)]
            self.voided.append(save_id(void))
            for rank in range(self.tp):
                self.expected_voided[rank] += blocks if rank == self.failing or stores[rank] else 0
                self.seen["void_stored_nothing"] += rank != self.failing and not stores[rank]
            self._protect += before
        self._protect = [k for k, there in zip(self._protect, self.present(self._protect)) if there]
        self.dropped.update(meta.held_drops)
        self.committed.update(meta.held_commits)
        return injected

    def saves(self, meta: UcmDbConnectorMetadata) -> None:
        """Checks the step's voids (they ran; its saves are not committed yet) and notes its saves."""
        gone = [k.hex()[:12] for k, there in zip(self._protect, self.present(self._protect)) if not there]
        assert not gone, f"a void deleted units stored before its save: {gone}"
        self.seen["protected"] += len(self._protect)
        planned: set[bytes] = set()  # units an earlier save of this step stores (on a rank without faults)
        for save in meta.saves:
            units = [self.rank_units(r, save.keys) for r in range(self.tp)]
            if save.hold_id >= 0:
                self.held[save.hold_id] = (save, meta.step)
            elif save.after_loads:  # a producer's: committed now, voided a step later if a load it read failed
                there = [self.present(u) for u in units]
                stores = [any(not p and k not in planned for k, p in zip(u, ps)) for u, ps in zip(units, there)]
                before = [k for r, (u, ps) in enumerate(zip(units, there)) if r != self.failing
                          for k, p in zip(u, ps) if p]
                self.voidable[save_id(save)] = (len(save.keys), stores, before, save.after_loads, meta.step)
            planned.update(k for r, u in enumerate(units) if r != self.failing for k in u)

    def after(self, meta: UcmDbConnectorMetadata, invalid: list[set[int]], injected: set[int]) -> None:
        """What each rank reported failed."""
        stale, loaded = set(meta.stale_reads), {b for t in meta.loads for b in t.block_ids}
        for rank, blocks in enumerate(invalid):
            self.reported[rank] += len(blocks - stale)
            assert rank == self.failing or not blocks - stale, f"rank {rank} failed loads; faults are {self.failing}'s"
        assert injected & loaded <= invalid[self.failing], "a faulted synchronous load was not reported"
        self.invalid_by_step[meta.step] = set().union(*invalid)


def draw(seed: int) -> tuple[dict[str, Any], list[Arrival], list[Arrival]]:
    """Seed ``seed``'s knobs (the engine under review's arguments, the warm-up's TP), warm-up requests, requests."""
    rng, tp = random.Random(9100 + seed), 2 if seed % 2 else 4
    roots = [[rng.randrange(VOCAB) for _ in range(10 * BS)] for _ in range(2)]
    warm = [(f"W{i}", root[:rng.randint(6, 10) * BS + 3], 1) for i, root in enumerate(roots)]
    requests: list[Arrival] = []
    for i in range(rng.randint(6, 8)):
        kind = rng.random()
        if requests and kind < 0.2:  # a prompt again
            prompt = list(rng.choice(requests)[1])
        elif requests and kind < 0.45:  # the next turn: a prompt and its right output
            _, base, n = rng.choice(requests)
            prompt = base + greedy(base, n)
        else:
            prompt = rng.choice(roots)[:rng.randint(2, 10) * BS + rng.choice([0, 1, 17])]
        prompt += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 40, 70]))]
        requests.append((f"B{i}", prompt, rng.choice([1, 2, 5, 33])))
    producer = seed % 4 < 2  # its voids need synchronous loads; async loads (and scheduling) go to kv_both
    knobs = {"seed": seed, "tp": tp, "role": "kv_producer" if producer else "kv_both",
             "load_mode": rng.choice(["block", "layer"] if producer else ["block", "layer", "async"]),
             "overlapped": not producer and rng.random() < 0.3, "num_blocks": rng.choice([256, 48, 40]),
             "prefix_caching": rng.random() < 0.5, "max_seqs": rng.choice([1, 2, 3]), "failing": rng.randrange(tp),
             "warm_tp": rng.choice([t for t in (1, 2, 4) if t != tp]), "fault_rate": rng.choice([0.3, 0.5, 0.7])}
    return knobs, warm, requests


def _run(engine: RankedEngine, requests: list[Arrival], knobs: dict[str, Any], then: Any = None) -> Any:
    """Runs ``requests`` to the end (each output the greedy truth), then ``then(engine)``; closes the engine."""
    try:
        for req_id, prompt, max_tokens in requests:
            engine.add(req_id, prompt, max_tokens)
        engine.run(400)  # requests past the running limit (max_seqs) wait: they look up when admitted
        for req_id, prompt, max_tokens in requests:
            assert engine.outputs.get(req_id) == greedy(prompt, max_tokens), f"TP={engine.tp} {req_id}: {knobs}"
        return then(engine) if then is not None else None
    finally:
        engine.close()


def _wrong_units(engine: RankedEngine, chains: list[list[int]]) -> tuple[int, list[str]]:
    """(units stored, those stored wrong) of every block of ``chains``: each head's unit read raw from the store."""
    ours, checked, wrong = engine.ours, 0, []
    for n, tokens in enumerate(chains):
        keys, values = ours.keys_for(_request(f"check{n}", tokens), len(tokens) // BS), truth(tokens)
        for head, span in enumerate(ours._spans):
            for b, payload in enumerate(ours.store.get(ours.namespace, [unit_key(k, span, ours._grid) for k in keys])):
                if payload is not None:
                    checked += 1
                    got = torch.frombuffer(payload, dtype=torch.float32).view(LAYERS, BS, 2 * HEAD)
                    want = torch.tensor(values[b * BS:(b + 1) * BS], dtype=torch.float32).view(1, BS, 1)
                    wrong += [] if torch.equal(got, want.expand_as(got)) else [f"chain {n} block {b} head {head}"]
    return checked, wrong


def run_and_check(root: Path, seed: int) -> tuple[dict[str, Any], RankedEngine]:
    knobs, warm, requests = draw(seed)
    store, engine_knobs = Path(tempfile.mkdtemp(prefix=f"store-{seed}-", dir=root)), dict(knobs)  # a store a run
    _run(RankedEngine(root, store, engine_knobs.pop("warm_tp")), warm, knobs)
    engine = RankedEngine(root, store, **engine_knobs)
    _run(engine, requests, knobs)
    _check_counters(engine, [c._worker.counters.totals.data for c in engine.runner.ranks], knobs)  # type: ignore
    chains = [prompt + greedy(prompt, n) for _, prompt, n in warm + requests]
    for tp in (t for t in (1, 2, 4) if t != knobs["tp"]):  # the last one checks every unit, after every save
        reader, again = RankedEngine(root, store, tp), [(f"R{i}", c + [i], 2) for i, c in enumerate(chains)]
        engine.seen["units_checked"], wrong = _run(reader, again, knobs, lambda e: _wrong_units(e, chains))
        engine.seen["readback_hits"] += int(reader.ours.counters.totals.data["hit_tokens"])
        assert not wrong, f"units stored wrong: {wrong[:8]}: {knobs}"
    return knobs, engine


def _check_counters(e: RankedEngine, totals: list[dict[str, float]], knobs: dict[str, Any]) -> None:
    """The verdict and counter invariants."""
    failing, tp, role = e.failing, e.tp, knobs["role"]
    assert [t["load_errors"] for t in totals] == e.reported, f"load_errors per rank: {knobs}"
    assert e.seen["faulted"] <= e.reported[failing], f"faulted blocks not all reported: {knobs}"
    bad = {s: b for s, b in e.invalid_by_step.items() if b}
    if role == "kv_both":
        assert not e.voided, f"kv_both voided saves {e.voided}: {knobs}"
        over_failed = {h for h, (t, step) in e.held.items() if bad.get(step, set()).intersection(t.after_loads)}
        assert not over_failed & e.committed, f"held saves over failed loads committed: {knobs}"
        for h in e.dropped - over_failed:  # else only after a dropped save of its request (settlement.py)
            assert any(d < h and e.held[d][0].req_id == e.held[h][0].req_id for d in over_failed), knobs
        expected = [sum(len(e.held[h][0].keys) for h in e.dropped)] * tp
    else:
        assert not e.held, f"a producer held saves: {knobs}"
        over_failed = {s for s, (*_, after, step) in e.voidable.items() if bad.get(step, set()) & set(after)}
        assert over_failed == set(e.voided), f"voided {e.voided}, over failed loads {over_failed}: {knobs}"
        expected = e.expected_voided
    got, voided_blocks = [t["saves_voided"] for t in totals], sum(e.voidable[s][0] for s in e.voided)
    assert got == expected, f"saves_voided per rank {got} (expected {expected}, voided {voided_blocks}): {knobs}"
    assert (e.stats["saves_voided"], e.stats["load_errors"]) == (sum(got), sum(e.reported)), knobs


_EXERCISED: dict[int, tuple[dict[str, Any], RankedEngine]] = {}


@pytest.mark.parametrize("seed", SEEDS)
def test_one_rank_s_failed_loads_leave_no_wrong_output_unit_or_count(tmp_path: Path, seed: int) -> None:
    _EXERCISED[seed] = run_and_check(tmp_path, seed)


def test_the_seeds_exercise_every_path(tmp_path: Path) -> None:
    """Both TP sizes, roles and fault kinds, held drops and commits, each kind of void, read-back hits."""
    for seed in (s for s in SEEDS if s not in _EXERCISED):
        test_one_rank_s_failed_loads_leave_no_wrong_output_unit_or_count(tmp_path, seed)
    runs = list(_EXERCISED.values())
    both, producers = ([e for k, e in runs if k["role"] == role] for role in ("kv_both", "kv_producer"))
    seen = {name: sum(e.seen[name] > 0 for _, e in runs) for name in ("damage", "lose", "async", "readback_hits")}
    assert {k["tp"] for k, _ in runs} == {2, 4} and {k["warm_tp"] for k, _ in runs} == {1, 2, 4}
    assert seen["damage"] >= 4 and seen["lose"] >= 4 and seen["async"] >= 2 and seen["readback_hits"] == len(SEEDS)
    assert sum(bool(e.dropped) for e in both) >= 2 and sum(bool(e.committed) for e in both) >= 2
    assert sum(sum(e.expected_voided) > e.expected_voided[e.failing] for e in producers) >= 3  # other ranks' voids
    assert sum(e.seen["void_stored_nothing"] > 0 for e in producers) >= 1
    assert sum(e.seen["protected"] > 0 for e in producers) >= 2 and all(e.seen["units_checked"] for _, e in runs)


def _step(sched: Any, workers: list[Any], so: Any, invalid: set[int], fault: Any = None) -> Any:
    """A step of test_failed_load_saves' TP=2 engine; ``fault``: the request whose rank 1 fails its 2nd loaded block."""
    meta = sched.build_connector_meta(so)
    load = next((t for t in meta.loads if fault is not None and t.req_id == fault.request_id), None)
    assert load is None or sched.store.delete(sched.namespace, [unit_key(load.keys[1], sched._spans[1], sched._grid)])
    for worker in workers:
        worker.start_load(meta)
        worker.save(meta)
        worker.drain()
    assert [w.take_load_errors() for w in workers] == [set(), invalid]
    if fault is not None:
        fault.num_computed_tokens = BS
    sched.observe_output(UcmDbWorkerMetadata(meta.step), invalid)
    return meta


def _stored_and_voided(sched: Any, workers: list[Any], req: Any, head: int) -> tuple[int, list[float]]:
    """(blocks of ``req`` stored for ``head``, each rank's saves_voided); then shuts the engine down."""
    keys = [unit_key(k, sched._spans[head], sched._grid) for k in sched.keys_for(req, 5)]
    stored, voided = sched.store.lookup(sched.namespace, keys, remote=False), [w.counters.totals.data["saves_voided"]
                                                                              for w in workers]
    for part in [*workers, sched]:
        part.shutdown()
    return stored, voided


def test_a_block_reloaded_after_one_rank_s_failed_load_is_saved_by_every_rank(settings: Any) -> None:
    """b's load into block id 11 fails on rank 1 only (b is aborted); c then loads into it, and its held save over it
    is committed: by every rank (at f827e3a rank 1 dropped it, keeping failures by block id, and counted it voided)."""
    sched, workers, _, b = _admitted(settings, tp=2)  # b: a 2-block hit of PROMPT, loaded into block ids 10-11
    _step(sched, workers, _new_step(b, IDS, len(PROMPT) - 2 * BS), {11}, fault=b)
    sched.request_finished(b, IDS)  # the client aborted it: vLLM frees its blocks
    c = _request("c", PROMPT[:BS] + [5] * (3 * BS + 3))  # shares block 0 with b
    assert _admit(sched, c) == BS
    meta = _step(sched, workers, _new_step(c, [11, 20, 21, 22, 23], 3 * BS + 3), set())  # block id 11 is c's now
    assert [(t.block_ids, t.after_loads) for t in meta.saves] == [((20, 21, 22), (11,))]
    assert _step(sched, workers, _idle_step(), set()).held_commits == [meta.saves[0].hold_id] != [-1]
    assert _stored_and_voided(sched, workers, c, 1) == (4, [3, 3])  # all 4 blocks; only b's save dropped, by both


def test_a_producer_s_void_keeps_what_another_save_of_its_round_stored(settings: Any) -> None:
    """A TP=2 producer's round saves blocks 2-4 of PROMPT for x (over its good load of block 0) and b (over 0-1, failing
    on rank 1): x's put stores them, b's nothing. b's void deletes x's right units and counts 3 blocks on rank 0
    (voids.py: the round's stored keys of its voidable saves, x's among them, are matched against b's chains)."""
    sched, workers, _, b = _admitted(settings, tp=2, role="kv_producer")  # b: blocks 0-1 loaded into ids 10-11
    controls = {"kv_transfer_params": {"ucm_db": {"max_load_tokens": BS}}}
    x = Request("x", PROMPT, SamplingParams(max_tokens=4, extra_args=controls), None)
    tables = {"x": ([30, 31, 32, 33, 34, 35],), "b": (IDS,)}
    assert _admit(sched, x) == BS
    so = _new_step(x, tables["x"][0], len(PROMPT) - BS)
    so.scheduled_new_reqs.append(NewRequestData.from_request(b, (IDS,)))
    so.num_scheduled_tokens["b"] = len(PROMPT) - 2 * BS
    so.kv_connector_block_state = KVConnectorBlockState(set(tables), tables.__getitem__, {})
    meta = _step(sched, workers, so, {11}, fault=b)
    assert [(t.req_id, t.after_loads) for t in meta.saves] == [("x", (30,)), ("b", (10, 11))]
    assert [t.req_id for t in _step(sched, workers, _idle_step(), set()).void_saves] == ["b"]
    assert _stored_and_voided(sched, workers, x, 0) == (5, [0, 3])  # x's blocks stay; rank 0 stored none of b's
