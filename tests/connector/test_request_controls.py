"""Per-request controls and admission (issue 49, items 1 and 2) with the real
:class:`UcmDbScheduler`, real vLLM request objects and scheduler outputs, a
real store and (where a save must reach the store) a worker on CPU KV
tensors, without an engine (the engine test: tests/vllm/test_request_controls_server.py).

Lookups are counted by wrapping the store's ``lookup`` method (every lookup
of the scheduler, local tier or remote, goes through it: lookups.py), so
"no lookup" means that method was not called.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.identity import KVShape  # noqa: E402
from ucm_db.connector.request_controls import (  # noqa: E402
    PUBLICATION_FIELDS, RequestControls,
)
from ucm_db.connector.roles import PARAMS_KEY, Publication  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings, valid_keys  # noqa: E402
from ucm_db.connector.sighting_sketch import SKETCH_DEPTH, SKETCH_WIDTH, SightingSketch  # noqa: E402
from ucm_db.connector.warming import warming_params  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

BS = 32
NUM_BLOCKS = 64
SHAPE = KVShape(model="tiny", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test", tp_size=1, pp_size=1,
                kv_heads=2, layers=2)
UNITS_PER_BLOCK = 2  # one unit per KV head
_ids = itertools.count()


def _request(tokens: list[int], controls: Any = None, max_tokens: int = 4, **sampling: Any) -> Request:
    """A request with a fresh id (problems are reported once per request id,
    in the whole process) and ``controls`` under ``ucm_db`` (``None``: no
    kv_transfer_params)."""
    extra = None if controls is None else {"kv_transfer_params": {PARAMS_KEY: controls}}
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra, **sampling)
    return Request(f"req-{next(_ids)}", tokens, params, None)  # type: ignore[arg-type]


def _kv() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, 2, BS, 128).to(torch.bfloat16) for i in range(2)}


def _output(new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int],
            block_ids: dict[str, list[int]]) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState(set(block_ids), lambda rid: (block_ids[rid],), {})
    return out


def _prefill_step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    return _output([NewRequestData.from_request(req, (block_ids,))], CachedRequestData.make_empty(),
                   {req.request_id: num_tokens}, {req.request_id: block_ids})


def _decode_step(req: Request, block_ids: list[int]) -> SchedulerOutput:
    """One decode token of a running request (its KV at ``req.num_computed_tokens``)."""
    cached = CachedRequestData(req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                               new_block_ids=[None], num_computed_tokens=[req.num_computed_tokens],
                               num_output_tokens=[req.num_output_tokens])
    return _output([], cached, {req.request_id: 1}, {req.request_id: block_ids})


class Engine:
    """A scheduler and a worker on one store, driven like vLLM drives them."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.scheduler = UcmDbScheduler(settings, SHAPE)
        self.worker = UcmDbWorker(settings, SHAPE, NUM_BLOCKS)
        self.worker.register_kv_caches(_kv(), 0, 0)
        self.lookups = 0
        store = self.scheduler.store
        real_lookup = store.lookup

        def counting_lookup(*args: Any, **kwargs: Any) -> int:
            self.lookups += 1
            return real_lookup(*args, **kwargs)

        store.lookup = counting_lookup  # type: ignore[method-assign]

    def admit(self, req: Request, local_tokens: int = 0) -> int:
        """vLLM's scheduler for a new request: lookup, allocation, computed tokens."""
        ext, is_async = self.scheduler.get_num_new_matched_tokens(req, local_tokens)
        assert is_async is False and ext is not None
        self.scheduler.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
        req.num_computed_tokens = local_tokens + ext
        return ext

    def prefill(self, req: Request, local_tokens: int = 0) -> tuple[int, list[tuple[int, ...]]]:
        """The request's whole prompt in one step; returns its hit tokens and
        the step's saves as block-id tuples (their units committed)."""
        hit = self.admit(req, local_tokens)
        block_ids = list(range(req.num_tokens // BS + 1))
        meta = self.scheduler.build_connector_meta(_prefill_step(req, block_ids, req.num_tokens - req.num_computed_tokens))
        self.worker.save(meta)
        self.worker.drain()
        req.num_computed_tokens = req.num_tokens
        return hit, [save.block_ids for save in meta.saves]

    def decode(self, req: Request, token: int) -> list[tuple[int, ...]]:
        """One generated token, then its decode step; returns the step's saves."""
        req.append_output_token_ids(token)
        block_ids = list(range(req.num_tokens // BS + 1))
        meta = self.scheduler.build_connector_meta(_decode_step(req, block_ids))
        self.worker.save(meta)
        self.worker.drain()
        req.num_computed_tokens += 1
        return [save.block_ids for save in meta.saves]

    def stored_units(self) -> int:
        return self.scheduler.store.stats().blocks

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def count_sketch_reads(eng: Engine) -> list[int]:
    """The lengths of the key lists the scheduler's real sighting sketch is
    asked to count, appended as it reads them."""
    sketch = eng.scheduler._planner._admission.sketch
    assert sketch is not None
    reads: list[int] = []
    real_counts = sketch.counts

    def counting(keys: Any) -> Any:
        reads.append(len(keys))
        return real_counts(keys)

    sketch.counts = counting  # type: ignore[method-assign]
    return reads


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_policy": "always"}))
    yield eng
    eng.close()


def _stored(engine: Engine, tokens: list[int]) -> None:
    """A plain request stores ``tokens``' whole blocks."""
    hit, _ = engine.prefill(_request(tokens))
    assert hit == 0
    assert engine.stored_units() >= len(tokens) // BS * UNITS_PER_BLOCK


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture()
def scheduler_log() -> Iterator[list[str]]:
    lines = _Lines()
    log = logging.getLogger("vllm.ucm_db.connector.scheduler")
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    yield lines.lines
    log.removeHandler(lines)
    log.setLevel(level)


# -- parsing ----------------------------------------------------------------------------
def test_controls_are_read_from_the_connectors_own_key() -> None:
    assert RequestControls.from_params(None) == (RequestControls(), ())
    assert RequestControls.from_params({"do_remote_prefill": True}) == (RequestControls(), ())  # another connector's keys
    parsed = RequestControls.from_params({PARAMS_KEY: {"save": False, "load": False, "max_load_tokens": 64}})
    assert parsed == (RequestControls(save=False, load=False, max_load_tokens=64), ())
    assert RequestControls(max_load_tokens=3 * BS + 31).max_load_blocks(BS) == 3  # whole blocks, rounded down
    assert RequestControls().max_load_blocks(BS) is None
    assert RequestControls.from_params({PARAMS_KEY: {"save": None}}) == (RequestControls(), ())  # null: absent


@pytest.mark.parametrize(("body", "problem", "served"), [
    ({"save": "no"}, "save='no' (wants true, false or \"always\"): served as save false", RequestControls(save=False)),
    ({"load": 0}, "load=0 (wants true or false): served as load false", RequestControls(save=False, load=False)),
    ({"max_load_tokens": -1}, "max_load_tokens=-1 (wants an integer >= 0): served as max_load_tokens 0",
     RequestControls(save=False, max_load_tokens=0)),
    ({"max_load_tokens": True}, "max_load_tokens=True (wants an integer >= 0): served as max_load_tokens 0",
     RequestControls(save=False, max_load_tokens=0)),
    ({"max_load_tokens": 12.5}, "max_load_tokens=12.5 (wants an integer >= 0): served as max_load_tokens 0",
     RequestControls(save=False, max_load_tokens=0)),
    ({"sav": False}, "unknown field 'sav' (ignored)", RequestControls(save=False)),
])
def test_an_ill_typed_field_fails_closed_and_an_unknown_one_is_ignored(body: dict[str, Any], problem: str,
                                                                       served: RequestControls) -> None:
    """tests/connector/test_request_controls_fail_closed.py: why, and through the scheduler."""
    controls, problems = RequestControls.from_params({PARAMS_KEY: {**body, "save": False} if "save" not in body else body})
    assert problems == (problem,)
    assert controls == served  # the bad field as its value that does least; the good one kept


def test_a_body_that_is_not_an_object_is_reported_and_fails_closed() -> None:
    controls, problems = RequestControls.from_params({PARAMS_KEY: ["save", False]})
    assert controls == RequestControls(save=False, load=False)
    assert problems == ("'ucm_db' is list, not an object of controls: served as save false, load false",)


def test_a_producers_publication_is_no_problem() -> None:
    """The publication shares the key (roles.py); its fields are known here, and stay in step."""
    params = Publication("ab" * 8, 3, BS, "cd" * 32, "local").to_params()
    assert set(params[PARAMS_KEY]) == PUBLICATION_FIELDS
    assert RequestControls.from_params(params) == (RequestControls(), ())
    assert RequestControls.from_params({PARAMS_KEY: {**params[PARAMS_KEY], "save": False}}) == (RequestControls(save=False), ())


def test_controls_made_in_code_are_validated() -> None:
    with pytest.raises(ConfigError, match="'save' must be true, false or \"always\""):
        RequestControls(save="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'max_load_tokens' must be an integer >= 0"):
        RequestControls(max_load_tokens=-5)


# -- the controls, through the scheduler -------------------------------------------------
def test_save_false_stores_nothing(engine: Engine) -> None:
    tokens = list(range(1, 4 * BS + 10))
    hit, saves = engine.prefill(req := _request(tokens, {"save": False}))
    assert (hit, saves) == (0, [])
    assert engine.decode(req, 7) == []
    assert engine.stored_units() == 0
    hit, saves = engine.prefill(_request(tokens))  # the same prompt without the control: a miss, then stored
    assert hit == 0 and saves == [(0, 1, 2, 3)]
    assert engine.stored_units() == 4 * UNITS_PER_BLOCK


def test_save_false_still_loads(engine: Engine) -> None:
    tokens = list(range(1, 4 * BS + 10))
    _stored(engine, tokens)
    before = engine.stored_units()
    hit, saves = engine.prefill(_request(tokens + [5] * BS, {"save": False}))
    assert hit == 4 * BS and saves == []
    assert engine.stored_units() == before


def test_an_unsettled_lora_adapter_neither_saves_nor_loads(engine: Engine, tmp_path: Path) -> None:
    """Another adapter's files under an id this engine already loaded: vLLM
    may compute with the old one, so its KV is never stored (a random key
    no request would find: only write traffic and space)."""
    from vllm.lora.request import LoRARequest

    from ucm_db.connector import fingerprints, lora_loads

    adapters = {}
    for name, weights in (("a", b"1"), ("b", b"2")):
        (path := tmp_path / name).mkdir()
        (path / "adapter_config.json").write_text('{"r": 8}')
        (path / "adapter_model.safetensors").write_bytes(weights * 512)
        adapters[name] = str(path)
    tokens = list(range(1, 4 * BS + 10))
    saved_ids = dict(fingerprints._adapter_ids), dict(fingerprints._adapters)
    try:
        first = _request(tokens)
        first.lora_request = LoRARequest("a", 77, adapters["a"])
        # No vLLM worker here: what vLLM's adapter load records before the forward (lora_loads.py).
        lora_loads.note_load(77, adapters["a"], lora_loads._stats(adapters["a"]))
        assert engine.prefill(first) == (0, [(0, 1, 2, 3)])
        lookups = engine.lookups
        other = _request(tokens)
        other.lora_request = LoRARequest("b", 77, adapters["b"])  # another adapter, the same id
        assert engine.prefill(other) == (0, [])
        assert engine.lookups == lookups and engine.stored_units() == 4 * UNITS_PER_BLOCK
    finally:
        lora_loads._loaded.pop(77, None)
        fingerprints._adapter_ids.clear(), fingerprints._adapters.clear()
        fingerprints._adapter_ids.update(saved_ids[0]), fingerprints._adapters.update(saved_ids[1])


def test_load_false_claims_nothing_and_looks_nothing_up(engine: Engine, scheduler_log: list[str]) -> None:
    tokens = list(range(1, 4 * BS + 10))
    _stored(engine, tokens)
    lookups_before = engine.scheduler.counters.totals.data["lookups"]
    engine.lookups = 0
    req = _request(tokens, {"load": False})
    assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert engine.lookups == 0  # the store's lookup was never called
    hit, saves = engine.prefill(req)
    assert hit == 0 and engine.lookups == 0
    assert saves == [(0, 1, 2, 3)]  # still saved (save defaults to true): the store keeps one copy
    assert engine.stored_units() == 4 * UNITS_PER_BLOCK
    assert engine.scheduler.counters.totals.data["lookups"] == lookups_before  # no lookup counted either
    assert any("not looked up (load off" in line and req.request_id in line for line in scheduler_log)
    # The wrapper does see lookups: the same prompt without the control hits.
    assert engine.prefill(_request(tokens))[0] == 4 * BS and engine.lookups > 0


@pytest.mark.parametrize("sampling", [{"skip_reading_prefix_cache": True}, {"prompt_logprobs": 1}],
                         ids=["skip_reading_prefix_cache", "prompt_logprobs"])
def test_vllms_skip_reading_prefix_cache_is_load_false(engine: Engine, sampling: dict[str, Any]) -> None:
    """vLLM 0.32 throws a connector's claim away for such a request
    (vllm/v1/core/sched/scheduler.py); it sets the flag itself for prompt_logprobs."""
    tokens = list(range(1, 4 * BS + 10))
    _stored(engine, tokens)
    engine.lookups = 0
    req = _request(tokens, **sampling)
    assert req.skip_reading_prefix_cache is True
    assert engine.prefill(req)[0] == 0
    assert engine.lookups == 0


def test_max_load_tokens_caps_the_hit_in_whole_blocks(engine: Engine) -> None:
    tokens = list(range(1, 5 * BS + 10))
    _stored(engine, tokens)
    sched = engine.scheduler
    assert sched.get_num_new_matched_tokens(_request(tokens, {"max_load_tokens": 2 * BS + 31}), 0) == (2 * BS, False)
    assert sched.get_num_new_matched_tokens(_request(tokens, {"max_load_tokens": 10 * BS}), 0) == (5 * BS, False)
    assert sched.get_num_new_matched_tokens(_request(tokens, {"max_load_tokens": BS - 1}), 0) == (0, False)
    # vLLM's own prefix cache holds the first block: the cap counts what ucm-db loads past it.
    assert sched.get_num_new_matched_tokens(_request(tokens, {"max_load_tokens": 2 * BS}), BS) == (2 * BS, False)


def test_a_capped_request_saves_only_what_it_computed(engine: Engine) -> None:
    """The lookup asked no further than the cap: blocks past it are computed
    and saved again (the store keeps its one copy)."""
    tokens = list(range(1, 5 * BS + 10))
    _stored(engine, tokens)
    before = engine.stored_units()
    hit, saves = engine.prefill(_request(tokens, {"max_load_tokens": 2 * BS}))
    assert hit == 2 * BS and saves == [(2, 3, 4)]
    assert engine.stored_units() == before


def test_bad_controls_warn_once_and_the_request_is_served(engine: Engine, tmp_path: Path, scheduler_log: list[str]) -> None:
    tokens = list(range(1, 4 * BS + 10))
    _stored(engine, tokens)
    before = engine.stored_units()
    req = _request(tokens + [3] * BS, {"save": "no", "max_load_tokens": -3, "colour": "red"})
    assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    hit, saves = engine.prefill(req)  # a second lookup of the same request
    assert hit == 0 and saves == []  # served failing closed: save false, max_load_tokens 0
    assert engine.stored_units() == before
    # Another scheduler in this process (a hybrid model's other group, a MultiConnector sibling) parses it too.
    other = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "other")}), SHAPE)
    try:
        other.get_num_new_matched_tokens(req, 0)
    finally:
        other.shutdown()
    warnings = [line for line in scheduler_log if line.startswith("WARNING") and req.request_id in line]
    assert warnings == [
        f"WARNING ucm-db: request {req.request_id}: bad controls in kv_transfer_params['ucm_db']: save='no' (wants true, false or "
        "\"always\"): served as save false; max_load_tokens=-3 (wants an integer >= 0): served as max_load_tokens 0; "
        "unknown field 'colour' (ignored) "
        "(controls: save (true, false or \"always\"), load (true or false), max_load_tokens (an integer >= 0))"
    ]


