"""A streaming session's controls, chunk by chunk (audit of 2026-12,
operator controls finding 1).

vLLM 0.32's ``_update_request_as_session`` replaces a session's sampling
parameters with the update's but never its ``kv_transfer_params``; ucm-db
used to read the controls from ``kv_transfer_params`` only, so a later
chunk's ``save: false`` was ignored and its prompt stored. A session's
controls are now read from its sampling parameters' ``extra_args`` (the
current chunk's), and a ``save: false`` holds for every later chunk of the
session (each chunk's prompt holds the earlier chunks' tokens); blocks stored
by earlier chunks stay (they were allowed when stored). ``load`` and
``max_load_tokens`` are each chunk's own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus, StreamingUpdate  # noqa: E402

from ucm_db.connector.request_controls import RequestControls  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

from stand_in_engine import BS, StandInEngine, stored_blocks  # noqa: E402
from test_scheduler_worker import _new_step, _put_units, _shape  # noqa: E402


def _sampling(controls: dict[str, Any] | None, max_tokens: int = 2) -> SamplingParams:
    extra = None if controls is None else {"kv_transfer_params": {"ucm_db": controls}}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def _chunk(engine: StandInEngine, tokens: list[int], controls: dict[str, Any] | None = None) -> Request:
    """One chunk of session "s" through vLLM's own ``add_request`` (the first
    makes the session, a later one is vLLM's session update), run until the
    session waits for its next chunk."""
    engine.sched.add_request(Request("s", tokens, _sampling(controls), None, block_hasher=engine.hasher, resumable=True))
    engine.run()
    session = engine.sched.requests["s"]
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    engine.runner.connector._worker.drain()  # type: ignore[union-attr]
    return session


def test_a_later_chunks_save_false_stores_nothing_from_then_on(tmp_path: Path) -> None:
    """vLLM's real Scheduler runs a three-chunk session: chunk 1 sends no
    controls (stored), chunk 2 ``save: false``, chunk 3 none again."""
    engine = StandInEngine(tmp_path, tmp_path / "store")
    first = [(i * 7) % 97 for i in range(2 * BS + 5)]
    try:
        _chunk(engine, first)
        stored = engine.ours.store.stats().blocks
        assert stored > 0  # chunk 1's two whole blocks (their units)
        _chunk(engine, [(i * 5) % 97 for i in range(2 * BS)], {"save": False})
        assert engine.ours.store.stats().blocks == stored  # was: chunk 2's prompt stored
        session = _chunk(engine, [(i * 3) % 97 for i in range(2 * BS)])  # no controls: save false holds
        assert engine.ours.store.stats().blocks == stored
        assert session.num_tokens > 6 * BS
    finally:
        engine.close()
    # Chunk 1's blocks stay stored, and right (they were allowed when stored).
    assert stored_blocks(tmp_path, tmp_path / "store", first) == (2, [])


def _update(session: Request, tokens: list[int], controls: dict[str, Any] | None) -> None:
    """vLLM's own session update, run on the few scheduler fields it reads."""
    fake = SimpleNamespace(hash_block_size=BS, num_waiting_for_streaming_input=0, log_stats=False)
    update = StreamingUpdate(mm_features=None, prompt_token_ids=tokens, max_tokens=4, arrival_time=0.0,
                             sampling_params=_sampling(controls, 4))
    Scheduler._update_request_as_session(fake, session, update)  # type: ignore[arg-type]


def test_a_later_chunks_load_false_is_honoured_and_is_its_own(tmp_path: Path) -> None:
    """A session looked up again after a chunk's update (vLLM looks up a
    request with nothing computed: a preempted one) follows that chunk's
    ``load``: chunk 2's ``load: false`` claims nothing though the store holds
    the session's blocks; chunk 3, sending none, loads again."""
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        session = Request("s", list(range(1, 2 * BS + 1)), _sampling(None, 4), None, resumable=True)  # type: ignore[arg-type]
        ext, _ = sched.get_num_new_matched_tokens(session, 0)
        sched.update_state_after_alloc(session, None, ext)  # type: ignore[arg-type]
        session.num_computed_tokens = session.num_tokens
        _update(session, [9] * (2 * BS), {"load": False})
        _put_units(sched.store, _shape(), sched.keys_for(session, 4))  # every block of the session is stored
        session.num_computed_tokens = 0  # preempted: looked up anew
        assert sched.get_num_new_matched_tokens(session, 0) == (0, False)  # was (96, False)
        session.num_computed_tokens = session.num_tokens
        _update(session, [8] * BS, None)
        _put_units(sched.store, _shape(), sched.keys_for(session, 5))
        session.num_computed_tokens = 0
        assert sched.get_num_new_matched_tokens(session, 0) == (4 * BS, False)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("later", [{"save": True}, {"save": "always"}, None])
def test_a_first_chunks_save_false_holds_whatever_a_later_chunk_says(tmp_path: Path, later: dict[str, Any] | None) -> None:
    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        first = list(range(1, 2 * BS + 1))
        session = Request("s", list(first), _sampling({"save": False}, 4), None, resumable=True)  # type: ignore[arg-type]
        ext, _ = sched.get_num_new_matched_tokens(session, 0)
        sched.update_state_after_alloc(session, None, ext)  # type: ignore[arg-type]
        assert sched.build_connector_meta(_new_step(session, [0, 1, 2], len(first))).saves == []
        session.num_computed_tokens = len(first)
        _update(session, [9] * (2 * BS), later)
        sched.update_state_after_alloc(session, None, 0)  # type: ignore[arg-type]
        step = _new_step(session, [0, 1, 2, 3, 4], 2 * BS)
        step.scheduled_new_reqs = []
        assert sched.build_connector_meta(step).saves == []
        assert sched._requests["s"].controls.save is False
    finally:
        sched.shutdown()


def test_controls_are_read_where_vllm_keeps_each_chunks() -> None:
    """A session's (resumable request's) from its sampling parameters, any
    other request's from ``kv_transfer_params`` (which vLLM sets from the same
    place when it makes the request; a proxy or test may set it itself)."""
    from ucm_db.connector.request_controls import request_params

    plain = Request("p", [1, 2, 3], _sampling({"save": False}), None)  # type: ignore[arg-type]
    assert request_params(plain) is plain.kv_transfer_params
    plain.kv_transfer_params = {"ucm_db": {"load": False}}
    assert RequestControls.of_request(plain)[0] == RequestControls(load=False)
    session = Request("s", [1, 2, 3], _sampling({"save": False}), None, resumable=True)  # type: ignore[arg-type]
    assert RequestControls.of_request(session)[0] == RequestControls(save=False)
    session.sampling_params = _sampling(None)  # the next chunk's, as _update_request_as_session sets them
    assert request_params(session) is None and RequestControls.of_request(session)[0] == RequestControls()
    session.sampling_params = SamplingParams(max_tokens=2, skip_reading_prefix_cache=True)
    assert RequestControls.of_request(session)[0] == RequestControls(load=False)
