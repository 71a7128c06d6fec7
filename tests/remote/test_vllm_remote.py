"""Two vLLM CPU engines ("nodes") sharing one remote tier: node B, with an
empty local store, gets prefix hits from what node A's engine computed, after
node A's process is gone, and its greedy outputs equal node A's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import ucm_db

VLLM_TESTS = Path(__file__).resolve().parents[1] / "vllm"
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
MAX_TOKENS = 8
FULL_BLOCKS = 8


@pytest.fixture(scope="module")
def helpers():
    pytest.importorskip("vllm")
    sys.path.insert(0, str(VLLM_TESTS))  # e2e_helpers lives there (no package, on purpose)
    try:
        import e2e_helpers
    finally:
        sys.path.remove(str(VLLM_TESTS))
    return e2e_helpers


def test_engine_on_node_b_hits_node_a_remote(helpers, tmp_path: Path) -> None:
    model = helpers.build_tiny_model(tmp_path / "model", seed=0)
    block = helpers.BLOCK_SIZE
    rng = random.Random(11)
    prompt = {"ids": [rng.randrange(3, 1000) for _ in range(FULL_BLOCKS * block + 20)]}
    remote = f"file://{tmp_path}/shared-remote"

    def spec(store: Path, prompts: int = 1) -> dict:
        connector = {"path": str(store), "remote": remote, "remote_deadline_s": 2.0}
        return {"model": str(model), "prefix_caching": False, "enforce_eager": True, "max_tokens": MAX_TOKENS,
                "connector": connector, "prompts": [prompt] * prompts}

    node_a = helpers.start_engine_process(spec(tmp_path / "node-a"), tmp_path, "node_a").wait()
    assert node_a["cached"] == [0]
    # Node A is gone. Its uploader ran while it lived; reopening its store
    # drains whatever it left queued, as a restarted node A would.
    with ucm_db.open(tmp_path / "node-a", remote=remote) as restarted_a:
        stored_a = restarted_a.stats().blocks
        restarted_a.flush(upload_timeout_s=60)
    assert stored_a >= FULL_BLOCKS - 1

    # Node B sends the prompt twice: with load_policy "auto" the first remote
    # hit of a new engine is a 16-block probe that measures the remote (README,
    # "Never slower than recompute"); the second loads every stored block.
    node_b = helpers.start_engine_process(spec(tmp_path / "node-b", prompts=2), tmp_path, "node_b").wait()
    assert node_b["outputs"] == node_a["outputs"] * 2
    assert node_b["cached"][0] >= 4 * block, node_b["log"][-3000:]
    assert node_b["cached"][1] >= (FULL_BLOCKS - 1) * block, node_b["log"][-3000:]
    with ucm_db.open(tmp_path / "node-b") as opened_b:
        stats = opened_b.stats()
    assert stats.blocks >= FULL_BLOCKS - 1  # promoted from the remote into B's local tier
