"""``remote_lookup: "background"``: the scheduler answers vLLM "not known
yet" (None) while a remote hit is fetched on a connector thread, then
claims it from the local tier; the lookup loop itself (one job per request,
result handed out once, failures as misses). Real store, real
``throttled://`` remote (a local directory behind one link), real vLLM
``Request`` objects; no engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ucm_db.connector.scheduler.remote_lookups import RemoteLookups

from test_cost_model import BLOCKS, BS, _remote_with, _shape  # noqa: E402


def test_lookup_runs_once_per_key_and_hands_its_result_out_once() -> None:
    lookups = RemoteLookups()
    gate = threading.Event()
    calls: list[str] = []

    def lookup() -> int:
        calls.append("a")
        gate.wait(5)
        return 7

    try:
        lookups.submit("a", lookup)
        lookups.submit("a", lookup)  # already queued: not again
        assert lookups.pending("a") and lookups.take("a") is None
        gate.set()
        lookups.wait("a", 5.0)
        result = lookups.take("a")
        assert result is not None and result.found_blocks == 7 and result.elapsed_s > 0
        assert lookups.take("a") is None and calls == ["a"]
        lookups.submit("b", lambda: 1 // 0)  # a failing lookup finds nothing
        lookups.wait("b", 5.0)
        assert lookups.take("b").found_blocks == 0
        lookups.submit("c", lambda: 3)
        lookups.forget("c")
        assert not lookups.pending("c") and lookups.take("c") is None
    finally:
        lookups.close()


def test_forgotten_lookup_never_runs_if_still_queued() -> None:
    lookups = RemoteLookups(threads=1)
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []
    lookups.submit("busy", lambda: (started.set(), gate.wait(5), ran.append("busy"), 0)[-1])
    assert started.wait(5)  # running, not queued: close() would drop it with the queued one
    lookups.submit("queued", lambda: (ran.append("queued"), 0)[-1])
    lookups.forget("queued")
    gate.set()
    lookups.close()  # waits for the running one
    assert ran == ["busy"]


def _request(tokens: list[int], req_id: str):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


@pytest.mark.vllm
def test_background_lookup_answers_none_until_the_hit_is_local(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    prompt, other = (list(range(1 + s, BS * BLOCKS + 5 + s)) for s in (0, 10_000))
    remote_dir = _remote_with(tmp_path, [prompt])
    # 24 blocks x 2 units x 16 KiB over 0.5 MB/s: about 1.6 s of fetching.
    settings = ConnectorSettings.from_extra_config({
        "path": str(tmp_path / "reader"), "load_policy": "always", "remote": "throttled://kv", "remote_lookup": "background",
        "remote_options": {"path": str(remote_dir), "bandwidth_bytes_per_s": 5e5}, "remote_deadline_s": 10.0,
    })
    sched = UcmDbScheduler(settings, _shape())
    try:
        request = _request(prompt, "r")
        started = time.monotonic()
        assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
        assert time.monotonic() - started < 0.8  # the scheduler did not wait for the link
        polls = 1
        while (answer := sched.get_num_new_matched_tokens(request, 0))[0] is None:
            polls += 1
            assert time.monotonic() - started < 30
            time.sleep(0.02)
        assert answer == (BLOCKS * BS, False) and polls > 2
        # vLLM's hit sources (issue 49), asked after the allocation as vLLM 0.32
        # asks them (test_hit_sources_order.py): these came from the remote tier.
        sched.update_state_after_alloc(request, None, BLOCKS * BS)  # type: ignore[arg-type]
        assert sched.hit_sources(request, BLOCKS * BS) == {"remote": BLOCKS * BS}
        # The blocks are local now: the same prompt again is claimed at once, from the local tier.
        again = _request(prompt, "r2")
        assert sched.get_num_new_matched_tokens(again, 0) == (BLOCKS * BS, False)
        sched.update_state_after_alloc(again, None, BLOCKS * BS)  # type: ignore[arg-type]
        assert sched.hit_sources(again, BLOCKS * BS) == {"disk": BLOCKS * BS}
        ns_id = sched._namespace.digest[:16].hex()
        assert sched.cost.load_rate(ns_id, "remote") is not None  # the lookup's time was a sample
        # A prompt the remote lacks: one background round, then a miss.
        miss = _request(other, "m")
        assert sched.get_num_new_matched_tokens(miss, 0) == (None, False)
        deadline = time.monotonic() + 30
        while (answer := sched.get_num_new_matched_tokens(miss, 0))[0] is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert answer == (0, False)
        assert sched.get_num_new_matched_tokens(miss, 0) == (0, False)  # not asked again
        sched.request_finished(miss, [])
    finally:
        sched.shutdown()


def test_remote_lookup_setting() -> None:
    from ucm_db.connector.settings import ConnectorSettings, valid_keys
    from ucm_db.errors import ConfigError

    assert "remote_lookup" in valid_keys()
    assert ConnectorSettings.from_extra_config({"path": "/tmp/x"}).remote_lookup == "inline"
    with pytest.raises(ConfigError) as caught:
        ConnectorSettings.from_extra_config({"path": "/tmp/x", "remote_lookup": "later"})
    assert "remote_lookup" in caught.value.hint


def _poll(sched, request, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while (answer := sched.get_num_new_matched_tokens(request, 0))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return answer


@pytest.mark.vllm
def test_background_probe_of_an_unmeasured_link_goes_on_to_the_whole_claim(tmp_path: Path) -> None:
    """load_policy auto: the first background job is a probe (16 blocks);
    once it has measured the link fast, the rest of the prompt is decided
    again and fetched, so the hit is claimed whole, not capped at the probe."""
    pytest.importorskip("vllm")
    from test_cost_model import FAST_LINK_PREFILL_TOKENS_PER_S  # noqa: E402

    from ucm_db.connector.scheduler.lookups import PROBE_BLOCKS as _PROBE_BLOCKS
    from ucm_db.connector.scheduler.hooks import UcmDbScheduler
    from ucm_db.connector.settings import ConnectorSettings

    prompt = list(range(1, BS * BLOCKS + 5))
    remote_dir = _remote_with(tmp_path, [prompt])
    settings = ConnectorSettings.from_extra_config({
        "path": str(tmp_path / "reader"), "remote": "throttled://kv", "remote_lookup": "background",
        "remote_options": {"path": str(remote_dir), "bandwidth_bytes_per_s": 1e9},
    })
    sched = UcmDbScheduler(settings, _shape())
    try:
        sched.cost.observe_prefill(int(FAST_LINK_PREFILL_TOKENS_PER_S), 1.0)  # calibration: the link is fast whatever the load
        assert BLOCKS > _PROBE_BLOCKS
        assert _poll(sched, _request(prompt, "r")) == (BLOCKS * BS, False)
    finally:
        sched.shutdown()