# -- admission ---------------------------------------------------------------------------
@pytest.mark.parametrize("save_decode", [True, False])
def test_save_decode_decides_whether_blocks_of_generated_tokens_are_stored(tmp_path: Path, save_decode: bool) -> None:
    extra = {"path": str(tmp_path / "store"), "save_decode": save_decode, "load_policy": "always"}
    eng = Engine(ConnectorSettings.from_extra_config(extra))
    try:
        req = _request(list(range(1, 4 * BS)), max_tokens=BS + 2)  # 3 whole prompt blocks, the 4th one token short
        assert eng.prefill(req)[1] == [(0, 1, 2)]
        # The first generated token completes block 3; block 4 is generated tokens only.
        assert eng.decode(req, 11) == ([(3,)] if save_decode else [])
        saves = [save for i in range(BS) for save in eng.decode(req, 12 + i)]
        assert saves == ([(4,)] if save_decode else [])
        assert eng.stored_units() == (5 if save_decode else 3) * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_admit_after_2_stores_a_chain_from_its_second_sighting(tmp_path: Path) -> None:
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2, "load_policy": "always"}))
    try:
        shared = list(range(1, 2 * BS + 1))             # 2 blocks, e.g. a system prompt
        tail_a, tail_b = [7] * 2 * BS + [1], [9] * 2 * BS + [1]
        assert eng.prefill(_request(shared + tail_a)) == (0, [])  # first sighting: nothing written
        assert eng.stored_units() == 0
        # Second sighting of the shared blocks, first of tail b: the shared prefix only.
        assert eng.prefill(_request(shared + tail_b)) == (0, [(0, 1)])
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
        # Tail a's second sighting: stored after the shared blocks it hits.
        assert eng.prefill(_request(shared + tail_a)) == (2 * BS, [(2, 3)])
        assert eng.prefill(_request(shared + tail_a)) == (4 * BS, [])
        assert eng.stored_units() == 4 * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_a_save_false_request_is_a_sighting(tmp_path: Path) -> None:
    """``save: false`` stores nothing of its request, but the request computed
    its blocks: that is a sighting (docs/connector.md), so under
    ``admit_after: 2`` the next request of the prompt stores it. Before, a
    ``save: false`` request was not counted and the next was a first sighting."""
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2, "load_policy": "always"}))
    try:
        prompt = list(range(1, 2 * BS + 2))
        assert eng.prefill(_request(prompt, {"save": False})) == (0, [])
        assert eng.stored_units() == 0
        assert eng.prefill(_request(prompt)) == (0, [(0, 1)])  # its second sighting: stored
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
        unseen = list(range(700, 700 + 2 * BS + 1))
        assert eng.prefill(_request(unseen)) == (0, [])  # a first sighting is still refused
    finally:
        eng.close()


