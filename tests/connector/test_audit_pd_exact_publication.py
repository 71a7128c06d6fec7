"""A ``kv_producer`` announces only what its store holds, and a reader of
its store during its round sees a prefix of right blocks, never a hole.

Found by the PD audit: a producer announced every block its saves had
*planned* (``committed_blocks``), stored or not. A save the writer dropped
(over ``max_pending_save_bytes``: counted in ``saves_dropped``, nothing
else) was announced all the same, so its consumer waited its whole
``load_deadline_s`` for blocks that never come and counted each as a
publication miss (the metric of a broken read-after-write promise). The
producer looks its chain up in its store when the request finishes now.

Real parts: vLLM's Scheduler, ucm-db's connectors on real stores; the
model runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from stand_in_engine import BS, VOCAB, StandInEngine, greedy, stored_blocks  # noqa: E402

from ucm_db.keys.units import stored_prefix  # noqa: E402

_RNG = random.Random(5)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(20 * BS + 7)]  # 20 whole blocks
CHUNK_BLOCKS = 4


def _prefill_in_chunks(engine: StandInEngine, chunk_blocks: list[int]) -> list[int]:
    """Steps the producer's prefill of PROMPT, ``chunk_blocks[i]`` blocks in
    its step i (vLLM's chunked prefill), to the end; returns how many
    blocks each step saved."""
    saved = []
    engine.add("R", PROMPT, 1)
    for blocks in chunk_blocks + [64]:
        engine.sched.max_num_scheduled_tokens = blocks * BS
        engine.step()
        saved.append(sum(len(t.block_ids) for t in engine.scheduled[-1].kv_connector_metadata.saves))
        if "R" in engine.kv_params:  # finished: its publication is out
            return saved
    raise AssertionError("the prefill did not end")


def test_a_dropped_save_is_not_announced_and_its_consumer_does_not_wait(tmp_path: Path) -> None:
    """A block is 64 KiB here (2 units of 32 KiB): the first chunk's save
    (2 blocks) fits ``max_pending_save_bytes`` (1 MiB), the second's (18
    blocks) never can and is dropped."""
    store = tmp_path / "store"
    prefill = StandInEngine(tmp_path, store, role="kv_producer", extra={"max_pending_save_bytes": 1 << 20})
    assert _prefill_in_chunks(prefill, [2]) == [2, 18]
    published = prefill.kv_params["R"]["ucm_db"]
    dropped = prefill.runner.connector._worker.counters.totals.data["saves_dropped"]  # type: ignore[union-attr]
    prefill.close()
    assert dropped == 18 and stored_blocks(tmp_path, store, PROMPT) == (2, [])
    assert published["blocks"] == 2  # 20 before: every block planned

    decode = StandInEngine(tmp_path, store, role="kv_consumer", extra={"load_deadline_s": 30})
    decode.sched.add_request(Request("D", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                                 extra_args={"kv_transfer_params": {"ucm_db": published}}),
                                     None, block_hasher=decode.hasher))
    decode.run()
    data = decode.ours.counters.totals.data
    decode.close()
    assert decode.scheduled[0].num_scheduled_tokens == {"D": len(PROMPT) - 2 * BS}  # at once: not held for 30 s
    assert data.get("publication_misses", 0) == 0
    assert decode.outputs["D"] == greedy(PROMPT, 2)


def test_a_reader_during_the_producers_round_sees_a_prefix_of_right_blocks(tmp_path: Path) -> None:
    """After each chunk of a chunked prefill, another engine's lookup of the
    prompt finds exactly the blocks committed so far, and each loads right
    (what ran and found nothing wrong: a consumer must see a prefix)."""
    store = tmp_path / "store"
    prefill = StandInEngine(tmp_path, store, role="kv_producer")
    prefill.add("R", PROMPT, 1)
    ours = prefill.ours
    keys = ours.keys_for(Request("k", PROMPT, SamplingParams(max_tokens=1), None), 20)
    seen = []
    for step in range(8):
        prefill.sched.max_num_scheduled_tokens = CHUNK_BLOCKS * BS
        prefill.step()
        prefix = stored_prefix(ours.store, ours.namespace, ours._grid, ours._spans, keys)  # every unit of each block
        seen.append((prefix, *stored_blocks(tmp_path, store, PROMPT)))
        if "R" in prefill.kv_params:
            break
    published = prefill.kv_params["R"]["ucm_db"]["blocks"]
    prefill.close()
    assert seen == [(4, 4, []), (8, 8, []), (12, 12, []), (16, 16, []), (20, 20, []), (20, 20, [])] and published == 20
