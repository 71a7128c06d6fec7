"""Per-request controls (``kv_transfer_params["ucm_db"]``: ``save``, ``load``, ``max_load_tokens``; vLLM's
``skip_reading_prefix_cache``) through vLLM's real ``Scheduler`` / ``AsyncScheduler``, both connector halves, real
LMDB stores and the stand-in runner (stand_in_engine.py), against this file's model of docs/connector.md's tables
(:func:`served`). A seed: two engines on one store (the second, kv_both / kv_producer / kv_consumer, loads what the
first stored), 4-7 requests each over shared prompts (one twice in a step), each with a body drawn from valid,
malformed (wrong types, negative, huge, non-JSON-able, nested, not an object) and absent ones; settings, KV cache
size (preemptions), token budget and scheduler drawn too. Invariants, at every step: a request served ``load:
false`` (or ``max_load_tokens`` below a block) has no load transfer, no lookup, no lookup nor hit tokens counted;
any other's transfers, claims and counted hits keep within its cap (in total, unless preempted), a claim counting
one lookup; one served ``save: false`` (or a kv_consumer's) has no save transfer, decode and preemptions included;
a request that sent a problem gets one short warning, no other any. At the end: outputs right, no stored block
wrong, and under ``admit_after`` 1 / "auto" every block a saving request computed stored (no control leaks).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, kv_cache_config, vllm_config  # noqa: E402
from test_request_controls import _nested, scheduler_log  # noqa: E402,F401 - a fixture
from test_review_save_fuzz import stored_map  # noqa: E402
from ucm_db.connector.request_controls import PUBLICATION_FIELDS  # noqa: E402

SEEDS = range(6, 24)  # second engines of every role; admit_after 1, 2 and "auto"
ABSENT = object()  # no kv_transfer_params at all
DEEP = _nested(sys.getrecursionlimit() + 50)
TALLIES: dict[int, Counter[str]] = {}  # what each seed exercised
Outputs = dict[str, list[int]]  # one engine's output tokens by request
#: Bodies under kv_transfer_params["ucm_db"]: valid, malformed and hostile (module docstring).
BODIES: list[Any] = [
    ABSENT, ABSENT, ABSENT, None, {}, {"save": False}, {"save": False}, {"save": True}, {"save": "always"},
    {"load": False}, {"load": False}, {"load": True}, {"save": False, "load": False}, {"save": None, "load": None},
    {"max_load_tokens": 0}, {"max_load_tokens": BS - 1}, {"max_load_tokens": BS}, {"max_load_tokens": 2 * BS + 5},
    {"max_load_tokens": 3 * BS}, {"max_load_tokens": 2**64 - 1}, {"save": "always", "max_load_tokens": BS + 1},
    {"save": "false"}, {"save": 0}, {"save": "ALWAYS"}, {"save": b"no"}, {"save": DEEP}, {"load": "no"}, {"load": 1},
    {"load": {1, 2}}, {"max_load_tokens": -3}, {"max_load_tokens": "64"}, {"max_load_tokens": 64.0},
    {"max_load_tokens": True}, {"max_load_tokens": float("inf")}, {"max_load_tokens": float("nan")},
    {"colour": "red"}, {f"field-{i}": i for i in range(40)}, {"blocks": 3, "save": False}, ["save", False],
    "save=false", True, 7, {"save": "x" * 100_000},
]
CAPS = [i for i, body in enumerate(BODIES) if isinstance(body, dict) and type(body.get("max_load_tokens")) is int
        and body["max_load_tokens"] >= BS]  # caps of a block or more: drawn more often where there is a store


@dataclass(frozen=True)
class Served:
    """What the doc's table says a request is served as."""
    save: bool | str = True
    load: bool = True
    cap_blocks: int | None = None  # max_load_tokens in whole blocks
    problems: bool = False  # a warning is due

    @property
    def loads_nothing(self) -> bool:
        return not self.load or self.cap_blocks == 0