@pytest.mark.parametrize("admit_after", [2, "auto"])
def test_save_always_stores_a_first_sighting_whatever_admit_after_says(tmp_path: Path, admit_after: int | str) -> None:
    """``save: "always"`` (warm_engine sends it) stores a prompt seen once,
    where ``admit_after: 2`` (and "auto" at 2) store nothing of it; the
    other requests stay under admission."""
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": admit_after, "load_policy": "always"}))
    try:
        if eng.scheduler._admission.auto is not None:
            eng.scheduler._admission.auto.threshold = 2  # as after unique traffic (test_auto_admission.py moves it for real)
        assert eng.prefill(_request(list(range(1, 2 * BS + 2))))[1] == []  # first sighting: refused
        assert eng.prefill(_request(list(range(500, 500 + 2 * BS + 1)), {"save": "always"})) == (0, [(0, 1)])
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
        assert eng.prefill(_request(list(range(900, 900 + 2 * BS + 1))))[1] == []
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
        warming = Request(f"req-{next(_ids)}", list(range(1300, 1300 + 2 * BS + 1)), warming_params(), None)  # type: ignore[arg-type]
        assert eng.prefill(warming) == (0, [(0, 1)])  # warm_engine's requests: stored at their first sighting
        assert eng.stored_units() == 4 * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_a_refused_request_reads_the_sighting_counts_once_per_completed_block(tmp_path: Path) -> None:
    """``admit_after: 2`` with unique prompts: a decode step that completes
    no block reads no sketch counts (they cost a server's scheduler every
    step), and a block completed later reads them again, so blocks another
    request sighted meanwhile are admitted then."""
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2, "load_policy": "always"}))
    try:
        reads = count_sketch_reads(eng)
        prompt = list(range(1, 2 * BS + 2))  # 2 whole blocks and one token
        a = _request(prompt, max_tokens=2 * BS)
        assert eng.prefill(a)[1] == []  # first sighting: refused
        assert reads == [2]
        for i in range(BS - 2):  # decode steps that complete no block
            assert eng.decode(a, 100 + i) == []
        assert reads == [2]
        assert eng.prefill(_request(prompt))[1] == [(0, 1)]  # a second sighting of a's two blocks
        assert eng.decode(a, 200) == [(0, 1)]  # completes block 2: counts read again, a's first two admitted
        assert reads == [2, 2, 3]
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_a_preempted_request_saves_its_admitted_blocks_again(tmp_path: Path) -> None:
    """Admission read once per completed block must not stop a request that
    vLLM preempted before its admitted blocks were copied: computed again,
    they are saved again (the later, refused block still is not)."""
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2, "load_policy": "always"}))
    try:
        shared = list(range(1, 2 * BS + 1))
        assert eng.prefill(_request(shared + [5] * BS + [1]))[1] == []  # first sighting of the 2 shared blocks
        a = _request(shared + [7] * BS + [1])  # shared blocks admitted (second sighting), its 3rd block refused
        eng.admit(a)
        block_ids = list(range(a.num_tokens // BS + 1))
        meta = eng.scheduler.build_connector_meta(_prefill_step(a, block_ids, a.num_tokens))
        assert [save.block_ids for save in meta.saves] == [(0, 1)]  # planned, then vLLM preempts a before the copy
        preempt = _output([], CachedRequestData.make_empty(), {}, {})
        preempt.preempted_req_ids = {a.request_id}
        eng.scheduler.build_connector_meta(preempt)
        a.num_computed_tokens = 0
        assert eng.prefill(a)[1] == [(0, 1)]  # resumed: computed again, saved again
        assert eng.stored_units() == 2 * UNITS_PER_BLOCK
    finally:
        eng.close()


def test_admission_settings_are_validated(tmp_path: Path) -> None:
    assert {"save_decode", "admit_after"} <= set(valid_keys())
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path)})
    assert (settings.save_decode, settings.admit_after) == (True, 1)
    for bad in ({"save_decode": "no"}, {"save_decode": 0}):
        with pytest.raises(ConfigError, match="save_decode must be true or false"):
            ConnectorSettings.from_extra_config({"path": str(tmp_path), **bad})
    for bad_n in (0, True, "2", 2.0, 256):
        with pytest.raises(ConfigError, match=r"admit_after must be an integer in \[1, 255\]"):
            ConnectorSettings.from_extra_config({"path": str(tmp_path), "admit_after": bad_n})


