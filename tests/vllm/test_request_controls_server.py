"""Per-request controls (issue 49) through vLLM's OpenAI server, as clients
send them: ``kv_transfer_params: {"ucm_db": {...}}`` in the request body,
with the ``openai`` client, on one ``kv_both`` server (started once) with
vLLM's own prefix cache off, so ``usage.prompt_tokens_details.cached_tokens``
is ucm-db's hit alone (the scheduler's per-request log line says the same).

The server's background writer commits a worker's saves in order, so once a
later request's blocks are in the store, an earlier request's would be too.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from e2e_helpers import store_blocks, wait_for_new_blocks
from pd_helpers import BLOCK_SIZE, ServerProcess, build_text_model, free_port, random_text, vllm_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 6
START_TIMEOUT_S = 1200
UNITS_PER_BLOCK = 2  # the test model's KV heads




def test_save_load_and_max_load_tokens_through_the_openai_server(tmp_path: Path) -> None:
    model = build_text_model(tmp_path / "model")
    store = tmp_path / "store"
    port = free_port()
    server = ServerProcess.start(vllm_server_args(model, port, "kv_both", {"path": str(store)}, enforce_eager=True),
                                 port, tmp_path / "server.log", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    try:
        server.wait_healthy(START_TIMEOUT_S)
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def complete(prompt: str, controls: dict[str, Any] | None = None) -> tuple[str, int]:
            extra = {"kv_transfer_params": {"ucm_db": controls}} if controls is not None else None
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)
            assert answer.usage.completion_tokens == MAX_TOKENS
            return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens

        rng = random.Random(49)
        prompt_a, prompt_b = random_text(rng, 4 * BLOCK_SIZE + 9), random_text(rng, 3 * BLOCK_SIZE + 5)  # 4 and 3 whole blocks

        # save: false -- nothing of prompt a is written: b's blocks alone land, and a misses afterwards.
        text_unsaved, cached = complete(prompt_a, {"save": False})
        assert cached == 0
        assert complete(prompt_b)[1] == 0
        assert wait_for_new_blocks(store, 0, at_least=3 * UNITS_PER_BLOCK) == 3 * UNITS_PER_BLOCK
        text_a, cached = complete(prompt_a)
        assert cached == 0 and text_a == text_unsaved
        stored = wait_for_new_blocks(store, 3 * UNITS_PER_BLOCK, at_least=7 * UNITS_PER_BLOCK)
        assert stored == 7 * UNITS_PER_BLOCK

        # load: false -- a is stored now, yet recomputed, with the same output.
        assert complete(prompt_a, {"load": False}) == (text_a, 0)
        assert complete(prompt_a) == (text_a, 4 * BLOCK_SIZE)  # the blocks were there to load

        # max_load_tokens caps the hit in whole blocks.
        assert complete(prompt_a, {"max_load_tokens": BLOCK_SIZE + 20}) == (text_a, BLOCK_SIZE)

        # A bad control is warned about; a malformed one fails closed (save='no': save false), an unknown one is ignored.
        assert complete(prompt_a, {"save": "no", "colour": 1}) == (text_a, 4 * BLOCK_SIZE)
        assert store_blocks(store) == stored

        # "save": "false" (a string) is served as save false: nothing of prompt c is written, d's blocks alone land.
        prompt_c, prompt_d = random_text(rng, 3 * BLOCK_SIZE + 7), random_text(rng, 2 * BLOCK_SIZE + 3)
        text_c, cached = complete(prompt_c, {"save": "false"})
        assert cached == 0
        assert complete(prompt_d)[1] == 0
        assert wait_for_new_blocks(store, stored, at_least=stored + 2 * UNITS_PER_BLOCK) == stored + 2 * UNITS_PER_BLOCK
        assert complete(prompt_c) == (text_c, 0)  # c was not stored
        # A malformed load or max_load_tokens loads nothing: a is stored, yet recomputed.
        assert complete(prompt_a, {"load": "no"}) == (text_a, 0)
        assert complete(prompt_a, {"max_load_tokens": "12"}) == (text_a, 0)
    finally:
        server.stop()
    log = server.log()
    assert log.count("not looked up (load off") == 3  # load false, load 'no', max_load_tokens '12'
    assert log.count("bad controls in kv_transfer_params['ucm_db']: save='no' (wants true, false or \"always\"): served as save false; "
                     "unknown field 'colour' (ignored)") == 1
    for said in ("save='false' (wants true, false or \"always\"): served as save false",
                 "load='no' (wants true or false): served as load false",
                 "max_load_tokens='12' (wants an integer >= 0): served as max_load_tokens 0"):
        assert log.count(said) == 1, said
    hits = [line.split(" hit tokens loaded from ucm-db")[0].rsplit(" ", 1)[-1] for line in log.splitlines()
            if "hit tokens loaded from ucm-db" in line]
    assert hits == ["0", "0", "0", str(4 * BLOCK_SIZE), str(BLOCK_SIZE), str(4 * BLOCK_SIZE), "0", "0", "0"]
