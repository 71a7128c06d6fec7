"""Malformed per-request controls fail closed (connector/request_controls.py):
``save`` and ``load`` are privacy controls, so a value of the wrong type or
range is served as the value that does least (``save: false``, ``load:
false``, ``max_load_tokens: 0``), never as the default. Before, ``"save":
"false"`` (a string) was served as if absent, i.e. as save true: the client
that asked for privacy had its prompt stored.

Through the real scheduler (and worker) halves without an engine, as
tests/connector/test_request_controls.py drives them, the PD roles as
tests/connector/test_roles.py does, and a hybrid model's SSM state group as
tests/connector/test_ssm_state.py does; tests/vllm/test_request_controls_server.py
sends the same values through vLLM's OpenAI server. Also: a request that
can load nothing (``max_load_tokens`` below one block) counts no lookup in
the metrics, as ``load: false`` counts none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from test_request_controls import (  # noqa: E402
    BS, UNITS_PER_BLOCK, Engine, _request, _stored, engine, scheduler_log,  # noqa: F401 - fixtures
)
from test_ssm_state import model_dir  # noqa: E402,F401 - a fixture
from ucm_db.connector.request_controls import RequestControls  # noqa: E402
from ucm_db.connector.roles import PARAMS_KEY  # noqa: E402

TOKENS = list(range(1, 4 * BS + 10))  # 4 whole blocks and 9 tokens


def _named(name: str, controls: Any) -> Request:
    """A request of TOKENS with an id of its own: a warning is given once per
    request id in the process, and other modules number their requests too."""
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {PARAMS_KEY: controls}})
    return Request(f"fail-closed-{name}", TOKENS, params, None)  # type: ignore[arg-type]


# -- the parser ------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "served", "said"), [
    ({"save": "false"}, RequestControls(save=False), "save='false' (wants true, false or \"always\"): served as save false"),
    ({"save": 0}, RequestControls(save=False), "save=0 (wants true, false or \"always\"): served as save false"),
    ({"save": 1}, RequestControls(save=False), "save=1 (wants true, false or \"always\"): served as save false"),
    ({"save": "no"}, RequestControls(save=False), "save='no' (wants true, false or \"always\"): served as save false"),
    ({"save": [False]}, RequestControls(save=False), "save=a list of 1 items (wants true, false or \"always\"): served as save false"),
    ({"load": "no"}, RequestControls(load=False), "load='no' (wants true or false): served as load false"),
    ({"load": "true"}, RequestControls(load=False), "load='true' (wants true or false): served as load false"),
    ({"max_load_tokens": -3}, RequestControls(max_load_tokens=0),
     "max_load_tokens=-3 (wants an integer >= 0): served as max_load_tokens 0"),
    ({"max_load_tokens": "12"}, RequestControls(max_load_tokens=0),
     "max_load_tokens='12' (wants an integer >= 0): served as max_load_tokens 0"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_a_malformed_control_is_served_as_its_value_that_does_least(body: dict[str, Any], served: RequestControls,
                                                                    said: str) -> None:
    assert RequestControls.from_params({PARAMS_KEY: body}) == (served, (said,))


def test_only_the_malformed_field_fails_closed_and_null_and_unknown_fields_stay_the_default() -> None:
    controls, problems = RequestControls.from_params({PARAMS_KEY: {"save": "false", "load": True, "max_load_tokens": 64}})
    assert controls == RequestControls(save=False, load=True, max_load_tokens=64)
    assert RequestControls.from_params({PARAMS_KEY: {"save": None, "load": None, "max_load_tokens": None}}) == (RequestControls(), ())
    assert RequestControls.from_params({PARAMS_KEY: {"colour": "red"}}) == (RequestControls(), ("unknown field 'colour' (ignored)",))


# -- through the scheduler -------------------------------------------------------------------
@pytest.mark.parametrize("save", ["false", 0, "no"])
def test_a_malformed_save_stores_nothing_of_the_request(engine: Engine, scheduler_log: list[str], save: Any) -> None:
    req = _named(f"save-{save!r}", {"save": save})
    hit, saves = engine.prefill(req)
    assert (hit, saves) == (0, [])  # no save planned: the worker copies nothing out
    assert engine.decode(req, 7) == []
    assert engine.stored_units() == 0
    # The same prompt without the control misses (nothing was stored), then is stored.
    assert engine.prefill(_request(TOKENS)) == (0, [(0, 1, 2, 3)])
    assert engine.stored_units() == 4 * UNITS_PER_BLOCK
    warnings = [line for line in scheduler_log if line.startswith("WARNING") and req.request_id in line]
    assert len(warnings) == 1 and "(wants true, false or \"always\"): served as save false" in warnings[0]


@pytest.mark.parametrize("load", ["no", 0])
def test_a_malformed_load_looks_nothing_up_and_computes_the_request_whole(engine: Engine, load: Any) -> None:
    _stored(engine, TOKENS)
    lookups = engine.scheduler.counters.totals.data["lookups"]
    engine.lookups = 0
    hit, saves = engine.prefill(_request(TOKENS, {"load": load}))
    assert hit == 0 and engine.lookups == 0  # the store's lookup was never called
    assert saves == [(0, 1, 2, 3)]  # save was not malformed: computed blocks are copied out as usual
    assert engine.scheduler.counters.totals.data["lookups"] == lookups


@pytest.mark.parametrize("cap", [-3, "12", 12.5, True])
def test_a_malformed_max_load_tokens_loads_nothing(engine: Engine, cap: Any) -> None:
    _stored(engine, TOKENS)
    lookups = engine.scheduler.counters.totals.data["lookups"]
    engine.lookups = 0
    hit, saves = engine.prefill(_request(TOKENS, {"max_load_tokens": cap}))
    assert hit == 0 and engine.lookups == 0  # as max_load_tokens 0: nothing to load, nothing asked of the store
    assert saves == [(0, 1, 2, 3)]
    assert engine.scheduler.counters.totals.data["lookups"] == lookups  # and no lookup counted


# -- metrics: a request that can load nothing counts no lookup ------------------------------
@pytest.mark.parametrize("cap", [0, BS - 1])
def test_max_load_tokens_below_one_block_counts_no_lookup(engine: Engine, scheduler_log: list[str], cap: int) -> None:
    _stored(engine, TOKENS)
    totals = engine.scheduler.counters.totals.data
    before = {name: totals[name] for name in ("lookups", "query_tokens", "hit_tokens", "lookup_hist_0")}
    req = _named(f"cap-{cap}", {"max_load_tokens": cap})
    assert engine.prefill(req)[0] == 0
    assert {name: totals[name] for name in before} == before
    assert any(f"request {req.request_id}: {len(TOKENS)} prompt tokens, not looked up (load off: the request's max_load_tokens "
               "is below one block)" in line for line in scheduler_log)
    # vLLM's own cache holds the first block: still no lookup counted, and the local tier still
    # says which of vLLM's blocks are stored, so block 0 is not copied out again.
    req = _request(TOKENS, {"max_load_tokens": cap})
    assert engine.prefill(req, local_tokens=BS) == (0, [(1, 2, 3)])
    assert {name: totals[name] for name in before} == before
    # The counters do count lookups: the same prompt without the cap is one.
    assert engine.prefill(_request(TOKENS))[0] == 4 * BS
    assert totals["lookups"] == before["lookups"] + 1


# -- prefill/decode roles --------------------------------------------------------------------
def test_a_producer_given_a_malformed_save_stores_and_publishes_nothing(tmp_path: Path) -> None:
    import test_roles as pd

    settings = pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched, worker = pd.UcmDbScheduler(settings, pd.SHAPE, pd.PRODUCER), pd.UcmDbWorker(settings, pd.SHAPE, pd.NUM_BLOCKS, pd.PRODUCER)
    worker.register_kv_caches(pd._kv(0), 0, 0)
    try:
        tokens = list(range(3, 3 + 3 * pd.BS + 7))
        req = pd._request("p-malformed-save", tokens, {PARAMS_KEY: {"save": "false"}})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        block_ids = list(range(len(tokens) // pd.BS + 1))
        meta = sched.build_connector_meta(pd._step(req, block_ids, len(tokens)))
        assert meta.saves == []
        worker.save(meta)
        worker.drain()
        _, params = sched.request_finished(req, block_ids)
        assert params is not None and params[PARAMS_KEY]["blocks"] == 0  # only blocks stored before it: none
        assert sched.store.stats().blocks == 0
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("bad", [{"load": "no"}, {"max_load_tokens": "12"}], ids=["load", "max_load_tokens"])
def test_a_consumer_given_a_malformed_load_control_neither_waits_nor_loads(tmp_path: Path, bad: dict[str, Any]) -> None:
    """A producer announced blocks this consumer's store does not hold yet:
    with load on it would wait for them (None); served as ``load: false`` /
    ``max_load_tokens: 0`` it computes the request whole at once."""
    import test_roles as pd

    tokens = list(range(7, 7 + 3 * pd.BS + 5))
    params = pd._produce(pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "elsewhere")}), tokens, pd._kv(3))
    del params[PARAMS_KEY]["stores"]  # it names the store it was published to: as from a producer before store names, waited for
    settings = pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_deadline_s": 30})
    sched = pd.UcmDbScheduler(settings, pd.SHAPE, pd.CONSUMER)
    try:
        assert sched.get_num_new_matched_tokens(pd._request("c-plain", tokens, params), 0) == (None, False)  # waits
        req = pd._request("c-malformed", tokens, {PARAMS_KEY: {**params[PARAMS_KEY], **bad}})
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        assert sched.counters.totals.data["lookups"] == 0
    finally:
        sched.shutdown()


# -- a hybrid model's SSM state group --------------------------------------------------------
def test_a_malformed_save_stores_no_attention_block_and_no_state(tmp_path: Path, model_dir: Path) -> None:
    import test_ssm_state as ssm

    mamba = ssm._mamba()
    eng = ssm._Engine(model_dir, tmp_path / "store", ssm._kv(1, mamba), mamba)
    try:
        req = ssm._request("quiet-malformed", ssm.TOKENS, controls={"save": "false"})
        assert eng.lookup(req) == 0
        ids = ([0] * 5 + [7], list(range(11, 17)))
        eng.step(ssm._step(req, ids, 6 * BS, [(0, 7, 6 * BS), (1, 99, 6 * BS)]))
        assert sum(eng.blocks().values()) == 0
    finally:
        eng.close()