def test_the_sighting_sketch_is_bounded_never_undercounts_and_forgets() -> None:
    sketch = SightingSketch()
    assert sketch.nbytes == SKETCH_DEPTH * SKETCH_WIDTH == 16 << 20
    rng = np.random.default_rng(0)
    keys = [rng.bytes(32) for _ in range(5000)]
    for times, chunk in enumerate((keys[:1000], keys[1000:3000], keys[3000:])):
        for _ in range(times + 1):
            sketch.sight(chunk)
    counts = sketch.counts(keys)
    assert (counts[:1000] >= 1).all() and (counts[1000:3000] >= 2).all() and (counts[3000:] >= 3).all()
    assert (counts[:1000] == 1).mean() > 0.99  # collisions are rare at this load
    assert not sketch.counts([rng.bytes(32) for _ in range(1000)]).any()
    small = SightingSketch(width=1 << 16, halve_every=100)
    small.sight(keys[:60])
    small.sight(keys[:60])  # 120 sightings: every counter halved once
    assert (small.counts(keys[:60]) >= 1).all()
    small.sight(keys[60:160])  # 100 more, seen once: halved again
    assert not small.counts(keys[60:160]).any()


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("hostile", ["nested", "huge_string", "many_fields"])
def test_a_hostile_control_value_never_fails_the_scheduler_and_its_warning_stays_short(
        engine: Engine, scheduler_log: list[str], hostile: str) -> None:
    """Audit: repr() of a value nested ~1000 deep raised RecursionError inside get_num_new_matched_tokens,
    so vLLM's Scheduler.schedule() raised and the engine core died; a 10 MB value made a 10 MB log line,
    100k unknown fields a 2.8 MB one. Each is served (a bad value failing closed), with one short warning."""
    import sys

    controls: dict[str, object] = {
        "nested": {"save": _nested(sys.getrecursionlimit() + 100)},
        "huge_string": {"load": "x" * (10 << 20)},
        "many_fields": {f"field-{i}": i for i in range(100_000)},
    }[hostile]
    tokens = list(range(1, 4 * BS + 10))
    _stored(engine, tokens)
    req = _request(tokens + [3] * BS, controls)
    loads = hostile != "huge_string"  # a malformed load is served as load false
    assert engine.scheduler.get_num_new_matched_tokens(req, 0) == (4 * BS if loads else 0, False)
    warnings = [line for line in scheduler_log if line.startswith("WARNING") and req.request_id in line]
    assert len(warnings) == 1 and len(warnings[0]) < 1000, warnings[0][:2000]


def test_an_integer_repr_cannot_print_is_described_by_its_size() -> None:
    """vLLM refuses such ints in a request today; repr() of one raises ValueError (over 4300 digits)."""
    from ucm_db.connector.request_controls import RequestControls

    controls, problems = RequestControls.from_params({"ucm_db": {"save": 1 << 20_000}})
    assert controls == RequestControls(save=False)
    assert problems == ("save=an integer of 20001 bits (wants true, false or \"always\"): served as save false",)


def test_reported_request_ids_are_kept_as_digests() -> None:
    """A client sets a chat request's id; 4096 ids of 4 MiB were 16 GiB held after their requests ended."""
    from ucm_db.connector import request_controls

    long_id = "r" * (4 << 20)
    assert request_controls.first_report(long_id) and not request_controls.first_report(long_id)
    assert all(len(key) == 16 for key in request_controls._reported)
