"""PD audit, the areas where nothing was found wrong: what ran.

* Request controls (``kv_transfer_params['ucm_db']``) in each role, through
  vLLM's real Scheduler: a producer given ``save: false`` stores nothing
  and publishes only the blocks stored before it; one given ``load: false``
  loads nothing and publishes every block; a consumer given ``load: false``
  neither waits nor loads, one given ``max_load_tokens`` loads no further,
  one given ``save: "always"`` stores nothing. Outputs are right throughout.
* A producer whose KV is not the consumer's (another block size, KV dtype,
  model, tensor-parallel layout kept: the namespace) or whose epoch moved
  (a reset): the consumer neither waits nor loads, at once.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy  # noqa: E402

_RNG = random.Random(8)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(4 * BS + 3)]  # 4 whole blocks


def _run(engine: StandInEngine, req_id: str, max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    """Runs one request of PROMPT; its loads and saves (blocks), whether its
    first step scheduled it, and its publication."""
    extra = {"kv_transfer_params": params} if params is not None else None
    engine.sched.add_request(Request(req_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                                    extra_args=extra), None, block_hasher=engine.hasher))
    assert engine.sched.reset_prefix_cache()  # vLLM's own cache holds nothing of an earlier request
    first = len(engine.scheduled)
    engine.run()
    steps = engine.scheduled[first:]
    assert engine.outputs[req_id] == greedy(PROMPT, max_tokens)
    return {"loads": sum(len(t.block_ids) for so in steps for t in so.kv_connector_metadata.loads if t.req_id == req_id),
            "saves": sum(len(t.block_ids) for so in steps for t in so.kv_connector_metadata.saves if t.req_id == req_id),
            "at_once": req_id in steps[0].num_scheduled_tokens, "params": engine.kv_params.get(req_id)}


def test_request_controls_hold_in_each_role(tmp_path: Path) -> None:
    store = tmp_path / "store"
    seed = StandInEngine(tmp_path, store)  # 2 blocks of the prompt stored before
    seed.add("seed", PROMPT[:2 * BS + 1], 1)
    seed.run()
    seed.close()

    producer = StandInEngine(tmp_path, store, role="kv_producer")
    quiet = _run(producer, "quiet", 1, {"ucm_db": {"save": False}})
    assert (quiet["loads"], quiet["saves"], quiet["params"]["ucm_db"]["blocks"]) == (2, 0, 2)
    fresh = _run(producer, "fresh", 1, {"ucm_db": {"load": False}})
    producer.close()
    assert (fresh["loads"], fresh["saves"], fresh["params"]["ucm_db"]["blocks"]) == (0, 4, 4)
    published = fresh["params"]["ucm_db"]

    consumer = StandInEngine(tmp_path, store, role="kv_consumer", extra={"load_deadline_s": 30})
    blocks_before = consumer.ours.store.stats().blocks
    assert _run(consumer, "off", 2, {"ucm_db": {**published, "load": False}}) | {"params": None} == {
        "loads": 0, "saves": 0, "at_once": True, "params": None}
    capped = _run(consumer, "capped", 2, {"ucm_db": {**published, "max_load_tokens": 2 * BS + 5}})
    assert (capped["loads"], capped["at_once"]) == (2, True)
    always = _run(consumer, "always", 2, {"ucm_db": {**published, "save": "always"}})
    assert (always["loads"], always["saves"]) == (4, 0)
    blocks_after = consumer.ours.store.stats().blocks
    consumer.close()
    assert blocks_after == blocks_before


@pytest.mark.parametrize("other", [{"block_size": 16}, {"kv_dtype": "float16"}, {"model": "other-weights"}, "reset"])
def test_a_publication_of_other_kv_is_neither_waited_for_nor_loaded(tmp_path: Path, other: Any) -> None:
    import dataclasses

    import test_roles as pd

    settings = pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_deadline_s": 30})
    tokens = list(range(3, 3 + 4 * pd.BS + 5))
    params = pd._produce(settings, tokens, pd._kv(1))
    assert params[pd.PARAMS_KEY]["blocks"] == 4
    shape = pd.SHAPE if other == "reset" else dataclasses.replace(pd.SHAPE, **other)
    consumer = pd.UcmDbScheduler(settings, shape, pd.CONSUMER)
    try:
        if other == "reset":  # the consumer's engine reset since (weights updated in place): keyed apart
            assert consumer.reset_cache()
        assert consumer.get_num_new_matched_tokens(pd._request("c", tokens, params), 0) == (0, False)
        assert consumer.counters.totals.data.get("publication_misses", 0) == 0
    finally:
        consumer.shutdown()
