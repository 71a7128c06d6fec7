"""``admit_after`` and ``save_decode`` reach the state groups of a hybrid model (connector/hybrid/ssm_state.py): a
boundary state is stored only inside the prefix every attention group stores in its step, since a hit needs both.
Before, a state group stored every state vLLM offered whatever admission said: states no hit could use.

Real parts as in test_ssm_state.py (vLLM's configs, KV cache specs and scheduler output; both connector halves; a
real store; no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_ssm_state import ATTN_LAYER, BS, TOKENS, _Engine, _kv, _mamba, _request, _step, model_dir  # noqa: E402, F401


def stored(engine: _Engine) -> tuple[int, int]:
    """(state units, attention units) stored."""
    blocks = engine.blocks()
    states = sum(n for extra, n in blocks.items() if '"group":"ssm_state"' in extra)
    attention = sum(n for extra, n in blocks.items() if ATTN_LAYER in extra)
    return states, attention


def prefill(engine: _Engine, req_id: str) -> None:
    """TOKENS' six whole blocks in one step; vLLM offers the state after six."""
    req = _request(req_id, TOKENS)
    engine.lookup(req)
    ids = ([0] * 5 + [7], list(range(11, 17)))
    engine.step(_step(req, ids, 6 * BS, [(0, 7, 6 * BS)]))
    engine.scheduler.request_finished_all_groups(req, ids)


def test_under_admit_after_2_a_state_is_stored_with_its_prefix_from_the_second_sighting(
    model_dir: Path, tmp_path: Path,
) -> None:
    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(1, mamba), mamba, admit_after=2)
    try:
        prefill(engine, "first")
        assert stored(engine) == (0, 0)  # first sighting: the attention groups store nothing, so no state either
        prefill(engine, "second")
        assert stored(engine) == (1, 6 * 2)
    finally:
        engine.close()


def test_without_save_decode_a_state_past_the_prompt_is_not_stored(model_dir: Path, tmp_path: Path) -> None:
    """A prompt of four whole blocks and output tokens past six: the state after four is stored, the one after six
    (holding generated tokens) is not, as the attention groups store only the prompt's blocks."""
    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(1, mamba), mamba, save_decode=False)
    try:
        req = _request("decoded", TOKENS[: 4 * BS + 3])
        engine.lookup(req)
        req.append_output_token_ids(TOKENS[4 * BS + 3:])
        ids = ([0] * 3 + [6, 0, 7], list(range(11, 17)))
        engine.step(_step(req, ids, 6 * BS, [(0, 6, 4 * BS), (0, 7, 6 * BS)]))
        assert stored(engine) == (1, 4 * 2)
    finally:
        engine.close()


def test_with_the_defaults_every_offered_state_is_stored(model_dir: Path, tmp_path: Path) -> None:
    mamba = _mamba()
    engine = _Engine(model_dir, tmp_path / "store", _kv(1, mamba), mamba)
    try:
        prefill(engine, "only")
        assert stored(engine) == (1, 6 * 2)
    finally:
        engine.close()
