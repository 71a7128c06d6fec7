"""A decode server whose MultiConnector puts a local cache in front of the
shared store the producer published to.

Found by the PD audit: every ucm-db child honours a producer's publication,
and MultiConnector answers "ask again" (None) as soon as one child does, so
the local cache's child, whose store never receives the producer's blocks,
held every PD request for its whole ``load_deadline_s`` (5 s by default)
and then counted every announced block as a publication miss, though the
shared store's child had them all from the first step. A publication names
the stores it was published to now, and a consumer waits only for one it
reads; one for a store it reads still waits, and recomputes at the deadline.

Real parts: vLLM's Scheduler and MultiConnector, ucm-db's connectors on real
stores; the model runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, lose_unit  # noqa: E402
from test_audit_pd_harness import PdEngine, child, multi_transfer  # noqa: E402

from ucm_db.connector.metadata import BlockTransfer  # noqa: E402

_RNG = random.Random(11)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(4 * BS + 5)]  # 4 whole blocks
DEADLINE_S = 20.0  # long enough that a wait for it is a test timing out, not a slow pass


def _publish(tmp_path: Path, store: Path) -> dict[str, Any]:
    prefill = StandInEngine(tmp_path, store, role="kv_producer")
    prefill.add("P", PROMPT, 1)
    prefill.run()
    params = prefill.kv_params["P"]
    prefill.close()
    return params


def _decode_request(engine: StandInEngine, params: dict[str, Any]) -> None:
    engine.sched.add_request(Request("D", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                                 extra_args={"kv_transfer_params": params}), None,
                                     block_hasher=engine.hasher))


@pytest.mark.parametrize("cache_role", ["kv_both", "kv_consumer"])
def test_a_local_cache_in_front_does_not_hold_a_pd_request(tmp_path: Path, cache_role: str) -> None:
    shared = tmp_path / "shared"
    params = _publish(tmp_path, shared)
    decode = PdEngine(tmp_path, multi_transfer([child(tmp_path / "nvme", cache_role, {"load_deadline_s": DEADLINE_S}),
                                                child(shared, "kv_consumer", {"load_deadline_s": DEADLINE_S})], "kv_consumer"))
    _decode_request(decode, params)
    decode.run_until_done(max_s=DEADLINE_S / 2)  # raised: the first child held the request for its deadline
    first = decode.scheduled[0]
    misses = [c._scheduler.counters.totals.data.get("publication_misses", 0) for c in decode.children()]
    decode.close()
    assert first.num_scheduled_tokens == {"D": len(PROMPT) - 4 * BS}  # scheduled at once, its 4 blocks loaded
    assert [(t.req_id, len(t.block_ids)) for t in first.kv_connector_metadata.metadata[1].loads] == [("D", 4)]
    assert misses == [0, 0]
    assert decode.outputs["D"] == greedy(PROMPT, 3)


def test_a_consumer_of_the_published_store_still_waits_and_recomputes_at_its_deadline(tmp_path: Path) -> None:
    """The wait is kept where it can end: a publication naming the
    consumer's own store whose block is gone (here deleted after the
    publication) is waited for, then recomputed from there."""
    shared = tmp_path / "shared"
    params = _publish(tmp_path, shared)
    decode = StandInEngine(tmp_path, shared, role="kv_consumer", extra={"load_deadline_s": 0.3})
    keys = decode.ours.keys_for(Request("k", PROMPT, SamplingParams(max_tokens=1), None), 4)
    lose_unit(decode, BlockTransfer("k", tuple(keys), (0, 1, 2, 3)), 2)  # blocks 2 and 3 (its descendant)
    _decode_request(decode, params)
    waited = 0
    while decode.sched.has_requests():
        decode.step()
        waited += not decode.scheduled[-1].num_scheduled_tokens
    data = decode.ours.counters.totals.data
    decode.close()
    assert waited > 0 and data["publication_misses"] == 2 and data["publication_wait_s"] >= 0.3
    assert [(t.req_id, len(t.block_ids)) for so in decode.scheduled for t in so.kv_connector_metadata.loads] == [("D", 2)]
    assert decode.outputs["D"] == greedy(PROMPT, 3)


def test_a_consumer_that_judges_the_remote_slower_than_recompute_does_not_wait_for_it(tmp_path: Path) -> None:
    """Found by the PD audit: a producer published to the remote tier
    (``publish: "remote"``), and the consumer on another node, whose cost
    model measured that remote slower than its prefill, left it out of its
    lookup and then waited its whole ``load_deadline_s`` for the blocks it
    chose not to fetch, counting each as a publication miss. It recomputes
    at once now (a cost skip, not a miss). The link's and the prefill's
    costs are fed to the real cost model as the samples it learns from."""
    import dataclasses

    import test_roles as pd

    from ucm_db.connector.roles import producer_store_options

    (tmp_path / "remote").mkdir()
    remote = {"remote": f"file://{tmp_path / 'remote'}"}
    producer = pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "p"), "publish": "remote", **remote})
    producer = dataclasses.replace(producer, store_options=producer_store_options(producer.store_options, "remote"))
    tokens = list(range(5, 5 + 3 * pd.BS + 4))
    params = pd._produce(producer, tokens, pd._kv(6))
    consumer = pd.UcmDbScheduler(pd.ConnectorSettings.from_extra_config({"path": str(tmp_path / "c"), "load_deadline_s": 30, **remote}),
                                 pd.SHAPE, pd.CONSUMER)
    try:
        for _ in range(20):
            consumer.cost.observe_load(consumer._ns_id, "remote", 32, 1.0)  # 32 tokens a second from the remote
            consumer.cost.observe_prefill(1024, 0.01)  # 100k tokens a second computed
        assert consumer.get_num_new_matched_tokens(pd._request("c", tokens, params), 0) == (0, False)  # was None (waits)
        data = consumer.counters.totals.data
        assert data["cost_skips"] == 1 and data.get("publication_misses", 0) == 0
    finally:
        consumer.shutdown()