#: Each control: its check, its default, and what a malformed value is served as (the doc's tables).
TABLE: dict[str, tuple[Callable[[Any], bool], Any, Any]] = {
    "save": (lambda v: isinstance(v, bool) or (isinstance(v, str) and v == "always"), True, False),
    "load": (lambda v: isinstance(v, bool), True, False),
    "max_load_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, None, 0)}


def served(body: Any, skip_cache: bool) -> Served:
    """docs/connector.md's tables, written apart from request_controls.py (null or absent: the default)."""
    if body is ABSENT or body is None or not isinstance(body, dict):
        return Served(load=not skip_cache) if body is ABSENT or body is None else Served(False, False, None, True)
    got = {name: default if body.get(name) is None else body[name] if valid(body[name]) else safe
           for name, (valid, default, safe) in TABLE.items()}
    problems = any(name not in TABLE and name not in PUBLICATION_FIELDS for name in body) or any(
        body.get(name) is not None and not valid(body[name]) for name, (valid, _, _) in TABLE.items())
    cap = got["max_load_tokens"]
    return Served(got["save"], got["load"] and not skip_cache, None if cap is None else cap // BS, problems)


@dataclass(frozen=True)
class Arrival:
    req_id: str
    prompt: tuple[int, ...] = field(repr=False)
    max_tokens: int
    admit_step: int
    body_index: int  # into BODIES
    skip_cache: bool = False

    @property
    def served(self) -> Served:
        return served(BODIES[self.body_index], self.skip_cache)


@dataclass(frozen=True)
class Server:
    """One engine of a seed."""
    settings: tuple[tuple[str, Any], ...]  # the seed's connector settings, the same for both engines
    role: str
    overlapped: bool  # vLLM's AsyncScheduler
    load_mode: str
    num_blocks: int
    budget_tokens: int | None
    requests: tuple[Arrival, ...]


def draw(seed: int) -> tuple[Server, ...]:
    """Two engines, 4-7 requests each: a prompt again, the first engine's prompt and more, a root's start and more."""
    rng = random.Random(9100 + seed)
    settings = {"save_decode": rng.random() < 0.7, "admit_after": rng.choice([1, 1, 2, "auto"]),
                "load_policy": rng.choice(["always", "always", "auto"])}
    role = rng.choice(["kv_both", "kv_both", "kv_producer", "kv_consumer"])
    if role == "kv_producer" and settings["admit_after"] == 2:
        role = "kv_both"  # refused at start (test_producer_admission.py)
    roots = [[rng.randrange(VOCAB) for _ in range(6 * BS)] for _ in range(3)]
    servers: list[Server] = []
    for index, server_role in enumerate(("kv_both", role)):
        earlier, out = list(servers[0].requests) if servers else [], list[Arrival]()
        for i in range(rng.randint(4, 7)):
            kind = rng.random()
            if out and kind < 0.25:
                prompt = list(rng.choice(out).prompt)
            elif earlier and kind < 0.75:
                prompt = [*rng.choice(earlier).prompt, *(rng.randrange(VOCAB) for _ in range(rng.choice([1, 9, 40])))]
            else:
                prompt = rng.choice(roots)[:rng.randint(0, 6) * BS + rng.choice([0, 1, 5, 17])]
                prompt += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 20, 40]))]
            any_body = rng.randrange(len(BODIES))
            body = rng.choice([any_body, rng.choice(CAPS)] if earlier else [0, any_body])  # the first engine stores
            out.append(Arrival(f"rcf-{seed}-{index}-{i}", tuple(prompt), rng.choice([1, 2, 5, 33, 40]),
                               0 if rng.random() < 0.6 else rng.randint(1, 4), body, rng.random() < 0.08))
        largest = max(-(-(len(r.prompt) + r.max_tokens) // BS) for r in out)
        servers.append(Server(tuple(settings.items()), server_role, rng.random() < 0.4,
                              rng.choice(["block", "layer", "async"]), rng.choice([256, largest + 2, largest + 4]),
                              rng.choice([None, None, 48, 96]), tuple(sorted(out, key=lambda r: r.admit_step))))
    return tuple(servers)


@dataclass
class Watch:
    """What one engine's connector did, per request, as it did it (each violation kept as text)."""
    served: dict[str, Served]
    saves: bool  # the role saves
    violations: list[str] = field(default_factory=list)
    loaded_blocks: Counter[str] = field(default_factory=Counter)
    preempted: set[str] = field(default_factory=set)
    tally: Counter[str] = field(default_factory=Counter)
    asking: str | None = None  # the request whose lookup runs

    def observe_step(self, so: Any) -> None:
        meta = so.kv_connector_metadata
        self.preempted |= set(so.preempted_req_ids or ())
        for transfer in [*meta.loads, *meta.async_loads]:
            want, n = self.served[transfer.req_id], len(transfer.block_ids)
            self.loaded_blocks[transfer.req_id] += n
            self.tally.update(loads=1, capped_loads_at_cap=n == want.cap_blocks)
            if want.loads_nothing or (want.cap_blocks is not None and n > want.cap_blocks):
                self.violations.append(f"step {meta.step}: {transfer.req_id} ({want}) loads {n} blocks")
        for transfer in meta.saves:
            self.tally["saves"] += 1
            if not self.served[transfer.req_id].save or not self.saves:
                self.violations.append(f"step {meta.step}: {transfer.req_id} ({self.served[transfer.req_id]}) saves")
        self.tally["load_off_beside_a_load"] += bool(meta.loads) and any(
            self.served[r].loads_nothing for r in so.num_scheduled_tokens)

    def install(self, engine: StandInEngine) -> None:
        """Wraps the real scheduler's hooks and lookups to watch them (each still runs)."""
        ours, totals = engine.ours, engine.ours.counters.totals.data
        real_match, real_alloc = ours.get_num_new_matched_tokens, ours.update_state_after_alloc
        real_longest = ours._lookup.longest_stored_prefix

        def match(request: Request, num_computed: int) -> Any:
            self.asking = request.request_id
            try:
                return real_match(request, num_computed)
            finally:
                self.asking = None

        def longest(state: Any, max_blocks: int) -> int:
            if self.asking is not None and self.served[self.asking].loads_nothing:
                self.violations.append(f"{self.asking} ({self.served[self.asking]}) looked up {max_blocks} blocks")
            return real_longest(state, max_blocks)

        def alloc(request: Request, blocks: Any, num_external: int) -> None:
            rid, want = request.request_id, self.served[request.request_id]
            record = getattr(ours._requests.get(rid), "lookup", None)
            before = (totals.get("lookups", 0), totals.get("hit_tokens", 0))
            real_alloc(request, blocks, num_external)
            counted = (totals.get("lookups", 0) - before[0], totals.get("hit_tokens", 0) - before[1])
            expected = (0, 0) if record is None or want.loads_nothing else (1, num_external)
            if counted != expected or (want.cap_blocks is not None and num_external > want.cap_blocks * BS):
                self.violations.append(f"{rid} ({want}) claimed {num_external} tokens, counted {counted}")

        ours.get_num_new_matched_tokens, ours.update_state_after_alloc = match, alloc  # type: ignore[method-assign]
        ours._lookup.longest_stored_prefix = longest  # type: ignore[method-assign]
        engine.post_execute.append(lambda eng, so, out: self.observe_step(so))


def _add(engine: Any, arrival: Arrival) -> None:  # ``engine``: its ``sched`` and ``hasher``
    body = BODIES[arrival.body_index]
    extra = None if body is ABSENT else {"kv_transfer_params": {"ucm_db": body}}
    params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra,
                            skip_reading_prefix_cache=arrival.skip_cache or None)
    engine.sched.add_request(Request(arrival.req_id, list(arrival.prompt), params, None, block_hasher=engine.hasher))


def run_server(root: Path, store: Path, server: Server) -> tuple[Outputs, Watch]:
    engine = StandInEngine(root, store, overlapped=server.overlapped, num_blocks=server.num_blocks, role=server.role,
                           extra={"load_mode": server.load_mode, **dict(server.settings)})
    engine.sched.scheduler_config.max_num_batched_tokens = server.budget_tokens or 4096  # the engine's 4096 if None
    watch = Watch({r.req_id: r.served for r in server.requests}, server.role != "kv_consumer")
    watch.install(engine)
    waiting, clock = list(server.requests), 0
    try:
        while (waiting or engine.sched.has_requests() or engine._in_flight is not None) and clock < 400:
            clock += 1
            while waiting and waiting[0].admit_step < clock:
                _add(engine, waiting.pop(0))
            if engine.sched.has_requests():
                engine.step()
            elif engine._in_flight is not None:
                engine._update(*engine._in_flight)
                engine._in_flight = None
        assert not waiting and not engine.sched.has_requests(), f"unfinished after {clock} steps"
    finally:
        engine.close()
    watch.violations += [f"{rid} loaded {n} blocks in all, over its cap" for rid, n in watch.loaded_blocks.items()
                         if rid not in watch.preempted and n > (watch.served[rid].cap_blocks or n)]
    return dict(engine.outputs), watch


def _must_store(server: Server, r: Arrival) -> int:
    """Leading blocks of ``r``'s chain it must have stored (admit_after 1 / "auto": every block it computed)."""
    settings = dict(server.settings)
    if settings["admit_after"] == 2 or server.role == "kv_consumer" or not r.served.save:
        return 0
    computed = len(r.prompt) + r.max_tokens - 1
    end = computed // BS if settings["save_decode"] else len(r.prompt) // BS
    if server.overlapped and r.max_tokens > 1 and computed % BS == 0 and end == computed // BS:
        end -= 1  # the last decode step's block: test_async_scheduling_never_saves_the_last_decode_block
    return end


def check_store(root: Path, store: Path, scenario: tuple[Server, ...], outputs: list[Outputs]) -> Counter[str]:
    chains: dict[tuple[int, ...], list[tuple[int, Arrival]]] = {}
    for e, (server, out) in enumerate(zip(scenario, outputs)):
        for r in server.requests:
            got = out.get(r.req_id, [])
            assert got == greedy(list(r.prompt), r.max_tokens), f"{r.req_id}'s output is wrong: {scenario}"
            chains.setdefault(r.prompt + tuple(got), []).append((e, r))
    tally = Counter[str]()
    for tokens in chains:
        if any(longer[:len(tokens)] == tokens for longer in chains if len(longer) > len(tokens)):
            continue  # checked with the longer chain: the same keys
        present, wrong = stored_map(root, store, list(tokens), {})
        assert wrong == [], f"blocks {wrong} of {chains[tokens][0][1].req_id}'s chain stored wrong: {scenario}"
        tally["stored_blocks"] += sum(present)
        for e, r in (held for shorter, reqs in chains.items() if tokens[:len(shorter)] == shorter for held in reqs):
            missing = [b for b in range(_must_store(scenario[e], r)) if not present[b]]
            assert missing == [], f"{r.req_id}'s blocks {missing} not stored (a neighbour's control?): {scenario}"
            tally["saving_requests_checked"] += _must_store(scenario[e], r) > 0
    return tally


@pytest.mark.parametrize("seed", SEEDS)
def test_controls_are_served_as_documented_in_random_batches(tmp_path: Path, seed: int,
                                                             scheduler_log: list[str]) -> None:
    scenario, store, outputs, tally = draw(seed), tmp_path / "store", [], Counter[str]()
    for server in scenario:
        out, watch = run_server(tmp_path, store, server)
        assert watch.violations == [], f"{watch.violations[:5]}: seed {seed}, {scenario}"
        outputs.append(out)
        tally += watch.tally + Counter(preempted=len(watch.preempted))
    for r in (r for server in scenario for r in server.requests):
        warned = [line for line in scheduler_log if f"request {r.req_id}: bad controls" in line]
        assert len(warned) == int(r.served.problems) and all(len(line) < 1000 for line in warned), f"{r}: {scenario}"
        tally["warned"] += len(warned)
    TALLIES[seed] = tally + check_store(tmp_path, store, scenario, outputs)


def test_the_seeds_exercise_the_controls() -> None:
    if set(TALLIES) != set(SEEDS):
        pytest.skip("needs every seed (run the whole file)")
    total = sum(TALLIES.values(), Counter[str]())
    assert total["loads"] >= 25 and total["saves"] >= 80 and total["capped_loads_at_cap"] >= 6, total
    assert total["load_off_beside_a_load"] >= 2 and total["preempted"] >= 4 and total["warned"] >= 20, total
    assert total["saving_requests_checked"] >= 60 and total["stored_blocks"] >= 250, total
    assert {s.role for seed in SEEDS for s in draw(seed)} == {"kv_both", "kv_producer", "kv_consumer"}


# -- targeted ------------------------------------------------------------------------------------------------------
def _warmed(root: Path, store: Path, seed: int) -> tuple[StandInEngine, list[int]]:  # stored it, vLLM caches it
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(4 * BS)]
    warm = StandInEngine(root, store)
    warm.add(f"rcf-warm-{seed}", prompt + [1], 1)
    warm.run()
    warm.runner.connector._worker.drain()  # type: ignore[union-attr]
    return warm, prompt


