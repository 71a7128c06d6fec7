"""Load or recompute on a real vLLM CPU engine over a throttled remote tier.

One engine, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
scheduler and the worker run here, so the ``throttled://`` file system
registered here serves them, and the test can turn its link down mid-run,
as a degraded network would). The remote holds KV-sized blocks for the
measured prompts, written through a real store with the engine's own keys
and unit sizes (:func:`ucm_db.tools.bench.cost.fill_remote`; random finite
bf16 values: this test is about what is loaded and when,
tests/vllm/test_connector_e2e.py about the loaded KV's values). The engine
is a ``kv_consumer``: it loads only, so no upload shares the link.

The story, one prompt at a time:

1. two unstored prompts: the cost model learns the prefill rate from the
   steps' round trips (nothing else teaches it);
2. fast link, first remote hit: the unmeasured remote is probed (a few
   blocks), and the worker's load timings teach the local tier's rate;
3. fast link, second hit: loaded whole (faster than recomputing);
4. the link falls to 1/8 of the break-even bandwidth (computed from the
   measured prefill rate, so the test holds on a fast or a loaded
   machine): the next hit, a short one, is still loaded (the model does
   not know yet) and measured slow;
5. slow link, last hit: recomputed, the remote not even asked (nothing
   promoted), in about the time of the unstored prompts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db

from e2e_helpers import without_request_proxies

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK_SIZE = 32
PROMPT_TOKENS = 1024
#: The hit that teaches the model the link fell: short, since it is loaded
#: at 8x its recompute time.
SHORT_TOKENS = 5 * BLOCK_SIZE
FAST_BYTES_PER_S = 2e9
#: The slow link, as a fraction of the break-even bandwidth.
SLOW_FRACTION = 1 / 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ucm_db.tools.bench.engine_pass import build_model

    # Large enough that a prefill step's time is the model's, not overhead.
    return build_model(tmp_path_factory.mktemp("models") / "cost-4x512", layers=4, hidden=512)



def test_remote_hit_slower_than_recompute_is_recomputed_faster_one_loaded(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm")
    from ucm_db.remote.files import open_filesystem
    from ucm_db.tools.bench.cost import fill_remote
    from ucm_db.tools.bench.throttle import register

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    register()
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    link = {"path": str(remote_dir), "bandwidth_bytes_per_s": FAST_BYTES_PER_S}
    remote = {"remote": "throttled://kv", "remote_options": link, "remote_deadline_s": 60.0}
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    with without_request_proxies():
        llm = LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=2048,
            max_num_seqs=2, enable_prefix_caching=True, seed=0, enforce_eager=True,
            kv_transfer_config={
                "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
                "kv_role": "kv_consumer",  # loads only: no upload competes for the link
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"path": str(tmp_path / "local"), "codec": "none", **remote},
            },
        )
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        worker = get_kv_transfer_group()._worker
        ns_id, cost = sched._ns_id, sched.cost
        rng = np.random.default_rng(7)
        unstored = [rng.integers(3, 999, PROMPT_TOKENS).tolist() for _ in range(2)]
        hits = [rng.integers(3, 999, n).tolist() for n in (PROMPT_TOKENS, PROMPT_TOKENS, SHORT_TOKENS, PROMPT_TOKENS)]
        fill_remote(llm, remote, tmp_path / "writer", hits)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        def stored_tokens(ids: list[int]) -> int:
            return (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE

        def run(ids: list[int]) -> tuple[int, float]:
            started = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            return int(out.num_cached_tokens or 0), time.perf_counter() - started

        unstored_s = []
        for ids in unstored:  # 1. the prefill rate
            cached, seconds = run(ids)
            assert cached == 0
            unstored_s.append(seconds)
        assert cost.prefill.rate is not None and cost.load_rate(ns_id, "remote") is None

        probed, _ = run(hits[0])  # 2. probe of the unmeasured remote
        from ucm_db.connector.scheduler.lookups import PROBE_BLOCKS as _PROBE_BLOCKS

        # The probe's first segment, and the rest of the prompt if the probe measured the link faster than prefill.
        assert probed in (_PROBE_BLOCKS * BLOCK_SIZE, stored_tokens(hits[0])), (probed, cost.describe(ns_id))
        assert cost.load_rate(ns_id, "remote") is not None and cost.load_rate(ns_id, "local") is not None
        loaded, _ = run(hits[1])  # 3. fast: loaded whole
        assert loaded == stored_tokens(hits[1]), cost.describe(ns_id)

        fs, _ = open_filesystem("throttled://kv", link)  # the engine's instance: fsspec caches it per URL and options
        break_even = cost.prefill.rate * worker.layout.block_bytes / BLOCK_SIZE  # bytes/s
        fs.bucket.rate = break_even * SLOW_FRACTION  # 4. the link degrades
        fs.bucket._burst = fs.bucket.rate * 0.01
        slow_loaded, _ = run(hits[2])
        assert slow_loaded == stored_tokens(hits[2])
        assert not cost.faster_than_recompute(ns_id, "remote"), cost.describe(ns_id)

        skipped_before = cost.skipped["remote"]
        recomputed, recompute_s = run(hits[3])  # 5. slow: recomputed, remote not asked
        assert recomputed == 0 and cost.skipped["remote"] > skipped_before
        keys = sched.keys_for(_request(hits[3]), 1)
        from ucm_db.keys.units import UnitKeys
        from ucm_db.connector.identity import reader_spans

        first_unit = list(UnitKeys(keys, sched._grid, reader_spans(worker._shape)[0]))
        assert sched.store.lookup(sched._namespace, first_unit, remote=False) == 0  # nothing promoted
        # As fast as recomputing (generous: the machine is shared), where
        # loading would have taken 8x that.
        assert recompute_s < 1.5 * max(unstored_s), (recompute_s, unstored_s, cost.describe(ns_id))
    finally:
        llm.llm_engine.engine_core.shutdown()


def _request(ids: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("keys", ids, SamplingParams(max_tokens=1), None)
