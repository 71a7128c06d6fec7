"""Prefill/decode over HTTP, as users run it (issue 11): two
``python -m vllm.entrypoints.openai.api_server`` processes sharing one store
(prefill ``kv_producer`` at TP=1, decode ``kv_consumer`` at TP=2, one core
per rank) and ``python -m ucm_db.tools.proxy`` in front, driven by the
``openai`` client with text prompts (a word-level tokenizer trained here:
one word, one token).

Consecutive requests use fresh prefixes, so a read-after-write gap between
the prefill answer and the decode lookup shows in
``usage.prompt_tokens_details.cached_tokens``. The last test kills the
prefill server (SIGKILL of its process group) and must stay last.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import maintenance

from pd_helpers import BLOCK_SIZE, TP2_ENV, ServerProcess, build_text_model, free_port, random_text, vllm_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 6
START_TIMEOUT_S = 1200
UNITS_PER_BLOCK = 2  # the test model's KV heads




@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pd_http")
    model = build_text_model(root / "model")
    store = root / "store"
    ports = {"prefill": free_port(), "decode": free_port()}
    servers = {
        "prefill": ServerProcess.start(vllm_server_args(model, ports["prefill"], "kv_producer", {"path": str(store)}, enforce_eager=True),
                                       ports["prefill"], root / "prefill.log", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
        "decode": ServerProcess.start(vllm_server_args(model, ports["decode"], "kv_consumer", {"path": str(store), "load_deadline_s": 30}, tp=2,
                                                       enforce_eager=True),
                                      ports["decode"], root / "decode.log", TP2_ENV),
    }
    try:
        for server in servers.values():
            server.wait_healthy(START_TIMEOUT_S)
        servers["proxy"] = _start_proxy(servers["prefill"].url, servers["decode"].url, root)
        from openai import OpenAI

        yield {"servers": servers, "store": store, "client": OpenAI(base_url=servers["proxy"].url + "/v1", api_key="none", max_retries=0),
               "direct": OpenAI(base_url=servers["prefill"].url + "/v1", api_key="none", max_retries=0), "rng": random.Random(12)}
    finally:
        for server in servers.values():
            server.stop()


def _start_proxy(prefill_url: str, decode_url: str, root: Path, attempts: int = 3) -> ServerProcess:
    """The proxy, healthy, on a port picked just before it starts: a port
    picked with the engines' could be taken while they start (a TP engine's
    process group opens ports of its own), and one taken between the pick
    and the bind is picked again."""
    for attempt in range(attempts):
        port = free_port()
        proxy = ServerProcess.start(["-m", "ucm_db.tools.proxy", "--prefill", prefill_url, "--decode", decode_url,
                                     "--port", str(port)], port, root / f"proxy-{attempt}.log")
        try:
            proxy.wait_healthy(60)
            return proxy
        except AssertionError as exc:
            proxy.stop()
            if "address already in use" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _expected_hit(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_streamed_requests_hit_every_published_block(pd: dict[str, Any]) -> None:
    """Fresh prefixes one after another: 0 read-after-write misses."""
    results = []
    lengths = (4 * BLOCK_SIZE + 28, 4 * BLOCK_SIZE, 3 * BLOCK_SIZE + 17, 6 * BLOCK_SIZE + 1)
    for words in lengths:
        prompt = random_text(pd["rng"], words)
        stream = pd["client"].completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == MAX_TOKENS and text
        results.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    assert [p for p, _ in results] == list(lengths)
    assert [c for _, c in results] == [_expected_hit(p) for p, _ in results]
    # The store holds what prefill computed (max_tokens=1: every full prompt
    # block, one unit per KV head) and nothing of decode's: with 156 prompt
    # tokens, decode completed a 5th block that a saving engine would store.
    with ucm_db.open(pd["store"]) as store:
        assert store.stats().blocks == UNITS_PER_BLOCK * sum(n // BLOCK_SIZE for n in lengths)


def test_decode_text_equals_one_engine(pd: dict[str, Any]) -> None:
    prompt = random_text(pd["rng"], 4 * BLOCK_SIZE + 9)
    through = pd["client"].completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert through.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK_SIZE
    # The same prompt computed whole on the prefill server (a salt of its own: no hit).
    alone = pd["direct"].completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                            extra_body={"cache_salt": "reference"})
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert through.choices[0].text == alone.choices[0].text


def test_chat_completions_through_the_proxy(pd: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": random_text(pd["rng"], 3 * BLOCK_SIZE + 20)}]
    reply = pd["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.prompt_tokens_details.cached_tokens == _expected_hit(reply.usage.prompt_tokens)
    streamed = pd["client"].chat.completions.create(model="tiny", messages=messages + [{"role": "user", "content": "w1 w2"}],
                                                    max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)


def test_prefill_killed_mid_request_the_client_still_gets_a_whole_answer(pd: dict[str, Any]) -> None:
    """SIGKILL of the prefill server while requests are in flight: each
    answer is whole (decode recomputes what prefill did not publish), later
    requests are served, and the store stays consistent."""
    answers: list[Any] = []

    def ask(i: int) -> None:
        try:
            answers.append(pd["client"].completions.create(
                model="tiny", prompt=random_text(random.Random(100 + i), 7 * BLOCK_SIZE), max_tokens=MAX_TOKENS, temperature=0.0))
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
            answers.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    pd["servers"]["prefill"].kill()
    for thread in threads:
        thread.join(300)
    assert len(answers) == 3
    for answer in answers:
        assert not isinstance(answer, Exception), answer
        assert answer.usage.completion_tokens == MAX_TOKENS and answer.choices[0].finish_reason == "length"
    after = pd["client"].completions.create(model="tiny", prompt=random_text(pd["rng"], 2 * BLOCK_SIZE + 5), max_tokens=MAX_TOKENS, temperature=0.0)
    assert after.usage.completion_tokens == MAX_TOKENS and after.usage.prompt_tokens_details.cached_tokens == 0
    report = maintenance.verify(pd["store"], isolated=True)
    assert not report.problems, report
    with ucm_db.open(pd["store"]) as store:
        assert store.stats().blocks > 0
