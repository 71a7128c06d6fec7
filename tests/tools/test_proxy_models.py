"""``GET /v1/models`` through ``ucm-db proxy`` asks every decode server at
once: a decode server that accepts connections and never answers (or two)
delays no answer. Asked one after another, each such server cost the probe
timeout (``HEALTH_TIMEOUT_S``, 5 s) before the next was asked, so a client
with a shorter timeout (an OpenAI client's model discovery, a load
balancer's check) saw the proxy fail while a decode server was serving.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ucm_db.tools.proxy_upstreams import HEALTH_TIMEOUT_S

from test_proxy_robustness import world  # noqa: F401  (world: the fixture)


@pytest.fixture()
def two_hanging() -> Iterator[list[str]]:
    """Two servers that accept connections (the kernel's backlog) and never answer."""
    with socket.socket() as first, socket.socket() as second:
        urls = []
        for sock in (first, second):
            sock.bind(("127.0.0.1", 0))
            sock.listen(1024)
            urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        yield urls


def test_models_answers_while_decode_servers_hang(world: dict[str, Any], two_hanging: list[str]) -> None:
    proxy = world["proxy"]([world["p"]], [*two_hanging, world["d"]])
    # A client timeout under one probe timeout: only an answer that waited for
    # no hanging server arrives in time. Every turn of the round-robin order.
    with httpx.Client(trust_env=False, timeout=HEALTH_TIMEOUT_S - 1) as client:
        for _ in range(3):
            response = client.get(proxy + "/v1/models")
            assert response.status_code == 200 and response.json()["data"][0]["id"] == "d", response.text


def test_models_is_a_503_naming_the_servers_when_none_answers(world: dict[str, Any], two_hanging: list[str]) -> None:
    proxy = world["proxy"]([world["p"]], two_hanging)
    with httpx.Client(trust_env=False, timeout=HEALTH_TIMEOUT_S * 3) as client:
        response = client.get(proxy + "/v1/models")
    assert response.status_code == 503 and all(url in response.json()["error"]["message"] for url in two_hanging), \
        response.text
