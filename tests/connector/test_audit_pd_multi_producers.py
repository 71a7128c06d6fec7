"""Two ucm-db ``kv_producer`` children under vLLM's MultiConnector (a fast
local store in front of the shared one, the two-store layout of
docs/connector.md on a prefill server).

Found by the PD audit: every producer child returned its publication under
the same key, ``ucm_db``, and vLLM's MultiConnector stops the engine on a
key two children return (``RuntimeError: Key clash in kv_transfer_params
from multiple connectors: {'ucm_db'}``, raised in ``update_from_output``:
the first prefill that finished ended the engine). Now the first child's
publication is the request's, holding the blocks every child's store holds.

Real parts: vLLM's Scheduler and MultiConnector (scheduler and worker
halves, made by vLLM's factory from the config), ucm-db's connectors on
real stores; the model runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, stored_blocks  # noqa: E402
from test_audit_pd_harness import PdEngine, child, multi_transfer  # noqa: E402

from ucm_db.connector.roles import PARAMS_KEY, Publication  # noqa: E402

_RNG = random.Random(27)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(4 * BS + 9)]  # 4 whole blocks


def test_two_producer_children_publish_once_and_a_consumer_of_either_store_loads_it(tmp_path: Path) -> None:
    nvme, shared = tmp_path / "nvme", tmp_path / "shared"
    prefill = PdEngine(tmp_path, multi_transfer([child(nvme, "kv_producer"), child(shared, "kv_producer")], "kv_producer"))
    prefill.add("R", PROMPT, 1)
    prefill.run_until_done()  # raised RuntimeError (Key clash) in update_from_output before
    params = prefill.kv_params["R"]
    counters = [c._scheduler.counters.totals.data for c in prefill.children()]
    prefill.close()
    from ucm_db.connector.roles import store_fingerprints

    published = Publication.from_params(params)
    assert published is not None and published.blocks == 4
    assert set(published.stores) == set(store_fingerprints(nvme, None)) | set(store_fingerprints(shared, None))
    assert [c["published_blocks"] for c in counters] == [4, 4]  # each child's own count; one publication reaches vLLM
    for store in (nvme, shared):
        assert stored_blocks(tmp_path, store, PROMPT) == (4, [])

    decode = StandInEngine(tmp_path, shared, role="kv_consumer", extra={"load_deadline_s": 30})
    decode.sched.add_request(Request("D", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                                 extra_args={"kv_transfer_params": params}), None,
                                     block_hasher=decode.hasher))
    decode.run()
    loads = [(t.req_id, len(t.block_ids)) for so in decode.scheduled for t in so.kv_connector_metadata.loads]
    misses = decode.ours.counters.totals.data.get("publication_misses", 0)
    decode.close()
    assert loads == [("D", 4)] and misses == 0
    assert decode.outputs["D"] == greedy(PROMPT, 3)


def test_a_later_child_folds_in_the_fewer_blocks_and_its_store() -> None:
    """The publication reaching vLLM holds the blocks every child's store
    holds (the fewest) and names every store; another request object (one
    more engine in the process) is published apart."""
    from ucm_db.connector.composition import publish_once

    class _Request:  # a request object, as MultiConnector hands the same one to every child
        pass

    keys = [bytes([i]) * 32 for i in range(5)]
    request, other_request = _Request(), _Request()
    first, second = object(), object()

    def params(blocks: int, store: str) -> dict:
        return Publication("ns", blocks, 16, keys[blocks - 1].hex(), "local", (store,)).to_params()

    mine = params(5, "a")
    assert publish_once(request, first, mine, PARAMS_KEY) is mine
    assert publish_once(request, second, params(3, "b"), PARAMS_KEY) is None  # folded into the first
    assert (mine[PARAMS_KEY]["blocks"], mine[PARAMS_KEY]["tokens"], mine[PARAMS_KEY]["last_key"]) == (3, 48, keys[2].hex())
    assert mine[PARAMS_KEY]["stores"] == ["a", "b"]
    assert publish_once(request, first, params(4, "c"), PARAMS_KEY) is not None  # the same child again: its own
    apart = params(4, "d")
    assert publish_once(other_request, second, apart, PARAMS_KEY) is apart


def test_with_both_stores_holding_the_prompt_only_the_first_child_loads_and_counts_the_hit(tmp_path: Path) -> None:
    """What ran and found nothing wrong (MultiConnector ordering): the
    second child, whose store holds the prompt too, loads nothing into the
    blocks the first filled, counts its lookup but no hit, and neither
    child waits for the publication both stores hold."""
    nvme, shared = tmp_path / "nvme", tmp_path / "shared"
    prefill = PdEngine(tmp_path, multi_transfer([child(nvme, "kv_producer"), child(shared, "kv_producer")], "kv_producer"))
    prefill.add("R", PROMPT, 1)
    prefill.run_until_done()
    params = prefill.kv_params["R"]
    prefill.close()
    decode = PdEngine(tmp_path, multi_transfer([child(nvme, "kv_consumer", {"load_deadline_s": 30}),
                                                child(shared, "kv_consumer", {"load_deadline_s": 30})], "kv_consumer"))
    decode.sched.add_request(Request("D", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                                 extra_args={"kv_transfer_params": params}), None,
                                     block_hasher=decode.hasher))
    decode.run_until_done(max_s=15)
    first = decode.scheduled[0]
    counters = [c._scheduler.counters.totals.data for c in decode.children()]
    decode.close()
    loads = [[(t.req_id, len(t.block_ids)) for t in meta.loads] for meta in first.kv_connector_metadata.metadata]
    assert loads == [[("D", 4)], []]
    assert [(c["lookups"], c["hit_tokens"], c.get("publication_misses", 0)) for c in counters] == [(1, 4 * BS, 0), (1, 0, 0)]
    assert decode.outputs["D"] == greedy(PROMPT, 3)
