"""Prefill/decode through the store, offline, two nodes: real vLLM CPU
engines, each in its own process, started together (issue 11). The one-node
case (one store directory) is tests/vllm/test_pd_http.py.

* ``producer``: ``kv_producer`` on store S1 with ``publish="remote"`` to a
  ``file://`` remote R (write-through); each prompt with ``max_tokens=1``,
  its ``kv_transfer_params`` appended to a file the moment ``generate``
  returns. Before that, each prompt under a salt of its own: the reference
  (one engine, no disaggregation, nothing loaded).
* ``consumer``: ``kv_consumer`` on its own store S2 with remote R: it sees
  the producer's blocks only through R.

vLLM's engine core and worker run inside each job's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: two imports of vLLM fewer each);
tests/vllm/test_pd_http.py runs both roles in vLLM's own process layout.

The consumer runs a prompt as soon as its params appear, so a
read-after-write gap (an upload not finished when the producer answered)
would show as a short hit.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import ucm_db

from pd_helpers import BLOCK_SIZE, build_text_model, remote_files, start_job

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

MAX_TOKENS = 8
#: 156: the consumer's 7 generated tokens complete a 5th block that a saving
#: engine would store; 160: an exact multiple of the block size; 101: short.
LENGTHS = (4 * BLOCK_SIZE + 28, 5 * BLOCK_SIZE, 3 * BLOCK_SIZE + 5)
UNITS_PER_BLOCK = 2  # the test model's KV heads (one unit per head, pipeline stage)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pd_offline")
    model = build_text_model(root / "model")
    remote = f"file://{root / 'remote'}"
    params = root / "params.jsonl"
    common = {"model": str(model), "dtype": "float32", "prompts": _prompts(), "max_tokens": MAX_TOKENS,
              "enforce_eager": True, "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    s2 = str(root / "s2")
    jobs = {
        "producer": start_job({**common, "role": "kv_producer", "params_out": str(params),
                               "connector": {"path": str(root / "s1"), "remote": remote, "publish": "remote"}}, root, "producer"),
        "consumer": start_job({**common, "role": "kv_consumer", "params_in": str(params),
                               "connector": {"path": s2, "remote": remote, "load_deadline_s": 60}}, root, "consumer"),
    }
    try:
        results = {name: job.wait(1400) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()
    with ucm_db.open(s2) as store:
        results["s2_blocks"] = store.stats().blocks
    results["remote_files_after"] = remote_files(remote)
    return results


def _full_blocks_but_last(length: int) -> int:
    return (length - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_producer_publishes_every_full_prompt_block(runs: dict[str, Any]) -> None:
    for length, params in zip(LENGTHS, runs["producer"]["params"]):
        body = params["ucm_db"]
        assert body["blocks"] == length // BLOCK_SIZE and body["tokens"] == length // BLOCK_SIZE * BLOCK_SIZE
        assert body["published_to"] == "remote" and len(body["last_key"]) == 64


def test_consumer_hits_every_published_block(runs: dict[str, Any]) -> None:
    assert runs["consumer"]["cached"] == [_full_blocks_but_last(n) for n in LENGTHS]


def test_consumer_outputs_equal_one_engine(runs: dict[str, Any]) -> None:
    reference = runs["producer"]["reference"]
    assert [len(r) for r in reference] == [MAX_TOKENS] * len(LENGTHS)
    assert runs["consumer"]["outputs"] == reference


def test_consumer_writes_nothing(runs: dict[str, Any]) -> None:
    # Block 4 of the first prompt was computed only by the consumer: a
    # saving engine would have stored it locally and uploaded it.
    assert runs["producer"]["remote_files"] > 0
    assert runs["remote_files_after"] == runs["producer"]["remote_files"]
    # Its local tier holds only what it read through from the remote.
    assert runs["s2_blocks"] == UNITS_PER_BLOCK * sum(_full_blocks_but_last(n) // BLOCK_SIZE for n in LENGTHS)
