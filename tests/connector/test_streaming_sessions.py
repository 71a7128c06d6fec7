"""Streaming-input sessions (vLLM 0.32 resumable requests): a session update
rewrites the request in place (vLLM's ``Scheduler._update_request_as_session``:
the last sampled token dropped, new prompt tokens and multimodal items
appended). ucm-db's key chain is made anew from the updated request: the
blocks after an update that adds a multimodal item are keyed with it, and no
block keeps the key of tokens it no longer holds (issue 48). A session
running across ``reset_cache`` saves nothing more: its KV predates the new
epoch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, StreamingUpdate  # noqa: E402

from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

from test_scheduler_worker import BS, _new_step, _shape  # noqa: E402


def _session(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4), None, resumable=True)  # type: ignore[arg-type]


def _update(session: Request, update: StreamingUpdate) -> None:
    """vLLM's own session update, run on the few scheduler fields it reads."""
    fake = SimpleNamespace(hash_block_size=BS, num_waiting_for_streaming_input=0, log_stats=False)
    Scheduler._update_request_as_session(fake, session, update)  # type: ignore[arg-type]


def test_an_update_that_adds_an_image_keys_the_blocks_after_it_with_the_image(tmp_path: Path) -> None:
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        first = list(range(1, 2 * BS + 1))
        session = _session("s", first)
        before = sched.keys_for(session, 2)
        session.num_computed_tokens = len(first)
        image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-7",
                                      mm_position=PlaceholderRange(offset=0, length=BS))
        _update(session, StreamingUpdate(mm_features=[image], prompt_token_ids=[9] * (2 * BS), max_tokens=4,
                                         arrival_time=0.0, sampling_params=SamplingParams(max_tokens=4)))
        assert session.num_tokens == 4 * BS and len(session.mm_features) == 1
        after = sched.keys_for(session, 4)
        assert after[:2] == before  # the blocks before the update keep their keys
        # The same tokens without the image (a plain request) key blocks 2-3 differently.
        plain = Request("p", first + [9] * (2 * BS), SamplingParams(max_tokens=4), None)  # type: ignore[arg-type]
        plain_keys = sched.keys_for(plain, 4)
        assert plain_keys[:2] == before and after[2] != plain_keys[2] and after[3] != plain_keys[3]
    finally:
        sched.shutdown()


def test_an_update_that_drops_the_last_sampled_token_rekeys_its_block(tmp_path: Path) -> None:
    """The last sampled token completed block 1; the update drops it and
    appends new prompt tokens: block 1's key follows the new tokens."""
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        session = _session("s", list(range(1, 2 * BS)))  # one token short of 2 blocks
        session.append_output_token_ids(777)  # sampled: completes block 1
        stale = sched.keys_for(session, 2)
        session.num_computed_tokens = 2 * BS - 1  # the sampled token was never computed
        _update(session, StreamingUpdate(mm_features=None, prompt_token_ids=[5] * (BS + 1), max_tokens=4,
                                         arrival_time=0.0, sampling_params=SamplingParams(max_tokens=4)))
        fresh = Request("f", list(range(1, 2 * BS)) + [5] * (BS + 1), SamplingParams(max_tokens=4), None)  # type: ignore[arg-type]
        assert sched.keys_for(session, 3) == sched.keys_for(fresh, 3)
        assert sched.keys_for(session, 2)[1] != stale[1]
    finally:
        sched.shutdown()


def test_a_session_running_across_a_reset_saves_nothing_more(tmp_path: Path) -> None:
    """The next chunk of a session whose first turn was computed before
    ``reset_cache`` comes without a lookup (vLLM: num_computed_tokens > 0),
    only ``update_state_after_alloc``: the state made anew for the updated
    request keeps the old epoch, so no block computed with the old weights
    is saved under the new epoch's keys."""
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        first = list(range(1, 2 * BS + 1))
        session = _session("s", first)
        ext, _ = sched.get_num_new_matched_tokens(session, 0)
        sched.update_state_after_alloc(session, None, ext)  # type: ignore[arg-type]
        assert [len(t.keys) for t in sched.build_connector_meta(_new_step(session, [0, 1, 2, 3], len(first))).saves] == [2]
        session.num_computed_tokens = len(first)
        session.append_output_token_ids(777)  # sampled, never computed
        assert sched.reset_cache()  # weights updated in place
        _update(session, StreamingUpdate(mm_features=None, prompt_token_ids=[9] * (2 * BS), max_tokens=4,
                                         arrival_time=0.0, sampling_params=SamplingParams(max_tokens=4)))
        sched.update_state_after_alloc(session, None, 0)  # type: ignore[arg-type]
        step = _new_step(session, [0, 1, 2, 3], 2 * BS)  # computes chunk 2 only, over chunk 1's old-weight KV
        step.scheduled_new_reqs = []
        assert sched.build_connector_meta(step).saves == []
        # Preempted, it is looked up and computed anew: saved at the new epoch.
        session.num_computed_tokens = 0
        ext, _ = sched.get_num_new_matched_tokens(session, 0)
        sched.update_state_after_alloc(session, None, ext)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(_new_step(session, [0, 1, 2, 3], session.num_tokens))
        assert [len(t.keys) for t in meta.saves] == [4] and meta.epoch == sched.epoch
    finally:
        sched.shutdown()
