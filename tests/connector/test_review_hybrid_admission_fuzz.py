"""Review (seeded adversarial walks): the SSM state groups of a hybrid model beside admission (``admit_after``
1/2/``"auto"``, ``save_decode``) and the request controls.

Written against commit 5ea6a1c (a state stored only inside the prefix every attention group stores or plans to in
its step), which these walks broke: vLLM offers a boundary state once, in the step that computes it, and a prompt's
second sighting over vLLM's own cache computes only its tail, so under ``admit_after: 2`` its attention blocks were
stored and its state never was: no engine hit it again (test_a_prompt_seen_twice_is_hit_as_admit_after_1_hits_it).
5ea6a1c was reverted (f827e3a); docs/connector.md now says a state group stores every state vLLM offers whatever
``save_decode`` and ``admit_after`` say. These walks hold the product to that.

Each seed walks 2-3 engines one after another on one store (test_audit_hybrid_harness.py: vLLM's real ``Scheduler``
in align mode, an SSM state group beside full-attention and for some seeds sliding-window groups, ucm-db's worker
half, a stand-in runner right only if every hit is), each with ``admit_after`` and ``save_decode`` drawn (auto's
floors made small, as test_auto_admission.py does), serving prompts new, repeated, extended (a next turn),
preempted and aborted, over vLLM's own cache or with it emptied, with controls ``save: false/"always"``, ``load:
false``, ``max_load_tokens``, and connector resets.

Invariants, checked after every request (the worker drained; keys of each namespace's current epoch):
    * outputs are what recomputing gives (an aborted request's, a prefix of them);
    * nothing stored that the settings forbid: an attention block new since the last check lies inside the savable
      prefix of a request served since (``save: false`` none, ``save_decode: false`` its prompt's whole blocks)
      and, under ``admit_after: 2`` (or ``"auto"`` at 2 throughout), was sighted twice in the engine and epoch,
      unless the request said ``save: "always"`` or (auto) its chain is sampled at 2; a new state belongs to a
      request served since that saves, at a boundary of tokens it computed;
    * a request that saves and computed its prompt stores a state of it, whatever admission says (the docs);
    * under ``"auto"`` at 2, a sampled chain computed by a request that saves is stored in every group;
    * hits are never lower than ``admit_after: 1``'s for prompts seen N times: a fresh reader hits a prompt as far
      as ``admit_after: 1`` would (``(len - 1) // block * block``, test_audit_hybrid_ssm_scenarios.py) where a
      request that saves computed it, and its blocks were admitted (N sightings in one engine and epoch, which
      may be over vLLM's own cache, ``admit_after: 1``, or ``save: "always"``), none keyed apart by a reset since.
States stored ahead of the attention groups' prefix (the documented cost) are counted, not refused.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import test_audit_hybrid_harness as harness  # noqa: E402
from test_audit_hybrid_harness import BS, HybridEngine, greedy, prompt_of  # noqa: E402
from ucm_db.connector import auto_admission  # noqa: E402
from ucm_db.connector.auto_admission import sampled  # noqa: E402
from ucm_db.connector.hybrid.ssm_state import SsmStateScheduler  # noqa: E402

SEEDS = [3, 11, 19, 27, 35, 43, 51, 59, 67, 75, 83, 91, 99, 107]
KINDS = [("mamba", "full"), ("mamba", "window", "full")]
ADMITS: list[int | str] = [1, 2, "auto"]
Prefix = tuple[int, ...]
Element = tuple[int, Prefix]  # (KV cache group, the tokens of a stored block's chain or a state's boundary)
#: Paths each seed's walk took, summed over the seeds (test_the_seeds_exercise_every_path).
TALLIES: dict[int, Counter[str]] = {}


@dataclass
class Served:
    """One request as served: its tokens (prompt and outputs) and what decides what it may store."""

    rid: str
    prompt: list[int]
    controls: dict[str, Any]
    engine: int
    epoch_run: int  # the engine's key epoch (a connector reset starts another)
    admit: int | str = 1  # its engine's admit_after
    outputs: list[int] = field(default_factory=list)
    clean: bool = False  # completed, never preempted, vLLM's own cache held none of it
    aborted: bool = False
    preempted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def saves(self) -> bool:
        return self.controls.get("save", True) is not False

    def prefixes(self, end_tokens: int) -> list[Prefix]:
        """Its chain's block prefixes within its first ``end_tokens`` tokens."""
        return [tuple(self.tokens[: k * BS]) for k in range(1, end_tokens // BS + 1)]


def store_view(engine: HybridEngine, tokens: list[int]) -> set[Element]:
    """What the store holds of ``tokens``' chain at each group's current epoch: ``(g, prefix)`` per stored block
    (attention: its leading stored prefix) and per stored state (its boundary)."""
    probe = Request("review-probe", tokens, SamplingParams(max_tokens=1), None, block_hasher=engine.hasher)
    out: set[Element] = set()
    n = len(tokens) // BS
    for g, part in enumerate(engine.sched.connector._scheduler.parts):  # type: ignore[union-attr]
        if isinstance(part, SsmStateScheduler):
            out.update((g, tuple(tokens[: k * BS])) for k in range(1, n + 1) if part.has_state(probe, k * BS))
        else:
            keys = part.keys_for(probe, n)
            held = part.store.lookup_many(part.namespace, [keys], grid=part._grid, spans=part._spans)[0] if n else 0
            out.update((g, tuple(tokens[: k * BS])) for k in range(1, held + 1))
        part._requests.pop("review-probe", None)
    return out


def watch_lookups(engine: HybridEngine) -> dict[str, int]:
    """Records vLLM's own hit of each request at its first lookup (the connector's ``num_computed_tokens``)."""
    local: dict[str, int] = {}
    lookup = engine.sched.connector.get_num_new_matched_tokens  # type: ignore[union-attr]

    def looked_up(request: Request, num_computed_tokens: int) -> Any:
        local.setdefault(request.request_id, num_computed_tokens)
        return lookup(request, num_computed_tokens)

    engine.sched.connector.get_num_new_matched_tokens = looked_up  # type: ignore[union-attr, method-assign]
    return local


def thresholds(engine: HybridEngine) -> set[int]:
    """The admission N in force in each attention group (``"auto"`` moves each group's apart)."""
    return {p._admission.admit_after for p in engine.sched.connector._scheduler._attention}  # type: ignore[union-attr]


def add(engine: HybridEngine, rid: str, prompt: list[int], max_tokens: int, controls: dict[str, Any] | None = None,
        ) -> None:
    extra = {"kv_transfer_params": {"ucm_db": controls}} if controls else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    engine.sched.add_request(Request(rid, prompt, params, None, block_hasher=engine.hasher))


class Walk:
    """One seed's walk (module docstring) and its checks."""

    def __init__(self, seed: int, root: Path) -> None:
        self.rng, self.root, self.seed = random.Random(seed), root, seed
        self.kinds = self.rng.choice(KINDS)
        self.served: list[Served] = []
        self.tally: Counter[str] = Counter()
        picked = self.rng.sample(range(900), 900)  # prompt_of's prompts differ by seed mod 900
        self._fresh = iter([seed for seed in picked if not sampled(prompt_of(seed, 16))])
        self._fresh_sampled = iter([seed for seed in picked if sampled(prompt_of(seed, 16))])
        self._ids = iter(range(1000))
        self.reset_engines: set[int] = set()  # a reset bumps the store's epoch: what came before is keyed apart

    def prompt(self, n: int) -> list[int]:
        sample = self.rng.random() < 0.25  # a chain sampled at auto's 2
        return prompt_of(next(self._fresh_sampled if sample else self._fresh), n)

    def run(self) -> Counter[str]:
        for index in range(self.rng.randint(2, 3)):
            self.engine_run(index)
        self.read_back()
        return self.tally

    def engine_run(self, index: int) -> None:
        admit = self.rng.choice(ADMITS)
        save_decode, tight = self.rng.random() < 0.5, self.rng.random() < 0.3
        extra = {"admit_after": admit, "save_decode": save_decode}
        blocks = (24 if "window" in self.kinds else 17) if tight else 96
        engine = HybridEngine(self.root, self.root / "store", kinds=self.kinds, extra=extra, num_blocks=blocks)
        local, self.epoch_run, self.engine_index = watch_lookups(engine), index * 10, index
        self.tally.update({f"admit_after={admit}": 1, f"save_decode={save_decode}": 1, f"kinds={len(self.kinds)}": 1})
        self.settings: tuple[int | str, bool] = (admit, save_decode)
        self.sightings = Counter[Prefix]()
        try:
            self.held = self.view(engine)
            for _ in range(self.rng.randint(4, 6)):
                self.one_op(engine, local, tight)
        finally:
            engine.close()

    def view(self, engine: HybridEngine) -> set[Element]:
        engine.runner.connector._worker.drain()  # type: ignore[union-attr]
        return set().union(*(store_view(engine, s.tokens) for s in self.served)) if self.served else set()

    def new_served(self, prompt: list[int]) -> Served:
        draw = self.rng.random()
        controls: dict[str, Any] = ({"save": False} if draw < 0.12 else {"save": "always"} if draw < 0.24 else
                                    {"load": False} if draw < 0.34 else
                                    {"max_load_tokens": self.rng.choice([0, 40, 100])} if draw < 0.44 else {})
        self.tally.update(f"control:{k}={v}" for k, v in controls.items())
        return Served(f"r{next(self._ids)}", prompt, controls, self.engine_index, self.epoch_run, self.settings[0])

    def reset(self, engine: HybridEngine) -> None:
        """vLLM's reset with the connector's: every group keyed at a new epoch (connector/epochs.py)."""
        assert engine.sched.reset_prefix_cache(reset_connector=True)
        self.epoch_run += 1
        self.reset_engines.add(self.engine_index)
        self.sightings.clear()  # keys of the new epoch: their sightings start again
        self.held = self.view(engine)
        self.tally["connector_reset"] += 1

    def batch_of(self, kind: str, tight: bool) -> list[Served]:
        rng, done = self.rng, [s for s in self.served if not s.aborted]
        here = [s for s in done if s.engine == self.engine_index] or done
        prompts = {"pair": lambda: [self.prompt(150), self.prompt(150)],  # decoding in a small pool: one preempted
                   "repeat": lambda: [list(rng.choice(here).prompt)],
                   "extend": lambda: [rng.choice(here).tokens + self.prompt(rng.randint(20, 90))]}  # a next turn
        new = [self.prompt(rng.randint(100, 150 if tight else 230))]
        return [self.new_served(prompt) for prompt in prompts.get(kind, lambda: new)()]

    def one_op(self, engine: HybridEngine, local: dict[str, int], tight: bool) -> None:
        rng = self.rng
        kind = rng.choice(["new", "repeat", "repeat", "extend", "abort"] + ["pair"] * tight)
        if kind in ("repeat", "extend") and not any(not s.aborted for s in self.served):
            kind = "new"
        if rng.random() < 0.04:
            self.reset(engine)
        batch = self.batch_of(kind, tight)
        if rng.random() < 0.5:
            engine.sched.reset_prefix_cache()  # vLLM's own cache emptied (the Nth sighting computes its prompt)
        max_tokens = 90 if kind == "pair" else rng.choice([2, 8, 40])
        for served in batch:
            add(engine, served.rid, served.prompt, max_tokens, served.controls)
        before = thresholds(engine)
        if kind == "abort":
            for _ in range(rng.randint(1, 4)):  # HybridEngine.run's steps, not overlapped
                so = engine.sched.schedule()
                engine._update(so, engine.runner.execute(so))
            engine.sched.finish_requests(batch[0].rid, RequestStatus.FINISHED_ABORTED)
            batch[0].aborted = True
        engine.run()
        self.tally[f"op:{kind}"] += 1
        self.tally["auto_at_2"] += self.settings[0] == "auto" and before == {2}
        for served in batch:
            served.outputs = engine.outputs.get(served.rid, [])
            expected = greedy(served.prompt, len(served.outputs) if served.aborted else max_tokens, self.kinds)
            assert served.outputs == expected, (self.seed, served.rid)
            served.preempted = served.rid in engine.preempted
            served.clean = not served.aborted and local.get(served.rid) == 0 and not served.preempted
            self.tally["preempted"] += served.preempted
            self.tally["over_vllm_cache"] += bool(local.get(served.rid))
            self.sightings.update(served.prefixes(len(served.tokens)))
        self.served.extend(batch)
        self.check(engine, batch, before | thresholds(engine))

    def check(self, engine: HybridEngine, batch: list[Served], in_force: set[int]) -> None:
        held = self.view(engine)
        for element in held - self.held:
            self.assert_allowed(element, batch, in_force)
        state = self.kinds.index("mamba")
        for served in batch:
            if served.clean and served.saves:  # the docs: every offered state, whatever admission says
                assert any((state, p) in held for p in served.prefixes(len(served.prompt))), (self.seed, served.rid)
                self.tally["state_of_computed_prompt"] += 1
            if in_force == {2}:
                self.sampled_in_every_group(served, held)
        for prefix in [prefix for g, prefix in held - self.held if g == state]:
            self.tally["states_ahead_of_attention"] += any((a, prefix) not in held for a in range(len(self.kinds)))
        self.held = held

    def assert_allowed(self, element: Element, batch: list[Served], in_force: set[int]) -> None:
        g, prefix = element
        k, state = len(prefix) // BS, self.kinds[g] == "mamba"
        admit, save_decode = self.settings
        for served in batch:
            if not served.saves or served.tokens[: len(prefix)] != list(prefix):
                continue
            computed = (len(served.tokens) - 1) // BS
            if state and k <= computed:
                self.tally["new_states_allowed"] += 1
                return
            if state or k > (computed if save_decode else len(served.prompt) // BS):
                continue
            if (served.controls.get("save") == "always" or admit == 1 or 1 in in_force
                    or (admit == "auto" and sampled(served.tokens)) or self.sightings[prefix] >= 2):
                self.tally["new_blocks_allowed"] += 1
                return
        raise AssertionError(f"seed {self.seed}: group {g} stored {k} blocks no request of {[s.rid for s in batch]} "
                             f"may store under {self.settings}, {in_force}")

    def sampled_in_every_group(self, served: Served, held: set[Element]) -> None:
        """Under ``"auto"`` at 2, a sampled chain served cleanly is stored in every group: its prompt's blocks in
        each attention group alike, and a state (auto_admission.py: a chain some groups stored serves no hit)."""
        if self.settings[0] != "auto" or not sampled(served.tokens) or not served.clean or not served.saves:
            return
        per_group = [sum((g, p) in held for p in served.prefixes(len(served.prompt))) for g in range(len(self.kinds))]
        attention = {n for n, kind in zip(per_group, self.kinds) if kind != "mamba"}
        self.tally["sampled_at_2"] += 1
        assert 0 not in per_group and len(attention) == 1, (self.seed, served.rid, per_group)

    def admitted(self, served: Served) -> bool:
        """Whether ``served``'s prompt blocks were admitted: ``admit_after: 1``, ``save: "always"``, or the Nth
        sighting in its engine and epoch (over vLLM's own cache too) of requests that look up their whole prompt (a
        ``load: false`` one finds no block stored, so counts stored ones once and is refused at its first: the
        docs' prefix rule)."""
        if served.controls.get("save") == "always" or served.admit == 1:
            return True
        upto = self.served[: self.served.index(served) + 1]
        return sum(s.engine == served.engine and s.epoch_run == served.epoch_run and s.prompt == served.prompt
                   and not s.controls and not s.aborted and not s.preempted for s in upto) >= 2

    def read_back_wanted(self) -> dict[Prefix, Served]:
        """Prompts a request that saves computed and whose blocks were admitted (module docstring)."""
        kept = [s for s in self.served if s.saves and not s.aborted and not s.preempted
                and not any(index >= s.engine for index in self.reset_engines)]  # keyed apart (connector/epochs.py)
        computed = {tuple(s.prompt) for s in kept if s.clean}
        return {tuple(s.prompt): s for s in kept if tuple(s.prompt) in computed and self.admitted(s)}

    def read_back(self) -> None:
        """A fresh reader (admit_after 1, every hit loaded) of each prompt seen N times (module docstring)."""
        wanted = self.read_back_wanted()
        engine = HybridEngine(self.root, self.root / "store", kinds=self.kinds, extra={"load_policy": "always"})
        try:
            for i, (prompt, served) in enumerate(wanted.items()):
                engine.sched.reset_prefix_cache()
                add(engine, f"read{i}", list(prompt), 2, {"save": False})
                engine.run()
                assert engine.first[f"read{i}"] == (len(prompt) - 1) // BS * BS, (self.seed, served.rid)
                self.tally["read_back_hits"] += 1
                self.tally["read_back_seen_twice"] += served.admit != 1 and "save" not in served.controls
                self.tally["read_back_over_vllm_cache"] += not served.clean
        finally:
            engine.close()


@pytest.fixture()
def small_auto_floors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few prompts decide ``"auto"`` (the rule is the same: test_auto_admission.py)."""
    monkeypatch.setattr(auto_admission, "MIN_EVIDENCE_BLOCKS", 8)
    monkeypatch.setattr(auto_admission, "HALF_LIFE_BLOCKS", 16)
    monkeypatch.setattr(auto_admission, "MIN_SAMPLED_BLOCKS", 8)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_walk_stores_what_its_settings_allow(tmp_path: Path, seed: int, small_auto_floors: None) -> None:
    TALLIES[seed] = Walk(seed, tmp_path).run()


def test_the_seeds_exercise_every_path() -> None:
    if set(TALLIES) != set(SEEDS):
        pytest.skip("needs every seed's walk (run the whole file)")
    total = sum(TALLIES.values(), Counter[str]())
    wanted = ("admit_after=1 admit_after=2 admit_after=auto save_decode=True save_decode=False kinds=2 kinds=3 "
              "control:save=False control:save=always control:load=False op:new op:repeat op:extend op:abort op:pair "
              "preempted over_vllm_cache connector_reset auto_at_2 sampled_at_2 state_of_computed_prompt "
              "states_ahead_of_attention new_states_allowed new_blocks_allowed read_back_hits read_back_seen_twice "
              "read_back_over_vllm_cache").split()
    assert [path for path in wanted if total[path] == 0] == [], dict(total)
    assert any(k.startswith("control:max_load_tokens") for k in total)


# -- the defect the walks met in 5ea6a1c, as its smallest reproduction (it passes since the revert) --------------------


@pytest.mark.parametrize("admit", [2, "auto"])
def test_a_prompt_seen_twice_is_hit_as_admit_after_1_hits_it(tmp_path: Path, admit: int | str,
                                                              small_auto_floors: None) -> None:
    """Seen twice on one engine (the second time vLLM's own cache holds it, as it usually does): ``admit_after:
    1`` stores the state after 6 blocks at the first sighting and a restarted engine hits 192 tokens. Under 2 (or
    ``"auto"`` once at 2) the second sighting stores the 6 attention blocks and computes only the 5 tokens past
    vLLM's hit, so no state is offered then: the first sighting's state must have been stored. 5ea6a1c held it back
    (no attention prefix stored yet) and the restarted engine hit nothing; it was reverted (f827e3a)."""
    prompt = prompt_of(1, 197)
    assert not sampled(prompt)
    engine = HybridEngine(tmp_path, tmp_path / "store", extra={"admit_after": admit})
    try:
        if admit == "auto":  # unique traffic moves the threshold to 2 first
            for i in range(3):
                add(engine, f"u{i}", prompt_of(40 + i, 197), 2)
                engine.run()
            assert thresholds(engine) == {2}
        for rid in ("first", "second"):
            add(engine, rid, prompt, 2)
            engine.run()
    finally:
        engine.close()
    assert engine.first["second"] == 192  # vLLM's own cache
    reader = harness.serve(tmp_path, tmp_path / "store", {"r": prompt}, 2, extra={"load_policy": "always"})
    assert reader.first["r"] == 192
