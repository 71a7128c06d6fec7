"""``remote_lookup: "background"`` on a real vLLM CPU engine: remote hits
and misses submitted together over a ``throttled://`` link with a round
trip per request. vLLM gets None for a hit while its lookup runs, schedules
the misses meanwhile, asks again, and loads the hit whole once it is local.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
``throttled://`` file system registered here serves the connector; the
remote holds KV-sized random bf16 blocks under the engine's own keys
(:func:`ucm_db.tools.bench.cost.fill_remote`): this test is about what is
loaded and when, tests/vllm/test_connector_e2e.py about loaded values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from e2e_helpers import without_request_proxies  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK_SIZE = 32
PROMPT_TOKENS = 1024
LATENCY_S = 0.03


def test_background_lookups_let_misses_run_and_load_hits_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from ucm_db.tools.bench.cost import fill_remote
    from ucm_db.tools.bench.engine_pass import build_model
    from ucm_db.tools.bench.throttle import register

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    register()
    model_dir = build_model(tmp_path / "model-2x512", layers=2, hidden=512)
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    link = {"path": str(remote_dir), "bandwidth_bytes_per_s": 1e9, "latency_s": LATENCY_S}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with without_request_proxies():
        llm = LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=2048,
            max_num_seqs=4, enable_prefix_caching=True, seed=0, enforce_eager=True,
            kv_transfer_config={
                "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
                "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "path": str(tmp_path / "local"), "codec": "none", "load_policy": "always", "remote": "throttled://kv",
                    "remote_options": link, "remote_deadline_s": 30.0, "remote_lookup": "background",
                    "remote_read_concurrency": 64,
                },
            },
        )
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        assert sched._lookups is not None
        answers: list[int | None] = []
        ask = sched.get_num_new_matched_tokens

        def recording(request, num_computed_tokens):  # type: ignore[no-untyped-def]
            answer = ask(request, num_computed_tokens)
            answers.append(answer[0])
            return answer

        monkeypatch.setattr(sched, "get_num_new_matched_tokens", recording)  # a spy: the real method answers
        rng = np.random.default_rng(11)
        hits = [rng.integers(3, 999, PROMPT_TOKENS).tolist() for _ in range(2)]
        misses = [rng.integers(3, 999, PROMPT_TOKENS).tolist() for _ in range(2)]
        fill = {"remote": "throttled://kv", "remote_options": {**link, "latency_s": 0.0}}
        fill_remote(llm, fill, tmp_path / "writer", hits)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prompts = [hits[0], misses[0], hits[1], misses[1]]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        cached = [int(out.num_cached_tokens or 0) for out in outputs]
        stored = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert cached == [stored, 0, stored, 0]
        assert all(len(out.outputs[0].token_ids) == 2 for out in outputs)
        assert None in answers  # vLLM was told "not yet" and asked again
        assert answers.count(stored) >= 2
    finally:
        llm.llm_engine.engine_core.shutdown()