def _send(engine: Any, req_id: str, tokens: list[int], body: Any, max_tokens: int = 2) -> None:
    _add(engine, Arrival(req_id, tuple(tokens), max_tokens, 0, BODIES.index(body)))


def test_save_false_is_kept_by_every_multiconnector_child(tmp_path: Path) -> None:
    """vLLM's Scheduler with MultiConnector of two ucm-db children: child 1 (store 1) loads the prompt, child 2
    (store 2) saves what a ucm-db sibling loaded (composition.py) but nothing of a ``save: false`` request."""
    warm, prompt = _warmed(tmp_path, tmp_path / "s1", 1)
    warm.close()
    config = vllm_config(tmp_path, tmp_path / "s1")
    children = [{"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {**config.kv_transfer_config.kv_connector_extra_config,
                                               "path": str(tmp_path / name)}} for name in ("s1", "s2")]
    config = dataclasses.replace(config, kv_transfer_config=KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": children}))
    config.cache_config.num_gpu_blocks = 64
    engine = SimpleNamespace(sched=Scheduler(config, kv_cache_config(64), StructuredOutputManager(config), BS),
                             hasher=get_request_block_hasher(BS, sha256))
    try:
        _send(engine, "rcf-m-private", prompt + [6] * 40, {"save": False})
        _send(engine, "rcf-m-plain", prompt + [7] * 40, ABSENT)  # in the same step: vLLM's cache serves its prompt
        first, second = engine.sched.schedule().kv_connector_metadata.metadata
        assert [(t.req_id, t.block_ids) for t in first.loads] == [("rcf-m-private", (1, 2, 3, 4))]
        assert [t.req_id for child in (first, second) for t in child.saves] == ["rcf-m-plain", "rcf-m-plain"]
    finally:
        engine.sched.connector.shutdown()


def test_a_load_false_request_beside_a_same_step_load_loads_nothing_itself(tmp_path: Path) -> None:
    """docs/connector.md: `load: false` loads nothing through ucm-db, while vLLM's own prefix cache still serves it
    the blocks ucm-db loads for another request of the same step (vLLM allocates them first)."""
    warm, prompt = _warmed(tmp_path, tmp_path / "store", 2)
    warm.close()
    engine = StandInEngine(tmp_path, tmp_path / "store")
    try:
        _send(engine, "rcf-loads", prompt + [5] * 10, ABSENT)
        _send(engine, "rcf-no-load", prompt + [6] * 10, {"load": False})
        first = engine.sched.schedule()
        assert [t.req_id for t in first.kv_connector_metadata.loads] == ["rcf-loads"]
        assert first.num_scheduled_tokens["rcf-no-load"] == 10  # its prompt's 4 blocks came from vLLM's own cache
    finally:
        engine.close()


def test_load_false_copies_out_no_stored_block_that_vllms_cache_served(tmp_path: Path) -> None:
    engine, prompt = _warmed(tmp_path, tmp_path / "store", 3)
    try:
        _send(engine, "rcf-cap-0", prompt + [5] * 40, {"max_load_tokens": 0})  # vLLM's cache holds 4 of 5 blocks
        _send(engine, "rcf-load-off", prompt + [6] * 40, {"load": False})
        saves = {t.req_id: len(t.block_ids) for t in engine.sched.schedule().kv_connector_metadata.saves}
        assert saves == {"rcf-cap-0": 1, "rcf-load-off": 1}  # was 5 for rcf-load-off: blocks 0-3 copied out again
    finally:
        engine.close()


def test_a_publication_field_that_cannot_be_compared_never_ends_the_step(tmp_path: Path) -> None:
    engine, prompt = _warmed(tmp_path, tmp_path / "store", 4)
    try:
        engine.sched.add_request(Request("rcf-version", prompt + [5] * 40, SamplingParams(max_tokens=2, extra_args={
            "kv_transfer_params": {"ucm_db": {"version": np.array([1, 1])}}}), None, block_hasher=engine.hasher))
        engine.run()  # raised ValueError in get_num_new_matched_tokens (a lookup past vLLM's cached blocks)
        assert engine.outputs["rcf-version"] == greedy(prompt + [5] * 40, 2)
    finally:
        engine.close()


@pytest.mark.xfail(strict=True, reason="under async scheduling the block a request's last decode step completes is "
                                       "never keyed (its token unknown at planning), so never stored")
def test_async_scheduling_never_saves_the_last_decode_block(tmp_path: Path) -> None:
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(121)]  # 3 blocks and 25: 40 out complete block 4
    engine = StandInEngine(tmp_path, tmp_path / "store", overlapped=True)
    try:
        _send(engine, "rcf-async", prompt, {"save": "always"}, max_tokens=40)
        engine.run()
    finally:
        engine.close()
    present, wrong = stored_map(tmp_path, tmp_path / "store", prompt + engine.outputs["rcf-async"], {})
    assert wrong == [] and present == [True] * 5  # was block 4 missing; vLLM's sync Scheduler stores it
