"""UcmDbConnector in real vLLM CPU engines, end to end.

One scenario, run once for the module (engine starts dominate the cost):

1. ``reference`` (new process): model A, prefix caching off, ucm-db as a
   consumer of an empty store (it loads and saves nothing, e2e_helpers).
2. ``first`` (this process): model A + ucm-db (block loads), prefix caching
   off, so every reuse inside it goes through the store. Prompts one by one:
   P0, then P1 sharing P0's first 8 blocks, an unrelated P2, P0 again with a
   ``cache_salt``, and PC (used for the corruption check).
3. One stored block of PC's chain gets a flipped byte (through the store's
   tier: a real corrupt payload, not a mock).
4. ``second`` (new process): model A + ucm-db in layer-by-layer mode on the
   same store, all prompts again; at the same time ``other_model`` (new
   process): model B + ucm-db on the same store, the same prompts; and
   ``async`` (new process): model A + ucm-db with asynchronous loads, the
   same prompts submitted together (so loads run beside other requests),
   the model bound to one core and one reserved (ucm-db's threads move
   there), on a copy of the store as step 3 left it (so its repair of the
   corrupt block cannot race ``second``'s finding it).

``first`` and ``async`` run in vLLM's own process layout (engine core and
worker each in a process of their own, ``"processes": "vllm"`` in
``engine_job.py``; vLLM-CPU binds the model thread only there): every other
engine of the suite runs in one process, for time, so these two check the
connector across vLLM's real process boundaries (``first``'s hits within one
engine cross them). The layout does not change outputs: ``second`` and
``reference`` (one process each) must equal ``first`` and ``async`` token for
token. The engines whose outputs are compared run compiled, as vLLM does by
default; ``other_model``, whose outputs are not compared, runs eager.

Every test below asserts on one part of the results.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.connector.warming import warm_engine
from ucm_db.keys import Namespace
from ucm_db.keys.units import KVGrid, unit_key

from e2e_helpers import (
    BLOCK_SIZE, in_process_engine, reference_engine_kwargs, start_engine_process, store_blocks, wait_for_new_blocks,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8
SHARED_BLOCKS = 8
CORRUPT_BLOCK = 2


def _prompts() -> dict[str, dict[str, Any]]:
    rng = random.Random(7)
    tokens = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    shared = tokens(SHARED_BLOCKS * BLOCK_SIZE)
    p0 = shared + tokens(40)
    return {
        "p0": {"ids": p0},
        "p1": {"ids": shared + tokens(40)},
        "p2": {"ids": tokens(200)},
        "p0_salted": {"ids": p0, "cache_salt": "tenant-b"},
        "pc": {"ids": tokens(230)},
    }


#: Full blocks of the prompt ``warm_engine`` stores (and tokens past them).
WARM_BLOCKS, WARM_TAIL = 6, 7


def _warm_prompt() -> dict[str, Any]:
    rng = random.Random(11)
    return {"ids": [rng.randrange(3, 1000) for _ in range(WARM_BLOCKS * BLOCK_SIZE + WARM_TAIL)]}


def _spec(model: Path, store: Path | None, names: list[str], **connector: Any) -> dict[str, Any]:
    prompts = _prompts()
    return {
        "model": str(model), "prefix_caching": False, "max_tokens": MAX_TOKENS,
        "connector": None if store is None else {"path": str(store), **connector},
        "prompts": [prompts[n] for n in names],
    }


def _corrupt_one_block(store_path: Path, token_ids: list[int]) -> bytes:
    """Flips one byte inside the payload of KV head 0's unit of block
    CORRUPT_BLOCK of a chain (the whole block must then be recomputed)."""
    with ucm_db.open(store_path) as store:
        (description,) = store._tier.namespace_descriptions().values()
        layout = json.loads(description["layout"])
        grid = KVGrid(layout["kv_heads"], layout["layers"])
        block_key = Namespace.from_dict(description).block_keys(token_ids)[CORRUPT_BLOCK]
        key = unit_key(block_key, grid.head_spans()[0], grid)
        (blob,) = store._tier.get_batch([key])
        assert blob is not None, "the block to corrupt was never stored"
        damaged = bytearray(blob)
        damaged[-100] ^= 0xFF
        store._tier.engine.write(lambda txn: txn.put("blocks", key, bytes(damaged)))
    return key


@pytest.fixture(scope="module")
def scenario(tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_a, model_b = tiny_models
    work = tmp_path_factory.mktemp("e2e")
    store = work / "store"
    names = list(_prompts())
    reference_spec = {**_spec(model_a, None, names), "engine_kwargs": reference_engine_kwargs(work / "empty")}
    reference = start_engine_process(reference_spec, work, "reference")
    first: dict[str, Any] = {"cached": {}, "outputs": {}, "blocks_after": {}}
    spec = _spec(model_a, store, names)
    with in_process_engine(spec) as llm:
        import engine_job  # imported by in_process_engine

        first["engine_client"] = type(llm.llm_engine.engine_core).__name__

        blocks = 0
        for name in names:
            result = engine_job.run_prompts(llm, [_prompts()[name]], MAX_TOKENS)
            first["cached"][name] = result["cached"][0]
            first["outputs"][name] = result["outputs"][0]
            blocks = wait_for_new_blocks(store, blocks)
            first["blocks_after"][name] = blocks
        # The Python API's warming (README): a prompt stored by running it, with and without a cache salt.
        warm = _warm_prompt()
        first["warm"] = warm_engine(llm, [warm, {**warm, "cache_salt": "warm-tenant"}])
        first["warm_blocks"] = wait_for_new_blocks(store, blocks) - blocks
        first["warm_again"] = warm_engine(llm, [warm, {**warm, "cache_salt": "warm-tenant"}, {**warm, "cache_salt": "cold"}])
        wait_for_new_blocks(store, blocks + first["warm_blocks"])
    ref = reference.wait()
    corrupt_key = _corrupt_one_block(store, _prompts()["pc"]["ids"])
    second = start_engine_process(_spec(model_a, store, names, load_mode="layer"), work, "second")
    other_spec = {**_spec(model_b, store, names), "enforce_eager": True, "wait_for_saves": True}  # p1 hits p0's saves
    other = start_engine_process(other_spec, work, "other_model")
    # vLLM-CPU's layout of the benchmarks: the model bound to core 0, core 1 reserved.
    async_store = shutil.copytree(store, work / "async_store")
    async_spec = {**_spec(model_a, async_store, names, load_mode="async"), "batch": True, "processes": "vllm",
                  "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}}
    async_mode = start_engine_process(async_spec, work, "async")
    results = {"second": second.wait(), "other": other.wait(), "async": async_mode.wait()}
    with ucm_db.open(store) as opened:
        stats = opened.stats()
        quarantine = opened._tier.quarantine_records()
    return {
        "names": names, "reference": dict(zip(names, ref["outputs"])), "first": first,
        "second": results["second"], "other": results["other"], "async": results["async"], "stats": stats,
        "quarantine": quarantine, "corrupt_key": corrupt_key, "store": store,
    }


def test_outputs_with_connector_equal_outputs_without(scenario: dict[str, Any]) -> None:
    assert scenario["first"]["outputs"] == scenario["reference"]


def test_partial_prefix_sharing_loads_the_shared_blocks(scenario: dict[str, Any]) -> None:
    cached = scenario["first"]["cached"]
    assert cached["p0"] == 0
    assert cached["p1"] == SHARED_BLOCKS * BLOCK_SIZE  # only the shared blocks, nothing past them
    assert cached["p2"] == 0


def test_different_cache_salt_never_hits(scenario: dict[str, Any]) -> None:
    # p0 was stored moments before; the same tokens with a salt must miss.
    assert scenario["first"]["cached"]["p0_salted"] == 0


def test_new_process_loads_stored_prefix_with_identical_outputs(scenario: dict[str, Any]) -> None:
    second, names = scenario["second"], scenario["names"]
    outputs = dict(zip(names, second["outputs"]))
    assert outputs == scenario["reference"]
    cached = dict(zip(names, second["cached"]))
    for name in ("p0", "p1", "p2", "p0_salted"):
        prompt_len = len(_prompts()[name]["ids"])
        # Every full block but the one holding the prompt's last token.
        assert cached[name] == (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE, name
    hit_lines = [line for line in second["log"].splitlines() if "hit tokens loaded from ucm-db" in line]
    assert len(hit_lines) == len(names)
    assert all(" 0 hit tokens" not in line for line in hit_lines)


def test_async_loads_give_identical_outputs_and_hit(scenario: dict[str, Any]) -> None:
    run, names = scenario["async"], scenario["names"]
    assert dict(zip(names, run["outputs"])) == scenario["reference"]
    cached = dict(zip(names, run["cached"]))
    for name in ("p0", "p1", "p2", "p0_salted"):
        # The whole stored prefix, loaded beside the other requests.
        assert cached[name] == (len(_prompts()[name]["ids"]) - 1) // BLOCK_SIZE * BLOCK_SIZE, name
    assert "load_mode=async" in run["log"]
    # The model thread is bound; ucm-db's threads (loads, saves) run on the reserved core.
    assert "ucm-db: background threads on CPUs" in run["log"]


def test_corrupt_block_is_recomputed_and_counted(scenario: dict[str, Any]) -> None:
    outputs = dict(zip(scenario["names"], scenario["second"]["outputs"]))
    assert outputs["pc"] == scenario["reference"]["pc"]
    assert "failed to load (missing or corrupt)" in scenario["second"]["log"]
    assert scenario["stats"].quarantined >= 1
    assert scenario["corrupt_key"] in scenario["quarantine"]


def test_other_model_on_same_store_never_hits(scenario: dict[str, Any]) -> None:
    cached = dict(zip(scenario["names"], scenario["other"]["cached"]))
    # Model A stored every one of these prompts; model B's first sight of each
    # must miss. (p1 then hits the prefix model B itself stored for p0.)
    for name in ("p0", "p2", "p0_salted", "pc"):
        assert cached[name] == 0, name
    assert cached["p1"] == SHARED_BLOCKS * BLOCK_SIZE
    assert "hit tokens loaded from ucm-db" in scenario["other"]["log"]
    model_names = {ns.description["model"] for ns in scenario["stats"].namespaces.values()}
    assert len(model_names) == 2, model_names


def test_warm_engine_stores_each_prompt_under_its_own_salt(scenario: dict[str, Any]) -> None:
    first = scenario["first"]
    warm, again = first["warm"], first["warm_again"]
    tokens = WARM_BLOCKS * BLOCK_SIZE + WARM_TAIL
    assert (warm.prompts, warm.prompt_tokens, warm.cached_tokens) == (2, 2 * tokens, 0)
    assert first["warm_blocks"] > 0 and first["warm_blocks"] % 2 == 0  # the same units under each salt
    # Run again: both warmed prompts load their full blocks from the store (vLLM's own cache is off), another salt none.
    assert (again.prompts, again.cached_tokens) == (3, 2 * WARM_BLOCKS * BLOCK_SIZE)


def test_saves_were_committed_in_the_first_engine(scenario: dict[str, Any]) -> None:
    after = scenario["first"]["blocks_after"]
    # p1 adds only its blocks past the shared prefix.
    assert after["p1"] - after["p0"] < after["p0"]
    assert store_blocks(scenario["store"]) >= after["pc"]


def test_first_and_async_ran_in_vllms_own_process_layout(scenario: dict[str, Any]) -> None:
    assert scenario["first"]["engine_client"] == "SyncMPClient"  # first's engine core ran in a process of its own
    log = scenario["async"]["log"]
    assert "(EngineCore" in log and "(Worker" in log  # vLLM's prefixes of its engine-core and worker processes
