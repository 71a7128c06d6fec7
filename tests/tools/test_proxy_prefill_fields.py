"""The prefill request of ``ucm-db proxy`` leaves out the prompt's logprobs
and ``echo``: the answer is read only for its ``kv_transfer_params``, and
with ``prompt_logprobs`` it held a whole prompt's logprobs (a long prompt's
ran past the 16 MiB the proxy reads of a prefill answer, and the reuse was
lost) computed with vLLM's prefix cache off. The decode request keeps both
fields as the client sent them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ucm_db.tools.proxy_request import decode_body, prefill_body, prepare

from test_proxy_robustness import _complete, world  # noqa: F401  (world: the fixture)


@pytest.mark.parametrize("fields", [{"prompt_logprobs": 5}, {"echo": True, "logprobs": 2},
                                    {"prompt_logprobs": 0, "echo": False}])
def test_the_prefill_request_drops_prompt_logprobs_and_echo(fields: dict[str, Any]) -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, **fields}
    prepared = prepare(json.dumps(body).encode())
    prefill = json.loads(prepared.prefill_payload())
    assert "prompt_logprobs" not in prefill and "echo" not in prefill
    assert prefill == prefill_body(body) and prefill["max_tokens"] == 1 and prefill.get("logprobs") == body.get("logprobs")
    assert json.loads(prepared.decode_payload(None)) == decode_body(body, None) == body


def test_the_servers_get_them_through_the_proxy(world: dict[str, Any]) -> None:
    proxy = world["proxy"]([world["p"]], [world["d"]])
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "prompt_logprobs": 20, "echo": True}
    response = _complete(proxy, body)
    assert response.status_code == 200 and response.headers["x-ucm-db-prefill"] == "ok", response.text
    sent = {name: request for name, _, request in world["seen"][-2:]}
    assert "prompt_logprobs" not in sent["p"] and "echo" not in sent["p"]
    assert sent["d"]["prompt_logprobs"] == 20 and sent["d"]["echo"] is True
